// Branches on the chat page: the server keeps a conversation as a tree, so an edited question or a
// regenerated reply keeps the old one as a sibling; `< 2/3 >` under a message that has siblings
// moves between them (POST .../select: the path follows that sibling's latest reply). And export
// (a .json download of the whole tree, settings and pictures) and import (a new conversation).
// chat.js owns the conversation; it hands this module a few hooks through ChatBranches.init.
"use strict";
(function () {
  const { api, el } = App;
  let chat = null;   // { conv(), adopt(stored), busy(), open(id), showError(err) } from chat.js

  // The `< i/n >` control for message `m`, or null when it has no siblings.
  function nav(m) {
    if (!m.id || !(m.n_siblings > 1)) return null;
    const i = m.sibling_index, n = m.n_siblings;
    const go = (k) => () => select(m.siblings[k]);
    return el("span", { class: "branches", "data-branch": `${i + 1}/${n}` },
      el("button", { type: "button", class: "prevbranch", text: "‹", title: "previous version", "aria-label": "previous version",
                     disabled: i === 0, onclick: go(i - 1) }),
      el("span", { class: "branchpos muted", text: `${i + 1}/${n}` }),
      el("button", { type: "button", class: "nextbranch", text: "›", title: "next version", "aria-label": "next version",
                     disabled: i === n - 1, onclick: go(i + 1) }));
  }

  async function select(messageId) {
    const conv = chat.conv();
    if (chat.busy() || !conv.id) return;
    try { chat.adopt(await api(`/api/conversations/${conv.id}/select`, { json: { message_id: messageId } })); }
    catch (err) { chat.showError(err); }
  }

  function fileName(title) {
    return (title.replace(/[^\w\- ]+/g, "_").trim().slice(0, 80) || "conversation") + ".json";
  }

  async function exportConv() {
    const conv = chat.conv();
    if (!conv.id) return;
    try {
      const doc = await api(`/api/conversations/${conv.id}/export`);
      const url = URL.createObjectURL(new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" }));
      const a = el("a", { href: url, download: fileName(doc.title), hidden: true });
      document.body.append(a); a.click(); a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) { chat.showError(err); }
  }

  async function importFile(file) {
    let doc;
    try { doc = JSON.parse(await file.text()); }
    catch (err) { chat.showError(new Error(`${file.name}: not a JSON file`)); return; }
    try {
      const made = await api("/api/conversations/import", { json: doc });
      await chat.open(made.id);
    } catch (err) { chat.showError(new Error(`${file.name} was not imported: ${err.message}`)); }
  }

  function init(hooks) {
    chat = hooks;
    const input = document.getElementById("import-file");
    document.getElementById("export").addEventListener("click", exportConv);
    document.getElementById("import").addEventListener("click", () => input.click());
    input.addEventListener("change", (e) => { const f = e.target.files[0]; e.target.value = ""; if (f) importFile(f); });
  }

  window.ChatBranches = { init, nav };
})();

// Documents attached to a chat message: text, markdown, code and PDF files. Each is read by the
// server (POST /api/documents: a PDF's text layer, a text file's charset), which answers its text
// framed for the message ("File: name", then the text fenced) and its size in the model's
// tokens. A file that would not fit the context (the conversation so far, the message, the
// documents already attached and max tokens) is refused here, with the numbers. Attached ones
// are chips over the composer, then on the message, stored with it (its `documents`); what the
// model is sent is each document's framed text, then the message's own text.
"use strict";
(function () {
  const { api, el, fmt } = App;
  let pending = [];        // [{name, kind, pages, tokens, content}] for the next message
  let hooks = null;        // from chat.js: context() -> {nCtx, used, maxTokens}, model(), showError(err), changed()

  const isDocument = (file) => !file.type.startsWith("image/");

  function readDataUri(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onerror = () => reject(new Error(`${file.name}: could not be read`));
      reader.onload = () => resolve(reader.result);
      reader.readAsDataURL(file);
    });
  }

  const pendingTokens = () => pending.reduce((n, d) => n + d.tokens, 0);

  // The words of a refusal when `extra` more tokens would not fit; null when they do (or while
  // the context size is not known yet).
  function overflow(what, extra) {
    const { nCtx, used, maxTokens } = hooks.context();
    const already = pendingTokens(), need = used + already + extra + maxTokens;
    if (!nCtx || need <= nCtx) return null;
    return `${what}: ${fmt.int(extra)} tokens; with the conversation and message so far (${fmt.int(used)})` +
      (already ? `, the documents already attached (${fmt.int(already)})` : "") +
      ` and max tokens (${fmt.int(maxTokens)}) the turn needs ${fmt.int(need)} tokens, over the model's context of ${fmt.int(nCtx)}`;
  }

  async function attach(file) {
    try {
      const data = await readDataUri(file);
      const model = hooks.model();
      const doc = await api("/api/documents", { json: { name: file.name, data, ...(model ? { model } : {}) } });
      const refused = overflow(`${doc.name} is too large for the context`, doc.tokens);
      if (refused) throw new Error(refused);
      pending.push({ name: doc.name, kind: doc.kind, pages: doc.pages, tokens: doc.tokens, content: doc.content });
    } catch (err) {
      const size = err.status === 413 ? ` (${fmt.bytes(file.size)}, ${fmt.bytes(Math.ceil(file.size / 3) * 4)} as sent)` : "";
      hooks.showError(new Error(err.message.startsWith(file.name) ? err.message : `${file.name}${size}: ${err.message}`));
    }
    showPending();
  }

  // Checked again when the message is sent: max tokens or the message may have grown since.
  function refuseSend() {
    if (!pending.length) return false;
    const refused = overflow("the attached documents", 0);
    if (refused) hooks.showError(new Error(refused));
    return !!refused;
  }

  function take() { const docs = pending; pending = []; showPending(); return docs; }

  function label(d) {
    return d.name + (d.pages ? ` · ${d.pages} page${d.pages === 1 ? "" : "s"}` : "") + ` · ${fmt.int(d.tokens)} tokens`;
  }

  function chip(d, remove) {
    return el("span", { class: "doc-chip", title: `${d.kind === "pdf" ? "PDF" : "text"}, sent to the model as its text` },
      el("span", { class: "doc-name", text: label(d) }),
      remove ? el("button", { type: "button", class: "unattach-doc", text: "×", title: "remove", onclick: remove }) : null);
  }

  function showPending() {
    document.getElementById("documents").replaceChildren(...pending.map((d, k) => chip(d, () => { pending.splice(k, 1); showPending(); })));
    if (hooks) hooks.changed();
  }

  // A stored message's documents, as chips (null when it has none).
  function chips(m) {
    return m.documents && m.documents.length ? el("div", { class: "doc-chips" }, m.documents.map((d) => chip(d, null))) : null;
  }

  // What the model is sent for a message: its documents' framed text, then its own.
  function content(m) {
    const docs = (m.documents || []).map((d) => d.content);
    return docs.length ? [...docs, m.content || ""].join("\n\n") : m.content || "";
  }

  window.ChatDocs = { init: (h) => { hooks = h; }, isDocument, attach, refuseSend, take, pendingTokens, chips, content };
})();

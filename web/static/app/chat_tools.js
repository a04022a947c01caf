// The chat page's tools panel: the MCP servers the owner configured (GET /api/tools), each with
// its state, its error and its tools, and per conversation a choice of tools, kept in the
// conversation's settings as "tools": [name, ...]. The panel is hidden when no server is
// configured. chat.js tells it which conversation shows (App.chatTools.show), asks it for the
// choice when it reads the settings (chosen) and hears of a change (onChange).
"use strict";
(function () {
  const { api, el } = App;
  const $ = (id) => document.getElementById(id);
  let servers = [];             // /api/tools' servers
  let chosen = [];              // the shown conversation's settings.tools
  let changed = () => {};

  async function load() {
    try {
      servers = (await api("/api/tools")).servers;
    } catch (err) {
      servers = [];
      $("tools-note").textContent = "the tools could not be listed: " + err.message;
    }
    render();
  }

  function toggled(e) {
    const name = e.target.value;
    chosen = e.target.checked ? [...chosen.filter((n) => n !== name), name] : chosen.filter((n) => n !== name);
    summarize();
    changed();
  }

  function toolRow(t) {
    return el("label", { class: "tool", title: t.description, "data-tool": t.name },
      el("input", { type: "checkbox", value: t.name, checked: chosen.includes(t.name), onchange: toggled }),
      el("code", { text: t.tool }),
      el("span", { class: "tool-desc muted", text: t.description }),
      t.auto_approve ? el("span", { class: "tool-badge", text: "runs unasked", title: "the owner set this tool to run without asking" }) : null);
  }

  function serverBlock(s) {
    return el("fieldset", { class: "tool-server", "data-server": s.name },
      el("legend", {}, el("strong", { text: s.name }), el("span", { class: "muted", text: ` ${s.transport} · ${s.state}` })),
      s.error ? el("p", { class: "tool-error", text: s.error }) : null,
      s.tools.length ? s.tools.map(toolRow) : el("p", { class: "muted", text: "no tools listed" }));
  }

  function render() {
    const panel = $("tools-panel");
    panel.hidden = servers.length === 0;
    if (panel.hidden) return;
    const offered = new Set(servers.flatMap((s) => s.tools.map((t) => t.name)));
    const absent = chosen.filter((n) => !offered.has(n));
    $("tools-list").replaceChildren(...servers.map(serverBlock),
      absent.length ? el("p", { class: "muted tools-absent", text: "chosen, but not offered now (its server is down): " + absent.join(", ") }) : null);
    summarize();
  }

  function summarize() {
    const n = chosen.length;
    $("tools-summary").textContent = n ? `${n} chosen` : "none chosen";
  }

  window.App.chatTools = {
    show(tools) { chosen = Array.isArray(tools) ? [...tools] : []; render(); },
    chosen: () => [...chosen],
    onChange(f) { changed = f; },
    reload: load,
  };
  $("tools-refresh").addEventListener("click", load);
  load();
})();

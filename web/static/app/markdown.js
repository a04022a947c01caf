// Markdown for replies: marked (GFM) with raw HTML shown as text, the result sanitised by
// DOMPurify all the same, code blocks highlighted by highlight.js with a copy button.
"use strict";
(function () {
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const md = new marked.Marked({ gfm: true, breaks: false });
  md.use({
    renderer: {
      // a model's raw HTML (block or inline) is text, never markup
      html(token) { return escapeHtml(token.text || token.raw || ""); },
      code(token) {
        const lang = (token.lang || "").match(/^[\w+#.-]*/)[0];
        return `<pre><code${lang ? ` class="language-${escapeHtml(lang)}"` : ""}>${escapeHtml(token.text)}</code></pre>\n`;
      },
    },
  });

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    const ta = document.createElement("textarea");
    ta.value = text; document.body.append(ta); ta.select();
    document.execCommand("copy"); ta.remove();
    return Promise.resolve();
  }

  function decorate(root, highlight) {
    for (const code of root.querySelectorAll("pre > code")) {
      const pre = code.parentElement;
      if (highlight && !code.dataset.highlighted && window.hljs) {
        const lang = (code.className.match(/language-([\w+#.-]+)/) || [])[1];
        if (!lang || hljs.getLanguage(lang)) hljs.highlightElement(code);
      }
      if (!pre.querySelector(".copy")) {
        const btn = App.el("button", { class: "copy", type: "button", title: "Copy the code", text: "Copy" });
        btn.addEventListener("click", () => copyText(code.textContent).then(() => {
          btn.textContent = "Copied"; setTimeout(() => (btn.textContent = "Copy"), 1500);
        }));
        pre.prepend(btn);
      }
    }
    for (const a of root.querySelectorAll("a[href]")) { a.target = "_blank"; a.rel = "noopener noreferrer"; }
  }

  // Render `text` into `node`; `final` also highlights code (skipped while streaming, for speed).
  function render(node, text, final) {
    node.innerHTML = DOMPurify.sanitize(md.parse(text), { USE_PROFILES: { html: true } });
    decorate(node, final);
  }

  window.Markdown = { render, copyText };
})();

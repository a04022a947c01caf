// The chat page: conversations stored by the server (/api/conversations), replies streamed from
// /v1/chat/completions and rendered as markdown, reasoning folded, tool calls shown, and under
// each reply the engine's timings (TTFT, prefill and decode rates, cached tokens, depth, drafts).
// Pictures attached, pasted or dropped go with a message (stored with it as data: URIs, shown as
// thumbnails) to a model that takes images; to one that does not, the page says so and sends the text.
// Documents (text, code, PDF) attach through chat_docs.js.
"use strict";
(function () {
  const { api, sse, el, fmt } = App;
  const $ = (id) => document.getElementById(id);
  const log = $("log"), input = $("input"), sendBtn = $("send"), stopBtn = $("stop");
  const DEFAULTS = { system: "", temperature: 0.7, top_p: 1.0, max_tokens: 1024, seed: null, thinking: null, model: null, tools: [] };
  const SETTING_INPUTS = ["system", "temperature", "top_p", "max_tokens", "seed", "thinking", "model"];

  let conv = fresh();          // {id, title, settings, messages}
  let controller = null;       // the running generation's AbortController
  let nCtx = 0, lastDepth = 0, inputTokens = 0;
  let pending = [];            // data: URIs of the pictures for the next message
  const visionOf = {};         // model id -> whether it takes images (loaded models, /v1/models)
  const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"], MAX_IMAGES = 16, MAX_SIDE = 2048;
  const MAX_URI = 1 << 20;     // a picture's data: URI past this is sent as a JPEG: every turn resends the history

  function fresh() { return { id: null, title: "New conversation", settings: Object.assign({}, DEFAULTS), messages: [] }; }
  const busy = () => controller !== null;

  // ---- the conversation list -----------------------------------------------------------------
  async function refreshList() {
    const q = $("search").value.trim();
    const list = await api("/api/conversations" + (q ? "?q=" + encodeURIComponent(q) : ""));
    $("convs").replaceChildren(...list.data.map((c) => el("li", {
      class: c.id === conv.id ? "conv active" : "conv", "data-id": c.id,
      onclick: () => open(c.id),
    }, el("span", { class: "ctitle", text: c.title }), el("span", { class: "cwhen muted", text: fmt.when(c.updated_at) }))));
  }

  async function open(id) {
    if (busy()) controller.abort();
    conv = await api("/api/conversations/" + id);
    conv.settings = Object.assign({}, DEFAULTS, conv.settings);
    location.hash = id;
    document.body.classList.remove("menu-open");
    showSettings(); renderAll(); refreshList();
  }

  function newChat() {
    if (busy()) controller.abort();
    const settings = Object.assign({}, conv.settings);   // a new chat keeps the last settings
    conv = fresh(); conv.settings = settings;
    history.replaceState(null, "", location.pathname);
    document.body.classList.remove("menu-open");
    showSettings(); renderAll(); refreshList(); input.focus();
  }

  async function ensureSaved(firstText) {
    if (conv.id) return;
    const title = firstText.replace(/\s+/g, " ").trim().slice(0, 60) || "New conversation";
    const created = await api("/api/conversations", { json: { title, settings: conv.settings } });
    conv.id = created.id; conv.title = created.title;
    history.replaceState(null, "", "#" + conv.id);
  }

  // Store messages at position `from` of the path shown (a new branch there: the server keeps the
  // old one), or replace the message `replaceId` (a continued reply); the page takes the server's path.
  async function saveMessages(from, messages, replaceId) {
    const stored = replaceId ? await api(`/api/conversations/${conv.id}/messages/${replaceId}`, { method: "PUT", json: messages[0] })
      : await api(`/api/conversations/${conv.id}/messages`, { json: { from, messages } });
    if (stored.id === conv.id) conv.messages = stored.messages;
    refreshList();
    return stored;
  }

  // ---- settings ------------------------------------------------------------------------------
  function showSettings() {
    const s = conv.settings;
    $("system").value = s.system || "";
    $("temperature").value = s.temperature;
    $("top_p").value = s.top_p;
    $("max_tokens").value = s.max_tokens;
    $("seed").value = s.seed === null ? "" : s.seed;
    $("thinking").value = s.thinking === null ? "" : s.thinking ? "on" : "off";
    if (s.model && ![...$("model").options].some((o) => o.value === s.model)) $("model").append(el("option", { value: s.model, text: s.model }));
    $("model").value = s.model || "";
    App.chatTools.show(s.tools);
    $("title").textContent = conv.title;
    summarizeSettings();
  }

  function readSettings() {
    const num = (id, fallback) => { const v = $(id).value.trim(); return v === "" || isNaN(Number(v)) ? fallback : Number(v); };
    const thinking = $("thinking").value;
    return {
      system: $("system").value, temperature: num("temperature", DEFAULTS.temperature), top_p: num("top_p", DEFAULTS.top_p),
      max_tokens: Math.max(1, Math.round(num("max_tokens", DEFAULTS.max_tokens))),
      seed: $("seed").value.trim() === "" ? null : Math.round(num("seed", 0)),
      thinking: thinking === "" ? null : thinking === "on", model: $("model").value || null,
      tools: App.chatTools.chosen(),
    };
  }

  function summarizeSettings() {
    const s = conv.settings;
    $("settings-summary").textContent = `temperature ${s.temperature} · top-p ${s.top_p} · max ${s.max_tokens} tokens` +
      (s.seed !== null ? ` · seed ${s.seed}` : "") + (s.system ? " · system prompt" : "") +
      (s.thinking !== null ? ` · thinking ${s.thinking ? "on" : "off"}` : "");
  }

  let settingsTimer = null;
  function settingsChanged() {
    conv.settings = readSettings();
    summarizeSettings(); updateMeter();
    if (!conv.id) return;
    clearTimeout(settingsTimer);
    const id = conv.id, settings = conv.settings;
    settingsTimer = setTimeout(() => api("/api/conversations/" + id, { method: "PATCH", json: { settings } }).catch(showError), 300);
  }

  async function loadModels() {
    try {
      const models = await api("/v1/models");
      const sel = $("model"), keep = sel.value;
      sel.replaceChildren(el("option", { value: "", text: "server default" }),
        ...models.data.map((m) => el("option", { value: m.id, text: m.id + (m.status && m.status.value && m.status.value !== "loaded" ? ` (${m.status.value})` : "") })));
      sel.value = keep;
      for (const m of models.data) if (m.meta) visionOf[m.id] = !!m.meta.vision;
      updateVisionNote();
    } catch (err) { /* the status strip says what is wrong */ }
  }

  // ---- rendering -----------------------------------------------------------------------------
  function renderAll() {
    log.replaceChildren(...conv.messages.map((m, i) => messageNode(m, i)));
    if (!conv.messages.length) log.append(emptyNode());
    const last = [...conv.messages].reverse().find((m) => m.timings);
    lastDepth = last ? last.timings.depth || 0 : 0;
    updateMeter(); updateVisionNote();
    log.scrollTop = log.scrollHeight;
  }

  function emptyNode() {
    const h = App.health() || {};
    const model = conv.settings.model || h.model;
    return el("div", { class: "empty muted" },
      el("p", { text: model ? `Talking to ${model}` + (h.n_ctx ? `, ${fmt.int(h.n_ctx)} tokens of context.` : ".") : "Start a conversation." }),
      el("p", { text: "Replies are stored on this appliance with their timings; Settings sets the system prompt and sampling for this conversation." }));
  }

  function messageNode(m, i) {
    const wrap = el("div", { class: "turn " + m.role, "data-index": i });
    if (m.role === "user") {
      const thumbs = (m.images || []).map((url, k) => el("img", { class: "thumb", src: url, alt: `picture ${k + 1}` }));
      wrap.append(el("div", { class: "msg user" }, thumbs.length ? el("div", { class: "thumbs" }, thumbs) : null, ChatDocs.chips(m),
                     el("span", { class: "text", text: m.content })),
        el("div", { class: "actions" }, ChatBranches.nav(m), el("button", { type: "button", class: "edit", text: "Edit", onclick: () => editMessage(i) })));
    } else if (m.role === "tool") {
      wrap.append(el("div", { class: "msg tool" }, el("div", { class: "label", text: `tool result${m.tool_call_id ? " · " + m.tool_call_id : ""}` }),
        el("pre", { text: m.content })));
    } else {
      const node = el("div", { class: "msg assistant" });
      wrap.append(node);
      fillAssistant(node, m, true);
      wrap.append(statsNode(m), actionsNode(m, i));
    }
    return wrap;
  }

  function fillAssistant(node, m, final) {
    let r = node.querySelector(".reasoning");
    if (m.reasoning_content) {
      if (!r) {
        r = el("details", { class: "reasoning" }, el("summary"), el("div", { class: "rtext" }));
        node.prepend(r);
      }
      r.querySelector("summary").textContent = (final ? "Reasoning" : "Thinking…") + ` · ${fmt.int(m.reasoning_content.length)} characters`;
      r.querySelector(".rtext").textContent = m.reasoning_content;
    }
    let bar = node.querySelector(".prefill");
    const reading = !final && m.progress && !m.content && !m.reasoning_content && !(m.tool_calls || []).length;
    if (reading) {   // the prompt is still being read (minutes at depth on a small machine)
      const p = m.progress, todo = Math.max(1, p.total - p.cache), done = p.processed - p.cache;
      if (!bar) { bar = el("div", { class: "prefill" }, el("progress"), el("span", { class: "muted" })); node.prepend(bar); }
      bar.querySelector("progress").max = todo;
      bar.querySelector("progress").value = done;
      bar.querySelector("span").textContent = `reading the prompt · ${fmt.int(done)} of ${fmt.int(todo)} tokens` +
        (p.cache ? ` (${fmt.int(p.cache)} cached)` : "");
    } else if (bar) bar.remove();
    let c = node.querySelector(".content");
    if (!c) { c = el("div", { class: "content" }); node.append(c); }
    Markdown.render(c, m.content || "", final);
    node.querySelectorAll(".toolcall").forEach((t) => t.remove());
    for (const call of m.tool_calls || []) {
      const fn = call.function || {};
      node.append(el("div", { class: "toolcall" }, el("div", { class: "label", text: `tool call · ${fn.name || "?"}` + (call.id ? ` · ${call.id}` : "") }),
        el("pre", { text: prettyJson(fn.arguments || "") })));
    }
    if (m.finish_reason === "cancelled") node.append(el("div", { class: "note muted", text: "stopped" }));
    else if (m.finish_reason === "length") node.append(el("div", { class: "note muted", text: "cut off at max tokens" }));
    if (m.error) node.append(el("div", { class: "note error", text: "Error: " + m.error }));
  }

  function prettyJson(s) { try { return JSON.stringify(JSON.parse(s), null, 2); } catch (e) { return s; } }

  function statsNode(m) {
    const t = m.timings;
    if (!t) return el("div", { class: "nostats" });
    const parts = [
      `TTFT ${fmt.secs((m.ttft_ms !== undefined ? m.ttft_ms : t.ttft_ms !== undefined ? t.ttft_ms : t.prompt_ms) / 1000)}`,
      `prefill ${fmt.rate(t.prompt_per_second)} tok/s (${fmt.int(t.prompt_n)} tokens${t.cache_n ? ", " + fmt.int(t.cache_n) + " cached" : ""})`,
      `decode ${fmt.rate(t.predicted_per_second)} tok/s (${fmt.int(t.predicted_n)} tokens)`,
      `context ${fmt.int(t.depth)} / ${fmt.int(t.n_ctx)}`,
    ];
    if (t.draft_n) parts.push(`drafts ${t.draft_n_accepted}/${t.draft_n} accepted`);
    return el("div", { class: "stats", "data-timings": JSON.stringify(t), text: parts.join(" · ") });
  }

  function actionsNode(m, i) {
    const last = i === conv.messages.length - 1;
    const acts = el("div", { class: "actions" }, ChatBranches.nav(m));
    acts.append(el("button", { type: "button", class: "copyreply", text: "Copy", onclick: () => Markdown.copyText(m.content || "") }));
    if (last) acts.append(el("button", { type: "button", class: "regenerate", text: "Regenerate", onclick: () => regenerate(i) }));
    if (last && (m.finish_reason === "length" || m.finish_reason === "cancelled") && !(m.tool_calls || []).length)
      acts.append(el("button", { type: "button", class: "continue", text: "Continue", onclick: () => continueReply(i) }));
    return acts;
  }

  function showError(err) {
    log.append(el("div", { class: "msg error", text: "Error: " + err.message }));
    log.scrollTop = log.scrollHeight;
  }

  // ---- the context meter ----------------------------------------------------------------------
  function updateMeter() {
    const meter = $("meter");
    if (!nCtx) { meter.textContent = ""; return; }
    const need = lastDepth + inputTokens + ChatDocs.pendingTokens() + conv.settings.max_tokens;
    meter.textContent = `context ${fmt.int(lastDepth)} / ${fmt.int(nCtx)}` + (inputTokens ? ` · next turn needs ≈ ${fmt.int(need)}` : "");
    const over = need > nCtx;
    meter.classList.toggle("over", over);
    meter.title = over ? `This turn may be refused: the context so far, the message and max tokens (${conv.settings.max_tokens}) come to about ${need} tokens, over the ${nCtx} the model has. Lower max tokens or start a new chat.` : "tokens of the context in use";
  }

  let tokenizeTimer = null;
  function inputChanged() {
    clearTimeout(tokenizeTimer);
    const text = input.value;
    if (!text.trim()) { inputTokens = 0; updateMeter(); return; }
    tokenizeTimer = setTimeout(async () => {
      try {
        const r = await api("/tokenize", { json: { content: text, ...(conv.settings.model ? { model: conv.settings.model } : {}) } });
        inputTokens = r.tokens.length + 8;    // and the template's few tokens around a turn
        updateMeter();
      } catch (err) { /* a meter only */ }
    }, 250);
  }

  // ---- generating ----------------------------------------------------------------------------
  function requestBody(continuing) {
    const s = conv.settings;
    const messages = [];
    if (s.system) messages.push({ role: "system", content: s.system });
    const pictures = takesImages();
    for (const m of conv.messages) {
      const out = { role: m.role, content: ChatDocs.content(m) };
      if (pictures && m.images && m.images.length)
        out.content = [...m.images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: out.content }];
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
      messages.push(out);
    }
    const body = { messages, stream: true, stream_options: { include_usage: true }, return_progress: true,
                   temperature: s.temperature, top_p: s.top_p, max_tokens: s.max_tokens };
    const model = s.model || (App.health() && App.health().model);
    if (model) body.model = model;
    if (s.seed !== null) body.seed = s.seed;
    if (s.thinking !== null && !$("thinking").disabled) body.chat_template_kwargs = { enable_thinking: s.thinking };
    if (continuing) body.continue_final_message = true;
    return body;
  }

  function applyDelta(m, chunk) {
    const choice = chunk.choices && chunk.choices[0];
    if (choice && choice.delta) {
      const d = choice.delta;
      if (d.content) m.content += d.content;
      if (d.reasoning_content) m.reasoning_content = (m.reasoning_content || "") + d.reasoning_content;
      for (const tc of d.tool_calls || []) {
        m.tool_calls = m.tool_calls || [];
        const slot = m.tool_calls[tc.index] || (m.tool_calls[tc.index] = { id: tc.id, type: "function", function: { name: "", arguments: "" } });
        if (tc.id) slot.id = tc.id;
        if (tc.function && tc.function.name) slot.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
      }
    }
    if (choice && choice.finish_reason) m.finish_reason = choice.finish_reason;
    if (chunk.timings) m.timings = chunk.timings;
    if (chunk.prompt_progress) m.progress = chunk.prompt_progress;
  }

  // Stream a reply into conv.messages[at] (a new one, or the one being continued) and store it.
  async function generate(at, continuing) {
    const base = continuing ? conv.messages[at] : { role: "assistant", content: "", reasoning_content: null, tool_calls: null, timings: null, finish_reason: null };
    const prior = { content: base.content || "", reasoning: base.reasoning_content || "" };
    const m = Object.assign({}, base, { finish_reason: null, timings: null, error: undefined, ttft_ms: undefined });
    conv.messages[at] = m;
    renderAll();
    const wrap = log.querySelector(`.turn[data-index="${at}"]`);
    const node = wrap.querySelector(".msg.assistant");
    wrap.querySelector(".actions").replaceChildren();
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    let frame = null;
    const paint = () => { frame = null; fillAssistant(node, m, false); if (nearBottom()) log.scrollTop = log.scrollHeight; };
    try {
      const res = await api("/v1/chat/completions", { json: requestBody(continuing), raw: true, signal: controller.signal });
      for await (const data of sse(res)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const before = m.content.length + (m.reasoning_content || "").length;
        applyDelta(m, chunk);
        if (m.ttft_ms === undefined && m.content.length + (m.reasoning_content || "").length > before) m.ttft_ms = performance.now() - t0;
        if (!frame) frame = requestAnimationFrame(paint);
      }
    } catch (err) {
      if (err.name === "AbortError") m.finish_reason = "cancelled";
      else m.error = err.message;
    } finally {
      if (frame) cancelAnimationFrame(frame);
      controller = null;
      setBusy(false);
    }
    await finish(at, m, prior);
  }

  async function finish(at, m, prior) {
    if (m.error && !m.content && !m.reasoning_content) {
      // nothing came back: the turn is not stored, the error is shown where the reply would be
      conv.messages.splice(at, 1);
      renderAll(); showError(new Error(m.error));
      return;
    }
    const stored = { role: "assistant", content: m.content, reasoning_content: m.reasoning_content || null,
                     tool_calls: m.tool_calls && m.tool_calls.length ? m.tool_calls : null,
                     timings: m.timings ? Object.assign({}, m.timings, { ttft_ms: m.ttft_ms }) : null,
                     finish_reason: m.finish_reason || (m.error ? "error" : null) };
    let saved = stored;
    try { saved = (await saveMessages(at, [stored], m.id)).messages[at] || stored; } catch (err) { showError(err); }
    conv.messages[at] = Object.assign({}, saved, { error: m.error, ttft_ms: m.ttft_ms });
    renderAll();
    input.focus();
  }

  function nearBottom() { return log.scrollHeight - log.scrollTop - log.clientHeight < 80; }

  function setBusy(on) {
    sendBtn.disabled = on; stopBtn.disabled = !on;
    for (const b of log.querySelectorAll(".actions button")) b.disabled = on;
  }

  async function send(text) {
    const images = pending, documents = ChatDocs.take();
    pending = []; showPending();
    try {
      await ensureSaved(text);
      const at = conv.messages.length;
      conv.messages.push(userMessage(text, images, documents));
      await saveMessages(at, [conv.messages[at]]);
      renderAll();
      $("title").textContent = conv.title;
      await generate(at + 1, false);
    } catch (err) { showError(err); setBusy(false); }
  }

  function userMessage(text, images, documents) {
    const m = { role: "user", content: text };
    if (images && images.length) m.images = images;
    if (documents && documents.length) m.documents = documents;
    return m;
  }

  async function regenerate(i) {
    if (busy()) return;
    conv.messages.splice(i);
    await generate(i, false);
  }

  async function continueReply(i) {
    if (busy()) return;
    await generate(i, true);
  }

  function editMessage(i) {
    if (busy()) return;
    const turn = log.querySelector(`.turn[data-index="${i}"]`);
    const box = el("textarea", { class: "editbox", rows: 3 });
    box.value = conv.messages[i].content;
    const save = el("button", { type: "button", class: "primary save", text: "Save & send" });
    const cancel = el("button", { type: "button", class: "cancel", text: "Cancel", onclick: renderAll });
    turn.replaceChildren(box, el("div", { class: "actions" }, cancel, save));
    box.focus();
    const submit = async () => {
      const text = box.value.trim();
      if (!text) return;
      const { images, documents } = conv.messages[i];
      conv.messages.splice(i, conv.messages.length - i, userMessage(text, images, documents));
      try { await saveMessages(i, [conv.messages[i]]); } catch (err) { showError(err); return; }
      renderAll();
      await generate(i + 1, false);
    };
    save.addEventListener("click", submit);
    box.addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); submit(); } if (e.key === "Escape") renderAll(); });
  }

  // ---- pictures ------------------------------------------------------------------------------
  function takesImages() {
    const h = App.health() || {}, name = conv.settings.model || h.model;
    if (name in visionOf) return visionOf[name];
    return !!(h.settings && h.settings.mmproj) && (!conv.settings.model || conv.settings.model === h.model);
  }

  function updateVisionNote() {
    const note = $("vision-note"), has = pending.length || conv.messages.some((m) => m.images && m.images.length);
    note.hidden = !has || takesImages();
    note.textContent = "this model does not take images: only the text is sent";
  }

  // A picture as a data: URI; one whose longer side is past MAX_SIDE is scaled down first, and
  // one whose URI is past MAX_URI becomes a JPEG (the request body has a size limit, each turn
  // sends the conversation's pictures again, and no projector sees that many pixels).
  function readImage(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onerror = () => reject(new Error(`${file.name}: could not be read`));
      reader.onload = () => {
        const img = new Image();
        img.onerror = () => reject(new Error(`${file.name}: not a picture this browser can read`));
        img.onload = () => {
          const scale = Math.min(1, MAX_SIDE / Math.max(img.naturalWidth, img.naturalHeight));
          const big = reader.result.length > MAX_URI;
          if (scale >= 1 && !big) { resolve(reader.result); return; }
          const c = document.createElement("canvas");
          c.width = Math.round(img.naturalWidth * scale); c.height = Math.round(img.naturalHeight * scale);
          c.getContext("2d").drawImage(img, 0, 0, c.width, c.height);
          const png = c.toDataURL("image/png");
          resolve(file.type !== "image/jpeg" && png.length <= MAX_URI ? png : c.toDataURL("image/jpeg", 0.9));
        };
        img.src = reader.result;
      };
      reader.readAsDataURL(file);
    });
  }

  async function attach(files) {
    for (const file of files) {
      if (ChatDocs.isDocument(file)) { await ChatDocs.attach(file); continue; }
      if (!IMAGE_TYPES.includes(file.type)) { showError(new Error(`${file.name}: not a PNG, JPEG, WebP or GIF picture`)); continue; }
      if (pending.length >= MAX_IMAGES) { showError(new Error(`at most ${MAX_IMAGES} pictures a message`)); break; }
      try { pending.push(await readImage(file)); } catch (err) { showError(err); }
    }
    showPending();
  }

  function showPending() {
    $("attachments").replaceChildren(...pending.map((url, k) => el("span", { class: "pending" },
      el("img", { class: "thumb", src: url, alt: `picture ${k + 1}` }),
      el("button", { type: "button", class: "unattach", text: "×", title: "remove", onclick: () => { pending.splice(k, 1); showPending(); } }))));
    updateVisionNote();
  }

  // ---- title, delete -------------------------------------------------------------------------
  function rename() {
    if (!conv.id) return;
    const h = $("title");
    const box = el("input", { id: "title-edit", "aria-label": "Title", maxlength: 200 });
    box.value = conv.title;
    h.replaceWith(box); box.focus(); box.select();
    let done = false;
    const commit = async (save) => {
      if (done) return; done = true;
      const title = box.value.trim();
      if (save && title && title !== conv.title) {
        try { conv.title = (await api("/api/conversations/" + conv.id, { method: "PATCH", json: { title } })).title; }
        catch (err) { showError(err); }
      }
      h.textContent = conv.title; box.replaceWith(h); refreshList();
    };
    box.addEventListener("keydown", (e) => { if (e.key === "Enter") commit(true); if (e.key === "Escape") commit(false); });
    box.addEventListener("blur", () => commit(true));
  }

  async function remove() {
    if (!conv.id || !confirm(`Delete "${conv.title}"?`)) return;
    try { await api("/api/conversations/" + conv.id, { method: "DELETE" }); } catch (err) { showError(err); return; }
    conv = fresh(); conv.settings = readSettings();
    newChat();
  }

  // ---- wiring --------------------------------------------------------------------------------
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if (!text || busy() || ChatDocs.refuseSend()) return;
    clearTimeout(tokenizeTimer);
    input.value = ""; inputTokens = 0;
    send(text);
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  input.addEventListener("input", inputChanged);
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", (e) => { attach([...e.target.files]); e.target.value = ""; });
  input.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.length) { e.preventDefault(); attach(files); }
  });
  const composer = $("composer");
  composer.addEventListener("dragover", (e) => { e.preventDefault(); composer.classList.add("dragging"); });
  composer.addEventListener("dragleave", () => composer.classList.remove("dragging"));
  composer.addEventListener("drop", (e) => {
    e.preventDefault(); composer.classList.remove("dragging");
    if (e.dataTransfer && e.dataTransfer.files.length) attach([...e.dataTransfer.files]);
  });
  ChatBranches.init({ conv: () => conv, busy, open, showError,
                      adopt: (stored) => { if (stored.id === conv.id) { conv.messages = stored.messages; renderAll(); } } });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && busy()) controller.abort(); });
  stopBtn.addEventListener("click", () => busy() && controller.abort());
  $("new").addEventListener("click", newChat);
  $("rename").addEventListener("click", rename);
  $("delete").addEventListener("click", remove);
  $("menu").addEventListener("click", (e) => { e.stopPropagation(); document.body.classList.toggle("menu-open"); });
  document.querySelector(".chat").addEventListener("click", () => document.body.classList.remove("menu-open"));
  let searchTimer = null;
  $("search").addEventListener("input", () => { clearTimeout(searchTimer); searchTimer = setTimeout(() => refreshList().catch(showError), 200); });
  for (const id of SETTING_INPUTS) $(id).addEventListener("change", settingsChanged);
  $("system").addEventListener("input", settingsChanged);
  App.chatTools.onChange(settingsChanged);
  App.onHealth((h) => {
    const sw = !!(h.chat_template && h.chat_template.thinking_switch), sel = $("thinking");
    if (sel.disabled === sw) {
      sel.disabled = !sw;
      sel.title = sw ? "turn the model's thinking on or off (its template's enable_thinking)" : "this model's chat template has no thinking switch";
    }
    if (h.n_ctx && h.n_ctx !== nCtx) { nCtx = h.n_ctx; updateMeter(); if (!conv.messages.length) renderAll(); }
    updateVisionNote();
  });

  ChatDocs.init({ context: () => ({ nCtx, used: lastDepth + inputTokens, maxTokens: conv.settings.max_tokens }),
                  model: () => conv.settings.model || (App.health() && App.health().model) || null, showError, changed: updateMeter });
  (async () => {
    await loadModels();
    showSettings();
    const id = location.hash.slice(1);
    try {
      if (id) await open(id); else await refreshList();
    } catch (err) {
      if (err.status === 404) { history.replaceState(null, "", location.pathname); await refreshList().catch(showError); }
      else showError(err);
    }
    input.focus();
  })();
})();

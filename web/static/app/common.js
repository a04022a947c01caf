// What every page shares: `App.api` (fetch with the API key, errors in the API's shape thrown
// as ApiError), the key dialog (shown when the server answers 401), small formatters, and the
// status strip fed by /health.
"use strict";
(function () {
  const KEY = "appliance_key";

  class ApiError extends Error {
    constructor(status, message, body) { super(message); this.status = status; this.body = body; }
  }

  let keyWaiters = null;   // callbacks waiting for the user to enter a key

  function askKey(refused) {
    const dlg = document.getElementById("keydialog");
    document.getElementById("keyerror").hidden = !refused;
    if (!keyWaiters) {
      keyWaiters = [];
      dlg.showModal();
      document.getElementById("apikey").focus();
    }
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  function keyEntered(e) {
    e.preventDefault();
    const value = document.getElementById("apikey").value.trim();
    if (!value) return;
    localStorage.setItem(KEY, value);
    document.getElementById("keydialog").close();
    const waiters = keyWaiters || [];
    keyWaiters = null;
    waiters.forEach((w) => w(value));
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = localStorage.getItem(KEY);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // fetch(path) with the key; on 401 ask for a key and try again. `opts.json` is sent as the
  // body; `opts.raw` returns the Response (for streams) instead of its parsed JSON.
  async function api(path, opts) {
    opts = opts || {};
    const init = { method: opts.method || (opts.json !== undefined ? "POST" : "GET"), signal: opts.signal };
    const extra = {};
    if (opts.json !== undefined) { extra["Content-Type"] = "application/json"; init.body = JSON.stringify(opts.json); }
    for (let attempt = 0; ; attempt++) {
      init.headers = headers(extra);
      const res = await fetch(path, init);
      if (res.status === 401 && attempt < 5) {
        await askKey(attempt > 0 || localStorage.getItem(KEY) !== null);
        continue;
      }
      if (!res.ok) {
        const body = await res.json().catch(() => null);
        const msg = body && body.error ? body.error.message : `${res.status} ${res.statusText}`;
        throw new ApiError(res.status, msg, body);
      }
      if (opts.raw) return res;
      return res.status === 204 ? null : res.json();
    }
  }

  // Server-sent events of a streamed response: yields each `data:` payload.
  async function* sse(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  const fmt = {
    bytes(b) {
      if (b === null || b === undefined) return "–";
      const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
      while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
      return (i ? b.toFixed(1) : String(b)) + " " + u[i];
    },
    rate(x) { return x === null || x === undefined ? "–" : x.toFixed(x >= 100 ? 0 : 1); },
    int(x) { return x === null || x === undefined ? "–" : Number(x).toLocaleString("en"); },
    secs(s) { return s === null || s === undefined ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s"; },
    when(iso) { return iso ? new Date(iso).toLocaleString() : "–"; },
  };

  // The status strip: model, backend, slots busy, queue, KV use, prompt-cache hits.
  let lastHealth = null;
  const healthListeners = [];
  async function pollStatus() {
    const strip = document.getElementById("status");
    try {
      const h = await api("/health");
      lastHealth = h;
      const e = h.engine || {};
      const parts = [
        h.model ? `${h.model}` : "no model loaded",
        h.backend || null,
        e.n_slots !== undefined ? `slots ${e.slots_busy}/${e.n_slots}` : null,
        e.queue_depth !== undefined ? `queue ${e.queue_depth}` : null,
        e.kv_capacity ? `KV ${Math.round(100 * e.kv_tokens / e.kv_capacity)}%` : null,
        e.cache_hit_tokens !== undefined ? `cache hits ${fmt.int(e.cache_hit_tokens)} tok` : null,
      ].filter(Boolean);
      strip.textContent = parts.join(" · ");
      strip.classList.remove("down");
      healthListeners.forEach((f) => f(h));
    } catch (err) {
      strip.textContent = err.status === 503 ? `engine: ${err.body && err.body.status || "unavailable"}` : "server unreachable";
      strip.classList.add("down");
    }
  }

  document.getElementById("keyform").addEventListener("submit", keyEntered);
  window.App = { api, sse, el, fmt, ApiError, onHealth: (f) => healthListeners.push(f), health: () => lastHealth };
  pollStatus();
  setInterval(pollStatus, 4000);
})();

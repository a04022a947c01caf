// The chat page: keeps the conversation, streams each reply from /v1/chat/completions (SSE),
// and shows under it the engine's timings: TTFT, prefill rate, decode rate, context depth.
"use strict";
const log = document.getElementById("log");
const input = document.getElementById("input");
const sendBtn = document.getElementById("send");
const stopBtn = document.getElementById("stop");
const model = document.body.dataset.model;
let messages = [];
let controller = null;

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

function statsLine(t, ttftMs) {
  const div = document.createElement("div");
  div.className = "stats";
  const parts = [
    `TTFT ${(ttftMs / 1000).toFixed(2)} s`,
    `prefill ${t.prompt_per_second.toFixed(1)} tok/s (${t.prompt_n} tokens${t.cache_n ? ", " + t.cache_n + " cached" : ""})`,
    `decode ${t.predicted_per_second.toFixed(1)} tok/s`,
    `context ${t.depth} / ${t.n_ctx}`,
  ];
  div.textContent = parts.join(" · ");
  div.dataset.timings = JSON.stringify(t);
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
}

async function* sseEvents(response) {
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
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  messages.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  controller = new AbortController();
  sendBtn.disabled = true; stopBtn.disabled = false;
  const t0 = performance.now();
  let ttft = null, reply = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model, messages, stream: true, stream_options: { include_usage: true },
        temperature: Number(document.getElementById("temperature").value),
        max_tokens: Number(document.getElementById("max_tokens").value),
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : response.statusText);
    }
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        if (ttft === null) ttft = performance.now() - t0;
        reply += choice.delta.content;
        out.textContent = reply;
        log.scrollTop = log.scrollHeight;
      }
      if (chunk.timings) statsLine(chunk.timings, ttft === null ? performance.now() - t0 : ttft);
    }
    messages.push({ role: "assistant", content: reply });
  } catch (err) {
    if (err.name === "AbortError") {
      messages.push({ role: "assistant", content: reply });
    } else {
      out.classList.add("error");
      out.textContent = (reply ? reply + "\n\n" : "") + "Error: " + err.message;
      messages.pop();
    }
  } finally {
    controller = null;
    sendBtn.disabled = false; stopBtn.disabled = true;
    input.focus();
  }
}

document.getElementById("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    document.getElementById("composer").requestSubmit();
  }
});
stopBtn.addEventListener("click", () => controller && controller.abort());
document.getElementById("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  messages = [];
  log.replaceChildren();
});

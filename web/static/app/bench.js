// The benchmarks page: the stored runs (/api/bench/runs), one run's conditions, tables and curves
// (uPlot), two runs compared (pairwise ratios B/A), and the job estimate. Every figure is shown
// with its unit and the conditions it was measured under (shared/BENCHMARKING.md, rule 1).
// Read-only; the DOM is built with App.el and textContent, never from HTML strings.
"use strict";
(function () {
  const { api, el, fmt } = App;
  const $ = (id) => document.getElementById(id);
  const charts = [];          // [uPlot, its div.chart], resized with the window
  const runs = new Map();     // id -> the run's summary from the list

  // -- formatting ---------------------------------------------------------------------------

  const none = (x) => x === null || x === undefined;
  const num = (x, d = 1) => none(x) ? "–"
    : Number(x).toLocaleString("en", { minimumFractionDigits: d, maximumFractionDigits: d });
  const pct = (f) => `${f >= 0 ? "+" : ""}${num(f * 100, 1)}%`;
  const change = (r) => (none(r) ? "" : ` (${pct(r - 1)})`);
  const times = (r) => none(r) ? "–" : num(r, 2) + "×";

  // a Stat of the report's rows: the median, and the range when there was more than one value
  function stat(s, d) {
    if (!s || !s.n) return "–";
    return s.n === 1 ? num(s.median, d) : `${num(s.median, d)} (${num(s.min, d)}–${num(s.max, d)})`;
  }

  function settings(e) {
    if (!e || typeof e !== "object") return "not recorded";
    if (e.A && typeof e.A === "object") return Object.entries(e).map(([k, v]) => `${k}: ${settings(v)}`).join("; ");
    const parts = [
      none(e.n_ctx) ? null : `n_ctx ${fmt.int(e.n_ctx)}`,
      none(e.n_slots) ? null : `${e.n_slots} slot${e.n_slots === 1 ? "" : "s"}`,
      none(e.n_threads) ? null : `${e.n_threads} threads` + (none(e.n_threads_batch) ? "" : ` (batch ${e.n_threads_batch})`),
      none(e.n_batch) ? null : `n_batch ${e.n_batch}`,
      none(e.flash_attn) ? null : `flash-attn ${e.flash_attn ? "on" : "off"}`,
      none(e.kv_type) ? null : `KV ${e.kv_type}`,
      // a mode (on, off, fast) since the cache had modes; a boolean in runs stored before
      none(e.prompt_cache) ? null : `prompt cache ${typeof e.prompt_cache === "string" ? e.prompt_cache : e.prompt_cache ? "on" : "off"}`,
    ];
    return parts.filter(Boolean).join(" · ") || "not recorded";
  }

  function hostLine(h) {
    if (!h) return "no host snapshot stored";
    const why = (k) => (h.unavailable[k] ? ` (${h.unavailable[k]})` : "");
    const cpu = `${h.cpu || "CPU unknown"}, ${h.cores ?? "?"} cores / ${h.threads ?? "?"} threads` +
      (h.virtual_machine ? " (VM)" : "");
    const gpu = h.gpu.length ? h.gpu.join(", ") : "no GPU" + why("gpu");
    const cap = (d) => `${d.label} limit ${none(d.cap_w) ? "unknown" : num(d.cap_w, 0) + " W"}`;
    const power = h.power.length ? h.power.map(cap).join(", ") : "power limits unavailable" + why("power");
    return [cpu, fmt.bytes(h.memory_bytes), gpu, power].join(" · ");
  }

  const model = (m) => `${m.name} · ${m.quant} · ${fmt.bytes(m.size_bytes)}`;
  const command = (r) => r.command.slice(1).join(" ");
  const statusEl = (r) => el("span", { class: "st-" + r.status, text: r.status });

  function table(header, body, attrs) {
    const cls = (h) => (h.endsWith(")") || h.endsWith("×") ? "num" : null);
    return el("div", { class: "scroll" }, el("table", attrs || {},
      el("thead", {}, el("tr", {}, header.map((h) => el("th", { class: cls(h), text: h })))),
      el("tbody", {}, body.map((row) => el("tr", {}, row.map((c, i) => el("td", { class: cls(header[i]), text: c })))))));
  }

  // -- the runs table -----------------------------------------------------------------------

  function runRow(r) {
    const pick = (name) => el("input", { type: "radio", name, value: r.id, "aria-label": `run ${r.id} as ${name.toUpperCase()}`,
                                         onchange: compareReady, onclick: (e) => e.stopPropagation() });
    const h = r.host;
    return el("tr", { class: "run", "data-id": r.id, tabindex: "0", onclick: () => showRun(r.id),
                      onkeydown: (e) => { if (e.key === "Enter") showRun(r.id); } },
      el("td", {}, pick("a")), el("td", {}, pick("b")), el("td", { text: String(r.id) }),
      el("td", { class: "cmd" }, el("code", { text: command(r) })),
      el("td", { text: model(r.model) }), el("td", { text: fmt.when(r.started_at) }),
      el("td", { text: h ? [h.cpu, ...h.gpu].filter(Boolean).join(" + ") : "–" }),
      el("td", {}, statusEl(r), r.note ? el("div", { class: "sub", text: r.note }) : null),
      el("td", { class: "num", text: fmt.int(r.cells) }));
  }

  async function loadRuns() {
    const note = $("runsnote");
    try {
      const list = (await api("/api/bench/runs")).runs;
      list.forEach((r) => runs.set(r.id, r));
      document.querySelector("#runs tbody").replaceChildren(...list.map(runRow));
      note.textContent = list.length ? `${list.length} run${list.length === 1 ? "" : "s"}, newest first.`
        : "No runs stored yet: run `appliance sweep` or `appliance bench`, then reload this page.";
    } catch (err) {
      note.textContent = "Could not read the runs: " + err.message;
      note.className = "error";
    }
  }

  function picked(name) {
    const input = document.querySelector(`#runs input[name=${name}]:checked`);
    return input ? Number(input.value) : null;
  }

  function compareReady() {
    const a = picked("a"), b = picked("b");
    $("compare").disabled = !(a && b && a !== b);
    $("comparehint").textContent = a && b && a !== b ? `run ${b} against run ${a}` : "pick an A run and a different B run";
  }

  // -- charts -------------------------------------------------------------------------------

  function aligned(lines) {
    const xs = [...new Set(lines.flatMap((l) => l.points.map((p) => p[0])))].sort((x, y) => x - y);
    return [xs, ...lines.map((l) => { const m = new Map(l.points); return xs.map((x) => (m.has(x) ? m.get(x) : null)); })];
  }

  // lines: [{label, points: [[x, y], ...], color: "--c1", dash: bool}]
  function plot(box, spec, lines) {
    const css = getComputedStyle(box);
    const v = (name) => css.getPropertyValue(name).trim();
    const axis = (label) => ({ label, stroke: v("--muted"), grid: { stroke: v("--line") }, ticks: { stroke: v("--line") } });
    const opts = {
      width: Math.max(box.clientWidth, 240), height: 240, scales: { x: { time: false } },
      series: [{ label: spec.x, value: (u, x) => (none(x) ? "–" : fmt.int(x)) },
        ...lines.map((l) => ({ label: l.label, stroke: v(l.color), width: 2, dash: l.dash ? [6, 4] : undefined,
                              spanGaps: true, points: { show: true, size: 6, fill: v(l.color) },
                              value: (u, y) => (none(y) ? "–" : num(y, 2)) }))],
      axes: [axis(spec.x), axis(spec.y)],
    };
    charts.push([new uPlot(opts, aligned(lines), box), box]);
  }

  // a figure: title, conditions, and the chart (drawn once the figure is in the page)
  function figure(parent, title, conditions, spec, lines) {
    const box = el("div", { class: "chart" });
    parent.append(el("figure", {}, el("figcaption", {}, el("strong", { text: title }),
      el("div", { class: "sub", text: conditions })), box));
    if (lines.length) plot(box, spec, lines);
    else box.replaceChildren(el("p", { class: "muted", text: "No points: this run has no such cells." }));
    box.classList.toggle("empty", !lines.length);
  }

  function resize() {
    for (let i = charts.length - 1; i >= 0; i--) {
      const [u, box] = charts[i];
      if (box.isConnected) u.setSize({ width: Math.max(box.clientWidth, 240), height: 240 });
      else { u.destroy(); charts.splice(i, 1); }
    }
  }

  const COLORS = ["--c1", "--c2", "--c3", "--c4"];
  const CHARTS = [["decode", "Decode rate against context depth"], ["prefill", "Prefill rate against prompt size"],
                  ["served_vs_raw", "Served against raw llama.cpp: median of pairwise ratios served / raw"]];

  function curveConditions(r) {
    return `${settings(r.engine)} · cells: serial, one stream, uncached (fresh nonce), median over each row's runs`;
  }

  function runCharts(parent, run, series) {
    for (const [name, title] of CHARTS) {
      const spec = series[name];
      const lines = spec.lines.map((l, i) => ({ ...l, color: COLORS[i % 4], dash: l.label === "raw" }));
      figure(parent, title, curveConditions(run), spec, lines);
    }
  }

  // -- one run ------------------------------------------------------------------------------

  function conditions(doc) {
    const r = doc.run, c = doc.conditions, h = c.host;
    const rss = h && Object.entries(h.peak_rss_bytes).map(([k, b]) => `${k} ${fmt.bytes(b)}`).join(", ");
    const facts = [
      ["model", `${model(r.model)} · sha256 ${r.model.sha256.slice(0, 12)}`], ["command", r.command.join(" ")],
      ["appliance", `${r.appliance_version} · started ${fmt.when(r.started_at)} · finished ${fmt.when(r.finished_at)}`],
      ["engine", settings(c.engine)], ["host", hostLine(h)],
      ["kernel", h ? `${h.kernel ?? "unknown"} on ${h.distribution ?? "unknown"} · IOMMU ${h.iommu ?? "unknown"} · ` +
                     `THP ${h.thp ?? "unknown"}` : "–"],
      ["kernel command line", h ? h.cmdline ?? "unavailable" : "–"], ["peak RSS", rss || "not recorded"],
    ];
    const joules = (p) => (!none(p.joules) ? num(p.joules, 1) : p.energy_note ? `unavailable (${p.energy_note})` : "–");
    const phases = Object.entries(c.phases).map(([name, p]) => [name, num(p.median_power_w, 1), joules(p),
                                                               num(p.median_cpu_mhz, 0), num(p.median_gpu_mhz, 0),
                                                               fmt.int(p.n_samples)]);
    return el("div", { class: "card" }, el("h3", { text: "Conditions" }),
      el("dl", {}, facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
      phases.length ? table(["phase", "median power (W)", "energy (J)", "median CPU (MHz)", "median GPU (MHz)", "samples"], phases)
        : el("p", { class: "sub", text: "Power and clocks per phase: not sampled." }),
      el("details", {}, el("summary", { text: "all engine settings and the host snapshot (JSON)" }),
        el("pre", { text: JSON.stringify({ engine: c.engine, host: c.snapshot }, null, 2) })));
  }

  const RATES = [["ttft (ms)", "ttft_ms", 0], ["prefill (tok/s)", "prefill_tps", 1],
                 ["engine prefill (tok/s)", "engine_prefill_tps", 1], ["client decode (tok/s)", "client_decode_tps", 1],
                 ["engine decode (tok/s)", "engine_decode_tps", 1], ["prefill (tok/J)", "prefill_tpj", 2],
                 ["decode (tok/J)", "decode_tpj", 3]];

  // tokens per joule beside tokens per second: why there is none, or the idle power and the
  // power envelopes with the report's verdict
  function energy(e) {
    if (e.unavailable) return el("p", { class: "sub", text: `Energy (tok/J): unavailable (${e.unavailable}).` });
    const idle = none(e.idle_w) ? "unavailable" : `${num(e.idle_w, 1)} W`;
    const parts = [el("p", { class: "sub", text: `Tokens per joule (tok/J) are gross: the rate over the phase's mean ` +
                                                 `power. Idle power measured before the run: ${idle}.` })];
    if (e.envelopes.length) {
      parts.push(el("h3", { text: "Power envelopes" }),
        table(["cap (W)", "prefill (tok/s)", "prefill (tok/J)", "decode (tok/s)", "decode (tok/J)"],
              e.envelopes.map((v) => [num(v.cap_w, 0), num(v.prefill_tps, 1), num(v.prefill_tpj, 2), num(v.decode_tps, 1),
                                      num(v.decode_tpj, 3)])),
        el("ul", {}, ...e.verdict.map((t) => el("li", { text: t.replace(/^- /, "") }))));
    }
    return el("div", {}, ...parts);
  }

  // client over engine decode, marked ! past the report's 10%
  const gap = (e) => (none(e.decode_gap) ? "–" : pct(e.decode_gap) + (e.flag_gap ? " !" : ""));

  // the kind's own figures (concurrency: aggregate tok/s, batching gain; agent; needle), as the
  // report's summaries name them
  const COMMON = new Set(["decode_gap", "flag_gap", "identity_failures"]);
  function kindFigures(extra) {
    const show = (v) => (v && typeof v === "object" && "median" in v ? stat(v, 2) : Array.isArray(v) ? v.join(" ")
      : typeof v === "number" ? num(v, Number.isInteger(v) ? 0 : 2) : String(v));
    return Object.entries(extra).filter(([k]) => !COMMON.has(k)).map(([k, v]) => `${k.replaceAll("_", " ")} ${show(v)}`);
  }

  function rowsTable(rows) {
    const figures = rows.some((r) => kindFigures(r.extra).length);
    const header = ["cell", "target", "variant", "mode", "prompt set", "cache", "streams", "prompt (tokens)",
                    "depth (tokens)", "generated (tokens)", "runs", ...RATES.map((c) => c[0]), "client / engine decode gap",
                    ...(figures ? ["the kind's figures"] : [])];
    const body = rows.map((r) => [
      r.cell + (r.extra.identity_failures ? ` (OUTPUT DIFFERS FROM SERIAL: ${r.extra.identity_failures})` : ""),
      r.target, r.variant || "–", r.mode, r.prompt_set, r.cache_on ? "on" : "off",
      String(r.concurrency), fmt.int(r.prompt_tokens), fmt.int(r.depth), fmt.int(r.generated_tokens), String(r.runs),
      ...RATES.map(([, k, d]) => stat(r[k], d)), gap(r.extra), ...(figures ? [kindFigures(r.extra).join(" · ")] : [])]);
    return table(header, body, { class: "rows" });
  }

  // CompareRows: A / B medians and the median pairwise change B/A; `targets` false where both
  // sides are one target (served against raw)
  function ratioTable(rows, a, b, targets = true) {
    const rates = RATES.filter((c) => c[1] !== "engine_prefill_tps");
    const header = ["cell", ...(targets ? ["target"] : []), "mode", "pairs", ...rates.map((c) => c[0])];
    const body = rows.map((r) => [r.cell, ...(targets ? [r.target] : []), r.mode, String(r.client_decode_tps.pairs),
      ...rates.map(([, k, d]) => `${num(r[k].a, d)} / ${num(r[k].b, d)}${change(r[k].ratio)}`)]);
    return [el("p", { class: "sub", text: `Each figure is ${a} / ${b}, the median of each side's cells; in brackets ` +
              `the median of the pairwise ratios ${b} / ${a} of cells measured side by side (rule 7), the figure to quote.` }),
            table(header, body, { class: "ratios" })];
  }

  function cellsTable(cells) {
    if (!cells.length) return null;
    const keys = Object.keys(cells[0]);
    const show = (v) => (none(v) ? "–" : typeof v === "object" ? JSON.stringify(v)
      : typeof v === "number" && !Number.isInteger(v) ? num(v, 2) : String(v));
    return el("details", {}, el("summary", { text: `every cell (${cells.length}), every field; rates in tok/s, times in ms` }),
      table(keys, cells.map((c) => keys.map((k) => show(c[k])))));
  }

  function renderRun(doc) {
    const r = doc.run, box = $("run");
    box.replaceChildren(el("h2", { text: `Run ${r.id}: ${r.kind}, ` }, statusEl(r)));
    if (r.status !== "complete") {
      const why = r.note || "Nothing recorded says what is missing.";
      box.append(el("p", { class: "card warn", text: `Incomplete: this run is ${r.status}. ${why}` }));
    }
    box.append(conditions(doc));
    runCharts(box, r, doc.series);
    for (const [kind, title] of Object.entries(doc.kinds)) {
      box.append(el("h3", { text: title }), rowsTable(doc.rows.filter((x) => x.kind === kind)));
    }
    if (!doc.rows.length) box.append(el("p", { class: "muted", text: "No cells stored." }));
    else box.append(energy(doc.energy));
    box.append(el("p", { class: "sub", text: `Each rate is the median (min–max) over a row's runs; ` +
                                                 `conditions: ${settings(r.engine)}.` }));
    if (doc.served_against_raw.length) {
      box.append(el("h3", { text: "Served against raw llama.cpp" }),
                 ...ratioTable(doc.served_against_raw, "raw", "served", false));
    }
    for (const ab of doc.ab) box.append(el("h3", { text: `A/B: ${ab.b} against ${ab.a}` }), ...ratioTable(ab.rows, ab.a, ab.b));
    box.append(cellsTable(doc.cells) || "");
  }

  async function showRun(id) {
    document.querySelectorAll("#runs tr.run").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === String(id)));
    const box = $("run");
    box.replaceChildren(el("p", { class: "muted", text: `Loading run ${id}…` }));
    try {
      renderRun(await api(`/api/bench/runs/${id}`));
      box.dataset.run = id;
      box.scrollIntoView({ block: "start" });
    } catch (err) {
      box.replaceChildren(el("p", { class: "error", text: `Run ${id}: ${err.message}` }));
    }
  }

  // -- two runs compared --------------------------------------------------------------------

  function overlay(doc, name) {
    const lines = [];
    [["a", "--c1"], ["b", "--c2"]].forEach(([side, color]) => {
      for (const l of doc.series[side][name].lines) {
        lines.push({ ...l, label: `run ${doc[side].id} ${l.label}`, color, dash: l.label === "raw" });
      }
    });
    return lines;
  }

  function renderCompare(doc) {
    const box = $("comparison"), a = `run ${doc.a.id}`, b = `run ${doc.b.id}`;
    const card = el("div", { class: "card" }, el("h2", { text: `${b} against ${a}` }),
      el("dl", {}, [doc.a, doc.b].flatMap((r) => [el("dt", { text: `run ${r.id}` }),
        el("dd", { text: [command(r), model(r.model), settings(r.engine), hostLine(r.host), r.status].join(" · ") })])));
    box.replaceChildren(card);
    for (const [name, title] of CHARTS.slice(0, 2)) {
      figure(card, `${title}: ${a} and ${b}`, "cells: serial, one stream, uncached; each run under its conditions above",
             doc.series.a[name], overlay(doc, name));
    }
    card.append(el("h3", { text: "Matching cells" }));
    if (doc.rows.length) card.append(...ratioTable(doc.rows, a, b));
    else card.append(el("p", { class: "muted", text: "No cells match: the runs measured different cells." }));
  }

  async function compare() {
    const a = picked("a"), b = picked("b"), box = $("comparison");
    box.replaceChildren(el("p", { class: "muted", text: `Comparing run ${b} with run ${a}…` }));
    try {
      renderCompare(await api(`/api/bench/compare?a=${a}&b=${b}`));
      box.scrollIntoView({ block: "start" });
    } catch (err) {
      box.replaceChildren(el("p", { class: "card error", text: `Compare: ${err.message}` }));
    }
  }

  // -- the estimate -------------------------------------------------------------------------

  function renderEstimate(r) {
    const src = runs.get(r.source_run);
    const where = src ? ` (${[command(src), model(src.model), settings(src.engine), hostLine(src.host)].join("; ")})` : "";
    const [p0, p1] = r.prefill_range, [d0, d1] = r.decode_range;
    $("estimateout").replaceChildren(
      el("p", {}, el("strong", { text: `total ${fmt.secs(r.total_s)}` }),
        ` = prefill ${fmt.int(r.prompt_tokens)} tokens at ${num(r.prefill_tps)} tok/s (${fmt.secs(r.prefill_s)})` +
        ` + decode ${fmt.int(r.output_tokens)} tokens at ${num(r.decode_tps_start)}…${num(r.decode_tps_end)} tok/s` +
        ` (${fmt.secs(r.decode_s)})`),
      el("p", { class: "sub", text: `From the curves of run ${r.source_run}${where}: prefill measured at ` +
                                    `${fmt.int(p0)}…${fmt.int(p1)} tokens, decode at depth ${fmt.int(d0)}…${fmt.int(d1)}.` }),
      el("p", { text: none(r.prefill_j) ? `energy: unavailable (${r.energy_note})`
        : `energy ${num(r.prefill_j + r.decode_j, 1)} J = prefill ${num(r.prefill_j, 1)} J + decode ${num(r.decode_j, 1)} J (gross)` }),
      r.extrapolated ? el("p", { class: "card warn", text: "Outside the measured curves: the nearest measured rate " +
                                                           "was held, so this is a guess." }) : "");
  }

  async function estimate(e) {
    e.preventDefault();
    const form = new FormData(e.target), out = $("estimateout");
    const body = { prompt_tokens: Number(form.get("prompt_tokens")), output_tokens: Number(form.get("output_tokens")) };
    if (form.get("run_id")) body.run_id = Number(form.get("run_id"));
    out.replaceChildren(el("p", { class: "muted", text: "Estimating…" }));
    try {
      renderEstimate(await api("/api/bench/estimate", { json: body }));
    } catch (err) {
      out.replaceChildren(el("p", { class: "error", text: err.message }));
    }
  }

  $("compare").addEventListener("click", compare);
  $("estimate").addEventListener("submit", estimate);
  window.addEventListener("resize", resize);
  loadRuns();
})();

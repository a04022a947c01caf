// The host page: /api/host (appliance hostcheck's report) as one summary line, the warnings with
// the setting to change, and the facts by section, each with its value and where it was read (or
// why it could not be). Refresh asks for a new check (/api/host?refresh=1). DOM through App.el only.
"use strict";
(function () {
  const { el, fmt } = App;
  const main = document.getElementById("host");
  const meta = document.getElementById("hostmeta");
  const body = document.getElementById("hostbody");
  const button = document.getElementById("refresh");
  let renders = 0;
  let loading = false;

  const LABELS = {
    logical_cpus: "logical CPUs", smt_active: "SMT active", smt_control: "SMT control",
    energy_perf_preference: "energy performance preference", cur_mhz: "clock now", max_mhz: "max clock",
    total_bytes: "total", available_bytes: "available", thp_enabled: "transparent huge pages",
    thp_defrag: "THP defrag", cmdline: "command line", group_types: "group types",
    gpu_group_type: "GPU's group type", pci_slot: "PCI slot", vram_bytes: "VRAM", gtt_bytes: "GTT",
    unified: "unified memory", ttm_pages_limit: "ttm.pages_limit", amdgpu_gttsize_mib: "amdgpu.gttsize",
    gtt_limits: "GTT limits", power_w: "power now", cap_w: "cap", default_cap_w: "default cap",
    max_cap_w: "max cap", gpu_offload: "GPU offload",
  };

  function unavailable(v) {
    return v !== null && typeof v === "object" && !Array.isArray(v) && typeof v.unavailable === "string";
  }

  function known(v) { return v !== null && v !== undefined && !unavailable(v); }

  function label(name) { return LABELS[name] || name.replace(/_/g, " "); }

  function number(name, v) {
    if (name.endsWith("_bytes")) return fmt.bytes(v);
    if (name.endsWith("_mhz")) return v.toFixed(0) + " MHz";
    if (name.endsWith("_w")) return v.toFixed(1) + " W";
    if (name.endsWith("_mib")) return v < 0 ? "driver default" : fmt.int(v) + " MiB";
    if (name.endsWith("pages_limit")) return `${fmt.int(v)} pages of 4 KiB (${fmt.bytes(v * 4096)})`;
    return fmt.int(v);
  }

  // A known fact's value as text
  function show(name, v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v === "number") return number(name, v);
    if (Array.isArray(v)) return v.length ? v.map((x) => show("", x)).join(", ") : "none";
    if (typeof v === "object") {
      const kv = Object.entries(v).map(([k, x]) => (typeof x === "number" ? `${k} ×${x}` : x === "" ? k : `${k}=${x}`));
      return kv.length ? kv.join(" ") : "none";
    }
    return String(v);
  }

  // One row per field of `record` but `skip`. `source` is where the facts were read: a function of
  // the field's name, or one string for the whole record (then said once, in the caption).
  function table(caption, record, source, skip) {
    const whole = typeof source === "string" ? source : null;
    const rows = Object.entries(record || {}).filter(([k]) => !(skip || []).includes(k)).map(([k, v]) => {
      const gone = unavailable(v);
      const src = gone ? v.unavailable : whole === null && source ? source(k) || "" : "";
      return el("tr", { class: gone ? "unavailable" : null, "data-fact": k },
        el("th", { scope: "row", text: label(k) }),
        el("td", { text: gone ? "unavailable" : show(k, v) }),
        el("td", { class: "src", text: src }));
    });
    const cap = [caption, whole && `read from ${whole}`].filter(Boolean).join(" · ");
    return el("table", {}, cap ? el("caption", { text: cap }) : null, el("tbody", {}, rows));
  }

  function notes(list, what) {
    if (!list || !list.length) return [];
    return [el("ul", { class: "notes" }, list.map((n) => el("li", { text: `${what}: ${n}` })))];
  }

  function gpuName(g) {
    let name = `${g.vendor} GPU` + (known(g.arch) ? ` ${g.arch}` : "");
    if (known(g.name)) name = g.name.startsWith(g.vendor) ? g.name : `${g.vendor} ${g.name}`;
    const mem = g.unified === true ? "unified memory" : known(g.vram_bytes) ? `${fmt.bytes(g.vram_bytes)} VRAM` : null;
    return mem ? `${name} (${mem})` : name;
  }

  function gpuParts(gpu, src) {
    const parts = (gpu.gpus || []).map((g) =>
      table(gpuName(g) + (known(g.pci_slot) ? ` at ${g.pci_slot}` : ""), g, g.source, ["source"]));
    const gtt = gpu.gtt_limits;
    if (known(gtt)) parts.push(table("GTT limits", gtt, (k) => (src.gtt_limits || {})[k]));
    else if (gtt) parts.push(table(null, { gtt_limits: gtt }));
    return parts.concat(notes(gpu.not_found, "not found"));
  }

  function powerParts(p) {
    return (p.domains || []).map((d) => table(`${d.label} (${d.kind})`, d, d.path, ["label", "kind", "path"]))
      .concat(notes(p.not_found, "not found"));
  }

  function llamaParts(l) {
    const facts = { version: l.version, gpu_offload: l.gpu_offload };
    for (const d of l.devices || []) {
      facts[d.name] = `${d.description}: ${fmt.bytes(d.free_bytes)} free of ${fmt.bytes(d.total_bytes)}`;
    }
    return [table(null, facts, "the engine's llama.cpp and ggml devices, at model load")];
  }

  // [title, key in the snapshot, a few words for the closed section, its tables]
  function sections(r) {
    const s = r.snapshot, src = r.sources || {};
    const from = (map) => (k) => (map || {})[k];
    const iommu = s.iommu || {};
    const out = [
      ["CPU", "cpu", (c) => known(c.governor) && `governor ${c.governor}`, (c) => [table(null, c, from(src.cpu))]],
      ["Memory", "memory", (m) => known(m.total_bytes) && fmt.bytes(m.total_bytes), (m) => [table(null, m, from(src.memory))]],
      ["Kernel", "kernel", (k) => known(k.release) && k.release, (k) => [table(null, k, from(src.kernel))]],
      ["IOMMU", "iommu", (i) => known(i.mode) && i.mode,
        (i) => [table(null, i, (k) => (k === "mode" ? iommu.source : (src.iommu || {})[k]), ["source"])]],
      ["GPU", "gpu", (g) => `${(g.gpus || []).length} found`, (g) => gpuParts(g, src)],
      ["Power", "power", (p) => (p.domains || []).map((d) => `${d.label} ${known(d.power_w) ? show("power_w", d.power_w) : "?"}`).join(", "),
        powerParts],
    ].map(([title, key, digest, parts]) => [title, key, digest(s[key] || {}), parts(s[key] || {})]);
    if (r.llama_cpp) out.push(["llama.cpp", "llama_cpp", r.llama_cpp.gpu_offload ? "GPU offload" : "CPU only", llamaParts(r.llama_cpp)]);
    return out;
  }

  function section([title, key, digest, parts], r, open) {
    const gone = Object.keys(r.unavailable || {}).filter((f) => f.startsWith(key + ".")).length;
    const words = [digest, gone && `${gone} unavailable`].filter(Boolean).join(" · ");
    return el("details", { class: "facts", "data-section": key, open: open.has(key) },
      el("summary", {}, title + " ", el("span", { class: "muted", text: words })), ...parts);
  }

  function summaryLine(s) {
    const c = s.cpu || {}, m = s.memory || {}, k = s.kernel || {};
    const val = (v, f) => (known(v) ? f(v) : "?");
    const gpus = ((s.gpu || {}).gpus || []).map(gpuName);
    return [
      val(c.model, String) + (c.virtual_machine === true ? " (virtual machine)" : ""),
      `${val(c.physical_cores, String)} cores / ${val(c.logical_cpus, String)} threads`,
      `${val(m.total_bytes, fmt.bytes)} memory (${val(m.available_bytes, fmt.bytes)} available)`,
      gpus.length ? gpus.join(", ") : "no GPU found",
      `kernel ${val(k.release, String)}` + (known(k.distribution) ? ` (${k.distribution})` : ""),
    ].join(" · ");
  }

  function card(a) {
    const warn = a.severity === "warning";
    return el("div", { class: "card advice " + (warn ? "warn" : "note"), "data-setting": a.setting },
      el("h3", {}, el("span", { class: "sev", text: a.severity || "note" }), a.setting || "(unnamed setting)"),
      el("p", { class: "why", text: a.message || "" }),
      el("p", { class: "fix" }, el("strong", { text: "Fix: " }), a.fix || ""));
  }

  function adviceList(list) {
    const warnings = list.filter((a) => a.severity === "warning").length;
    const notesN = list.length - warnings;
    const head = el("h2", { text: `Warnings (${warnings})` + (notesN ? ` and notes (${notesN})` : "") });
    if (!list.length) {
      return [head, el("p", { class: "muted", id: "noadvice",
        text: "None: no setting that hostcheck knows to cost performance was found." })];
    }
    return [head, ...list.map(card)];
  }

  function metaLine(r) {
    const parts = [r.source === "this host" ? "This host" : `Saved report ${r.source}`,
      `collected ${fmt.when(r.collected_at)}` + (r.cached ? " (kept from an earlier check; Refresh checks again)" : "")];
    if (r.model) parts.push(`advice checked against ${r.model.name} (${fmt.bytes(r.model.bytes)})`);
    const n = Object.keys(r.unavailable || {}).length;
    if (n) parts.push(`${n} facts unavailable (each says why)`);
    return parts.join(" · ");
  }

  function render(r) {
    const open = new Set([...body.querySelectorAll("details.facts[open]")].map((d) => d.dataset.section));
    meta.textContent = metaLine(r);
    meta.classList.remove("error");
    body.replaceChildren(
      el("p", { class: "summary", id: "summary", text: summaryLine(r.snapshot) }),
      ...adviceList(r.advice || []),
      el("h2", { text: "Facts" }),
      ...sections(r).map((s) => section(s, r, open)));
    main.dataset.renders = String(++renders);
  }

  async function load(refresh) {
    if (loading) return;
    loading = true;
    button.disabled = true;
    button.textContent = refresh ? "Checking…" : "Refresh";
    try {
      render(await App.api("/api/host" + (refresh ? "?refresh=1" : "")));
    } catch (err) {
      meta.textContent = `Could not get the host report: ${err.message}`;
      meta.classList.add("error");
    } finally {
      loading = false;
      button.disabled = false;
      button.textContent = "Refresh";
    }
  }

  button.addEventListener("click", () => load(true));
  load(false);
})();

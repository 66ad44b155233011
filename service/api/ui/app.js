// The bnadapt web UI: plain JavaScript, no build step, no outside files. It talks to the same
// API as the CLI, with the API key the user signs in with (kept in sessionStorage for this tab,
// sent as a Bearer token): a tenant sees only its own jobs, models and datasets.
"use strict";

const KEY = "bnadapt.key";
const main = document.getElementById("main");
const nav = document.getElementById("nav");
let stopStream = null; // aborts the job page's event stream when leaving it

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function key() { return sessionStorage.getItem(KEY); }

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { ...(options.headers || {}), Authorization: `Bearer ${key()}` },
  });
  if (response.status === 401) { sessionStorage.removeItem(KEY); route(); throw new Error("signed out"); }
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`HTTP ${response.status}: ${detail}`);
  }
  return response;
}
const getJson = async (path) => (await api(path)).json();

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 1e4 || (Math.abs(value) < 1e-3 && value !== 0)
    ? value.toExponential(2) : value.toFixed(digits);
}
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "–");
const statusCell = (status) => el("span", { class: `status ${status}` }, status);

function show(...nodes) {
  main.replaceChildren(...nodes);
  main.focus({ preventScroll: true });
}
function fail(error) { show(el("p", { class: "error", role: "alert" }, String(error.message || error))); }

// --- sign in ---------------------------------------------------------------------------------

function signIn() {
  nav.hidden = true;
  const input = el("input", { id: "apikey", type: "password", autocomplete: "off", required: true,
                              placeholder: "bna_…", "aria-describedby": "keyhelp" });
  const message = el("p", { class: "error", role: "alert" });
  const form = el("form", { class: "signin card", onsubmit: async (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      const response = await fetch("/v1/jobs?page_size=1", { headers: { Authorization: `Bearer ${key()}` } });
      if (response.ok) { location.hash = "#/jobs"; route(); return; }
      sessionStorage.removeItem(KEY);
      message.textContent = "That key is not valid: check it, or make one with `bnadapt keys create`.";
    } },
    el("h1", {}, "Sign in"),
    el("label", { for: "apikey" }, "API key", input),
    el("p", { id: "keyhelp", class: "muted" },
       "`bnadapt up` prints it (and saves it in the data directory's client.json). It is kept only in this tab."),
    el("button", { class: "primary", type: "submit", id: "signin" }, "Sign in"),
    message);
  show(form);
  input.focus();
}

// --- jobs ------------------------------------------------------------------------------------

// The job kinds, in the job-kind table's order, read from the API's own OpenAPI document: the
// job-create union lists one schema per kind, and its discriminator names the kind of each.
// A new kind thus needs no edit here. Read once per page load; a failed read is tried again.
let jobKindsRead = null;
function jobKinds() {
  jobKindsRead = jobKindsRead || getJson("/openapi.json").then((doc) => {
    const union = doc.components.schemas.JobCreate;
    const kindOf = Object.fromEntries(Object.entries(union.discriminator.mapping).map(([kind, ref]) => [ref, kind]));
    return union.oneOf.map((variant) => kindOf[variant.$ref]);
  }).catch((error) => { jobKindsRead = null; throw error; });
  return jobKindsRead;
}

async function jobsPage(query) {
  const params = new URLSearchParams(query);
  const kinds = await jobKinds();
  const field = (name, label, control) => el("label", {}, label, control);
  const select = (name, options) => el("select", { name, id: `f-${name}` },
    el("option", { value: "" }, "any"),
    options.map((o) => el("option", { value: o, selected: params.get(name) === o }, o)));
  const text = (name, hint) => el("input", { name, id: `f-${name}`, value: params.get(name) || "", placeholder: hint, size: 18 });
  const form = el("form", { class: "filters", onsubmit: (event) => {
      event.preventDefault();
      const chosen = new URLSearchParams();
      for (const [name, value] of new FormData(form)) if (value) chosen.set(name, value);
      location.hash = `#/jobs?${chosen}`;
    } },
    field("status", "Status", select("status", ["queued", "running", "succeeded", "failed", "canceled"])),
    field("kind", "Kind", select("kind", kinds)),
    field("model_id", "Model", text("model_id", "mdl_…")),
    field("dataset_id", "Dataset", text("dataset_id", "ds_…")),
    field("tag", "Tag", text("tag", "key:value")),
    el("button", { type: "submit" }, "Filter"));
  const request = new URLSearchParams({ page_size: "100" });
  for (const [name, value] of params) if (value) request.set(name, value);
  const page = await getJson(`/v1/jobs?${request}`);
  const rows = page.items.map((job) => el("tr", {},
    el("td", {}, el("a", { href: `#/jobs/${job.id}` }, job.id)),
    el("td", {}, job.kind),
    el("td", {}, statusCell(job.status)),
    el("td", {}, job.progress ? `${job.progress.phase} ${job.progress.done}/${job.progress.total}` : "–"),
    el("td", { class: "wide" }, el("code", {}, job.model_id)),
    el("td", { class: "wide" }, Object.entries(job.tags || {}).map(([k, v]) => `${k}=${v}`).join(" ")),
    el("td", { class: "wide" }, when(job.created_at))));
  show(el("h1", {}, "Jobs"), form,
       el("div", { class: "scroll" }, el("table", { id: "jobs" },
         el("thead", {}, el("tr", {}, ["Job", "Kind", "Status", "Progress"].map((h) => el("th", {}, h)),
                            ["Model", "Tags", "Created"].map((h) => el("th", { class: "wide" }, h)))),
         el("tbody", {}, rows))),
       page.items.length ? null : el("p", { class: "muted" }, "No jobs match."));
}

// Server-sent events over fetch: EventSource cannot send the Authorization header.
async function followEvents(jobId, onEvent, signal) {
  const response = await api(`/v1/jobs/${jobId}/events?logs=true`, { signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message"; const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      if (data.length) onEvent(event, JSON.parse(data.join("\n")));
    }
  }
}

function progressView(progress) {
  if (!progress) return el("p", { class: "muted", id: "progress-text" }, "no progress yet");
  const pct = progress.total ? Math.round((100 * progress.done) / progress.total) : 0;
  const eta = progress.eta_seconds === null || progress.eta_seconds === undefined ? "" : `, ETA ${Math.round(progress.eta_seconds)} s`;
  const rate = progress.samples_per_second ? `, ${Math.round(progress.samples_per_second).toLocaleString()} samples/s` : "";
  return el("div", {},
    el("div", { class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": progress.total,
                "aria-valuenow": progress.done, "aria-label": "progress" }, el("div", { style: `width:${pct}%` })),
    el("p", { id: "progress-text" }, `${progress.phase}: ${progress.done}/${progress.total} ${progress.unit}${rate}${eta}`));
}

async function download(path, filename) {
  const blob = await (await api(path)).blob();
  const url = URL.createObjectURL(blob);
  const link = el("a", { href: url, download: filename });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function jobPage(jobId) {
  let job = await getJson(`/v1/jobs/${jobId}`);
  const statusBox = el("span", { id: "job-status" });
  const progressBox = el("div", { id: "progress" });
  const facts = el("dl", { class: "facts" });
  const logBox = el("pre", { id: "logs", "aria-live": "polite" });
  const actions = el("div", { id: "actions" });
  const reportBox = el("section", { id: "report", "aria-label": "report" });
  // A train job's validated epochs as they come (the stream's `epoch` events; a page opened
  // late gets the epochs so far first): the curve grows while the job runs.
  const epochs = [];
  const epochsBox = el("section", { class: "card", id: "epochs-live", hidden: true });
  const render = () => {
    statusBox.replaceChildren(statusCell(job.status));
    progressBox.replaceChildren(progressView(job.progress));
    epochsBox.hidden = epochs.length === 0;
    if (epochs.length) epochsBox.replaceChildren(...epochsView(epochs));
    facts.replaceChildren(
      el("dt", {}, "kind"), el("dd", {}, job.kind),
      el("dt", {}, "model"), el("dd", {}, el("code", {}, job.model_id)),
      el("dt", {}, "dataset"), el("dd", {}, el("code", {}, job.dataset_id)),
      el("dt", {}, "created"), el("dd", {}, when(job.created_at)),
      el("dt", {}, "started"), el("dd", {}, when(job.started_at)),
      el("dt", {}, "finished"), el("dd", {}, when(job.finished_at)),
      el("dt", {}, "tags"), el("dd", {}, Object.entries(job.tags || {}).map(([k, v]) => `${k}=${v}`).join(" ") || "–"),
      ...(job.error ? [el("dt", {}, "error"), el("dd", { class: "error" }, job.error)] : []));
    const buttons = [];
    if (!["succeeded", "failed", "canceled"].includes(job.status)) {
      buttons.push(el("button", { type: "button", id: "cancel", onclick: async () => {
        await api(`/v1/jobs/${job.id}:cancel`, { method: "POST" }); } }, "Cancel"));
    }
    if (job.result && job.result.model_id) {
      buttons.push(el("button", { type: "button", id: "download-weights",
        onclick: () => download(job.result.weights_url, `${job.result.model_id}.safetensors`) }, "Download weights"));
    }
    if (job.status === "succeeded") {
      buttons.push(el("button", { type: "button", id: "download-report",
        onclick: () => download(`/v1/jobs/${job.id}/report`, `${job.id}.report.json`) }, "Download report"));
    }
    actions.replaceChildren(...buttons);
  };
  render();
  show(el("h1", {}, "Job ", el("code", {}, job.id), " ", statusBox),
       el("div", { class: "cards" },
         el("section", { class: "card" }, el("h2", {}, "Progress"), progressBox, actions),
         el("section", { class: "card" }, el("h2", {}, "Job"), facts),
         el("section", { class: "card" }, el("h2", {}, "Parameters"), el("pre", { id: "params" }, JSON.stringify(job.params, null, 2)))),
       epochsBox,
       el("section", { class: "card" }, el("h2", {}, "Logs"), logBox),
       reportBox);
  const loadReport = async () => {
    if (job.status !== "succeeded") { reportBox.replaceChildren(); return; }
    reportBox.replaceChildren(reportView(await getJson(`/v1/jobs/${job.id}/report`)));
  };
  const controller = new AbortController();
  stopStream = () => controller.abort();
  if (["succeeded", "failed", "canceled"].includes(job.status)) {
    const logs = await getJson(`/v1/jobs/${job.id}/logs`);
    logBox.textContent = logs.items.map(logLine).join("\n");
    await loadReport();
    return;
  }
  followEvents(job.id, (event, data) => {
    if (event === "status" || event === "end") job = data;
    else if (event === "progress") job = { ...job, progress: data };
    else if (event === "epoch" && !epochs.some((e) => e.epoch === data.epoch)) epochs.push(data);
    else if (event === "log") logBox.textContent += (logBox.textContent ? "\n" : "") + logLine(data);
    render();
    if (event === "end") loadReport().catch(fail);
  }, controller.signal).catch((error) => { if (error.name !== "AbortError") fail(error); });
}

// A train job's losses by epoch (the report's `epochs` entries, or the stream's `epoch` events:
// the same numbers), as lineChart's series.
const lossByEpoch = (epochs) => [
  { name: "train loss", color: "#0b5cad", points: epochs.map((e) => [e.epoch, e.train_loss]) },
  { name: "val loss", color: "#c0362c", points: epochs.map((e) => [e.epoch, e.val_loss]) },
];

function epochsView(epochs) {
  const last = epochs[epochs.length - 1];
  const best = epochs.filter((e) => e.best).pop();
  const accuracy = last.val_accuracy === null ? "" : `, val accuracy ${fmt(last.val_accuracy, 3)}`;
  const bestText = best ? `; best so far: epoch ${best.epoch} (val loss ${fmt(best.val_loss)})` : "";
  return [
    el("h2", {}, "Epochs"),
    el("p", { id: "epoch-text" },
       `epoch ${last.epoch}/${last.epochs}: train loss ${fmt(last.train_loss)}, val loss ${fmt(last.val_loss)}${accuracy}${bestText}`),
    lineChart("Loss by epoch, so far", lossByEpoch(epochs), { id: "plot-epochs-live" }),
  ];
}

// A sharded job's parts (shards, merge, evaluations, finish) log to its log, labelled.
const logLine = (entry) =>
  `${new Date(entry.at).toLocaleTimeString()} ${entry.level.padEnd(7)} ${entry.part ? `[${entry.part}] ` : ""}${entry.message}`;

// --- plots -----------------------------------------------------------------------------------

// Horizontal bars, one per item: label, value, and a reference line (0 or 1).
function barChart(title, items, { reference = 0, id } = {}) {
  // About as wide as a card of the report's three columns: drawn near 1:1, the labels readable.
  const rowH = 20, left = 120, right = 64, width = 380;
  const height = items.length * rowH + 30;
  const values = items.map((i) => i.value).filter((v) => Number.isFinite(v));
  const lo = Math.min(reference, ...values), hi = Math.max(reference, ...values);
  const span = hi - lo || 1;
  const x = (v) => left + ((v - lo) / span) * (width - left - right);
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title, id });
  svg.append(svgEl("title", {}, title));
  items.forEach((item, row) => {
    const y = 10 + row * rowH;
    const v = Number.isFinite(item.value) ? item.value : reference;
    svg.append(svgEl("text", { x: left - 6, y: y + 12, "text-anchor": "end" }, item.label.length > 19 ? `…${item.label.slice(-18)}` : item.label));
    svg.append(svgEl("rect", { x: Math.min(x(reference), x(v)), y: y + 3, width: Math.max(Math.abs(x(v) - x(reference)), 1),
                               height: rowH - 6, fill: item.color || "#0b5cad" }));
    svg.append(svgEl("text", { x: width - right + 4, y: y + 12 }, fmt(item.value)));
  });
  svg.append(svgEl("line", { x1: x(reference), x2: x(reference), y1: 6, y2: height - 16, stroke: "#57606a", "stroke-dasharray": "3 3" }));
  svg.append(svgEl("text", { x: x(reference), y: height - 4, "text-anchor": "middle" }, String(reference)));
  return el("div", { class: "card" }, el("h3", {}, title), svg);
}

function lineChart(title, series, { id } = {}) {
  const width = 560, height = 240, left = 50, bottom = 30, top = 10, right = 110;
  const points = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
  const card = el("div", { class: "card" }, el("h3", {}, title));
  if (!points.length) return card;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  const x = (v) => left + ((v - x0) / (x1 - x0 || 1)) * (width - left - right);
  const y = (v) => top + (1 - (v - y0) / (y1 - y0 || 1)) * (height - top - bottom);
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title, id });
  svg.append(svgEl("title", {}, title));
  svg.append(svgEl("line", { x1: left, x2: width - right, y1: y(y0), y2: y(y0), stroke: "#57606a" }));
  svg.append(svgEl("line", { x1: left, x2: left, y1: top, y2: height - bottom, stroke: "#57606a" }));
  svg.append(svgEl("text", { x: left - 4, y: y(y1) + 4, "text-anchor": "end" }, fmt(y1, 3)));
  svg.append(svgEl("text", { x: left - 4, y: y(y0) + 4, "text-anchor": "end" }, fmt(y0, 3)));
  svg.append(svgEl("text", { x: x(x0), y: height - 12 }, `epoch ${x0}`));
  svg.append(svgEl("text", { x: x(x1), y: height - 12, "text-anchor": "end" }, `${x1}`));
  series.forEach((s, i) => {
    const ok = s.points.filter((p) => Number.isFinite(p[1]));
    if (!ok.length) return;
    svg.append(svgEl("polyline", { points: ok.map((p) => `${x(p[0])},${y(p[1])}`).join(" "), fill: "none", stroke: s.color, "stroke-width": 2 }));
    svg.append(svgEl("text", { x: width - right + 8, y: top + 14 + i * 16, fill: s.color }, s.name));
  });
  card.append(svg);
  return card;
}

function reportView(report) {
  const parts = [el("h2", {}, "Report")];
  const facts = el("dl", { class: "facts" },
    el("dt", {}, "estimator"), el("dd", {}, report.estimator || "–"),
    el("dt", {}, "batches / samples"), el("dd", {}, `${report.batches} / ${report.samples}`),
    el("dt", {}, "device"), el("dd", {}, `${report.device} (torch ${report.torch_version})`),
    el("dt", {}, "compute"), el("dd", {}, `${fmt(report.timings.compute_s, 2)} s`));
  parts.push(el("div", { class: "card" }, facts));
  const charts = [];
  const metrics = [["before", report.metrics_before], ["after", report.metrics_after]].filter(([, m]) => m);
  if (metrics.length) {
    const accuracy = metrics.filter(([, m]) => m.accuracy !== null && m.accuracy !== undefined);
    if (accuracy.length) charts.push(barChart("Accuracy before / after", accuracy.map(([w, m]) => ({ label: w, value: m.accuracy, color: w === "after" ? "#1a7f37" : "#57606a" })), { id: "plot-accuracy" }));
    charts.push(barChart("Loss before / after", metrics.map(([w, m]) => ({ label: w, value: m.loss, color: w === "after" ? "#1a7f37" : "#57606a" })), { id: "plot-loss" }));
  }
  if (report.batchnorm.length) {
    charts.push(barChart("BatchNorm: mean |shift| of running_mean", report.batchnorm.map((b) => ({ label: b.name, value: b.running_mean_mean_abs_shift })), { id: "plot-mean-shift" }));
    charts.push(barChart("BatchNorm: running_var ratio after / before", report.batchnorm.map((b) => ({ label: b.name, value: b.running_var_mean_ratio, color: "#9a6700" })), { reference: 1, id: "plot-var-ratio" }));
  }
  if (report.epochs.length) {
    charts.push(lineChart("Loss by epoch", lossByEpoch(report.epochs), { id: "plot-epochs" }));
  }
  if (report.shards.length) {
    charts.push(barChart("Shards: compute seconds", report.shards.map((s) => ({ label: `shard ${s.index} (${s.batches} batches)`, value: s.compute_s })), { id: "plot-shards" }));
  }
  parts.push(el("div", { class: "cards" }, charts));
  if (report.diagnostics) parts.push(diagnosticsView(report.diagnostics));
  if (report.auto) parts.push(autoView(report.auto));
  if (report.tensors.length) {
    parts.push(el("details", { class: "card" }, el("summary", {}, `Tensors (${report.tensors.filter((t) => t.changed).length} of ${report.tensors.length} changed)`),
      el("div", { class: "scroll" }, el("table", {},
        el("thead", {}, el("tr", {}, ["tensor", "changed", "max |Δ|", "‖Δ‖", "relative ‖Δ‖", "before → after"].map((h) => el("th", {}, h)))),
        el("tbody", {}, report.tensors.map((t) => el("tr", {},
          el("td", {}, el("code", {}, t.name)), el("td", {}, t.changed ? "yes" : "no"), el("td", {}, fmt(t.max_abs)),
          el("td", {}, fmt(t.l2)),
          el("td", { title: t.relative_l2 === null ? "no relative change from a zero baseline or for a counter" : "" }, t.relative_l2 === null ? "n/a" : fmt(t.relative_l2)),
          el("td", {}, t.before === null || t.before === undefined ? "" : `${fmt(t.before)} → ${fmt(t.after)}`))))))));
  }
  return el("div", {}, parts);
}

const pct = (fraction) => `${(100 * fraction).toFixed(1)}%`;

// An adapt job's unsupervised diagnostics: the input and output models' predictions on the
// same target samples (held out of estimation, or the estimation samples themselves).
function diagnosticsView(d) {
  const where = d.held_out ? "held-out" : "estimation";
  const row = (label, key) => el("tr", {}, el("th", { scope: "row" }, label),
    el("td", { class: "num" }, fmt(d.before[key])), el("td", { class: "num" }, fmt(d.after[key])));
  const table = el("table", { id: "diagnostics-table" },
    el("caption", { class: "muted" }, `predictions on ${d.samples} ${where} samples, without labels`),
    el("thead", {}, el("tr", {}, ["", "before", "after"].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {},
      row("mean entropy (nats)", "mean_entropy"),
      row("mean max probability", "mean_max_probability"),
      row("marginal entropy (nats)", "marginal_entropy"),
      el("tr", {}, el("th", { scope: "row" }, "predictions changed"),
        el("td", { class: "num", colspan: 2, id: "changed-fraction" }, pct(d.changed_fraction)))));
  const chart = barChart("Mean entropy before / after (nats)", [
    { label: "before", value: d.before.mean_entropy, color: "#57606a" },
    { label: "after", value: d.after.mean_entropy, color: "#1a7f37" }], { id: "plot-entropy" });
  return el("section", { class: "cards", id: "diagnostics", "aria-label": "diagnostics" },
    el("div", { class: "card" }, el("h3", {}, "Diagnostics"), el("div", { class: "scroll" }, table)), chart);
}

// The auto estimator's candidates, their scores on the held-out samples, and its choice.
function autoView(auto) {
  const choice = auto.kept_source ? "auto kept the source model unchanged" : `auto chose ${auto.chosen}`;
  const label = (c) => (c.source_weight === null || c.source_weight === undefined
    ? c.name : `${c.name} (source weight ${fmt(c.source_weight, 3)})`);
  const table = el("table", { id: "auto-candidates" },
    el("thead", {}, el("tr", {}, ["candidate", "prior strength", "mean entropy", "marginal entropy", "score",
      "changed", "eligible", ""].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, auto.candidates.map((c, i) => el("tr", { class: i === auto.chosen_index ? "chosen" : null },
      el("td", {}, el("code", { class: "nowrap" }, label(c))), el("td", { class: "num" }, fmt(c.prior_strength, 1)),
      el("td", { class: "num" }, fmt(c.predictions.mean_entropy)), el("td", { class: "num" }, fmt(c.predictions.marginal_entropy)),
      el("td", { class: "num" }, fmt(c.score)), el("td", { class: "num" }, pct(c.changed_fraction)),
      el("td", {}, c.eligible ? "yes" : "no"), el("td", {}, i === auto.chosen_index ? "chosen" : "")))));
  const chart = barChart("auto: candidates' scores (higher is better)", auto.candidates.map((c, i) => ({
    label: c.source_weight === null || c.source_weight === undefined ? c.name : `${c.name} w=${fmt(c.source_weight, 2)}`,
    value: c.score, color: i === auto.chosen_index ? "#1a7f37" : (c.eligible ? "#0b5cad" : "#8c959f") })),
    { id: "plot-auto-scores" });
  return el("section", { class: "cards", id: "auto", "aria-label": "auto estimator" },
    el("div", { class: "card span-all" }, el("h3", {}, "auto estimator"),
      el("p", { id: "auto-choice" }, el("strong", {}, choice)),
      el("p", { class: "muted" }, `${auto.candidates.length} candidates estimated on ${auto.estimation_samples} samples, ` +
        `scored on ${auto.held_out_samples} held out` +
        (auto.folds > 1 ? ` and cross-fitted over ${auto.folds} folds (${auto.scored_samples} samples scored)` : "") +
        `; the rule: ${auto.criterion}`),
      el("div", { class: "scroll" }, table)),
    chart);
}

// --- models and datasets ---------------------------------------------------------------------

async function modelsPage() {
  const page = await getJson("/v1/models?page_size=200");
  const rows = page.items.map((m) => el("tr", { id: `model-${m.id}` },
    el("td", {}, el("code", {}, m.id)),
    el("td", {}, m.architecture),
    el("td", {}, m.source),
    el("td", {}, m.parent ? el("code", {}, m.parent) : "–"),
    el("td", {}, m.job_id ? el("a", { href: `#/jobs/${m.job_id}` }, m.job_id) : "–"),
    el("td", {}, el("button", { type: "button", class: "download", onclick: () => download(`/v1/models/${m.id}/weights`, `${m.id}.safetensors`) }, "Download"))));
  show(el("h1", {}, "Models"), el("p", { class: "muted" }, "Lineage: a model a job made names its parent and the job."),
       el("div", { class: "scroll" }, el("table", { id: "models" },
         el("thead", {}, el("tr", {}, ["Model", "Architecture", "Source", "Parent", "Job", ""].map((h) => el("th", {}, h)))),
         el("tbody", {}, rows))));
}

async function datasetsPage() {
  const page = await getJson("/v1/datasets?page_size=200");
  const rows = page.items.map((d) => el("tr", {},
    el("td", {}, el("code", {}, d.id)), el("td", {}, d.name), el("td", {}, d.num_samples),
    el("td", {}, d.sample_shape.join("×")), el("td", {}, d.label_kind || "no labels"),
    el("td", { class: "wide" }, when(d.created_at)),
    el("td", {}, el("a", { href: `#/jobs?dataset_id=${d.id}` }, "jobs"))));
  show(el("h1", {}, "Datasets"),
       el("div", { class: "scroll" }, el("table", { id: "datasets" },
         el("thead", {}, el("tr", {}, ["Dataset", "Name", "Samples", "Shape", "Labels"].map((h) => el("th", {}, h)), el("th", { class: "wide" }, "Created"), el("th", {}, ""))),
         el("tbody", {}, rows))));
}

// --- routing ---------------------------------------------------------------------------------

function route() {
  if (stopStream) { stopStream(); stopStream = null; }
  if (!key()) { signIn(); return; }
  nav.hidden = false;
  const hash = location.hash.replace(/^#/, "") || "/jobs";
  const [path, query] = hash.split("?");
  const job = path.match(/^\/jobs\/([A-Za-z0-9_-]+)$/);
  const page = job ? jobPage(job[1]) : path === "/models" ? modelsPage() : path === "/datasets" ? datasetsPage() : jobsPage(query || "");
  page.catch(fail);
}

document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  location.hash = "";
  route();
});
window.addEventListener("hashchange", route);
route();

// The fleet console's page script: five views (devices, one device, rollouts, engines, enrollment) over the JSON API,
// kept live by server-sent events (/events). Everything a device sent is untrusted: it reaches the
// document only as text nodes (el() below, textContent), never as markup, and invisible or
// direction-changing characters are shown as escapes (safe()), as the CLI's untrusted.shown does.
"use strict";

const TOKEN_KEY = "edge-agent-console-token";
const $ = (sel) => document.querySelector(sel);
// Control, format (bidi overrides, zero-width), separator and lone surrogate characters.
const INVISIBLE = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Cs}]/gu;

function safe(value, limit = 200) {
  if (value === null || value === undefined) return "-";
  let text = String(value).replace(INVISIBLE, (c) => "\\u" + c.codePointAt(0).toString(16).padStart(4, "0"));
  if (text.length > limit) text = text.slice(0, limit - 3) + "...";
  return text;
}

// el("td", {className: "num"}, "text", childNode, ...): strings become text nodes, never HTML.
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else node[key] = value;
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(safe(child, 1024)));
  }
  return node;
}

function num(value, digits = 1) {
  if (value === null || value === undefined) return "-";
  return Math.abs(value) >= 1e6 ? value.toExponential(1) : value.toFixed(digits);
}

function age(ts) {
  if (ts === null || ts === undefined) return "";
  const s = Math.max(0, Math.round(Date.now() / 1000 - ts));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m";
  if (s < 86400) return Math.floor(s / 3600) + "h";
  return Math.floor(s / 86400) + "d";
}

// "1 device", "3 devices": every count the page writes goes through here.
function plural(n, one, many) {
  return n + " " + (n === 1 ? one : (many || one + "s"));
}

// 250 -> "4m 10s": a time left or a policy's soak, in words an operator reads at a glance.
function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), rest = s % 60;
  if (h) return h + "h " + m + "m";
  if (m) return m + "m" + (rest ? " " + rest + "s" : "");
  return rest + "s";
}

function when(ts) {
  return ts ? new Date(ts * 1000).toLocaleString() : "-";
}

// "2026-03-01 12:09:55": UTC, as `fleet engines list` writes times (its column says so).
function utc(ts) {
  return ts ? new Date(ts * 1000).toISOString().slice(0, 19).replace("T", " ") : "-";
}

function badge(text) {
  // The class is one of our known words only, never device text as a class name.
  const known = /^(online|offline|unknown|stale|ACTIVE|DONE|RUNNING|PAUSED|SOAKING|FAILED|REJECTED|ROLLED_BACK|TRIPPED|ABORTED|WAITING|CANCELLED|SUPERSEDED|withdrawn)$/;
  return el("span", { className: "badge" + (known.test(text) ? " " + text : "") }, text);
}

function say(text, kind) {
  const box = $("#message");
  box.hidden = false;
  box.className = kind || "";
  box.textContent = safe(text, 500);
}

async function getJSON(url) {
  const response = await fetch(url, { headers: { accept: "application/json" } });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// -- live events -----------------------------------------------------------------------------------

let source = null;

function listen(query, handlers) {
  if (source) source.close();
  source = new EventSource("/events?" + query.toString());
  const live = $("#live");
  source.onopen = () => { live.textContent = "live"; live.className = "live on"; };
  source.onerror = () => { live.textContent = "reconnecting"; live.className = "live off"; };
  for (const [name, handler] of Object.entries(handlers)) {
    source.addEventListener(name, (event) => {
      handler(JSON.parse(event.data));
      live.textContent = "live, updated " + new Date().toLocaleTimeString();
      live.className = "live on";
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    });
  }
}

// -- devices ---------------------------------------------------------------------------------------

const COLUMNS = ["Device", "State", "Agent", "Config", "Release", "Models", "Cameras", "FPS", "p99 ms", "CPU %", "Temp °C", "Last job", "Labels"];

// One of the device's own targets (up/info's config, agent_release): what runs, "-> v" while v is
// applied or watched, "(put back)" when the last one tried was reverted; the tooltip says why.
function targetCell(target, name, none) {
  if (!target) return el("td", { className: name }, "-");
  const text = (target.version || none) + (target.pending ? " -> " + target.pending : "") + (target.reverted ? " (put back)" : "");
  return el("td", { className: name + (target.reverted ? " error" : target.pending ? " pending" : ""), title: target.reverted || "" }, text);
}

function deviceRow(row) {
  const models = Object.entries(row.models).map(([slot, model]) => slot + "=" + model).join(" ");
  const labels = Object.entries(row.labels).map(([k, v]) => k + "=" + v).join(" ");
  const job = row.job ? [row.job.slot, row.job.state, row.job.code].filter(Boolean).join(" ") : "";
  const link = el("a", { href: "/device/" + encodeURIComponent(row.id) }, row.id);
  const status = el("td", { className: "state" }, badge(row.state), " ", el("span", { className: "muted" }, age(row.since)));
  // A device not online shows the last figures it sent: greyed, and the tooltip says why.
  const figure = stale(row) ? { className: "num stale", title: "last figures heard before the device went " + row.state } : { className: "num" };
  return el("tr", { dataset: { device: row.id, state: row.state } },
    el("td", { className: "id" }, link), status,
    el("td", {}, row.agent),
    targetCell(row.config, "config", "base"),
    targetCell(row.release, "release", "-"),
    el("td", { className: "models" }, models || "-"),
    // How many cameras the device reads, and how many deliver no frames (its up/info's states).
    el("td", { className: "cameras num" + (row.cameras_down ? " error" : "") },
      row.cameras ? (row.cameras_down ? row.cameras_down + " of " + row.cameras + " down" : String(row.cameras)) : "-"),
    el("td", { ...figure, className: figure.className + " fps" }, num(row.fps)),
    el("td", figure, num(row.p99_ms)),
    el("td", figure, num(row.cpu, 0)),
    el("td", figure, num(row.temp_c, 0)),
    el("td", { className: "job" }, job || "-", row.problems ? el("span", { className: "error" }, " " + plural(row.problems, "malformed message")) : null),
    el("td", { className: "labels muted" }, labels));
}

function targetWords(target, none) {
  if (!target) return none;
  return [target.version || none, target.pending && "applying " + target.pending, target.reverted && "put back: " + target.reverted].filter(Boolean).join("; ");
}

// Whether a row's figures are old news: the device is offline, unknown, or online but silent.
function stale(row) {
  return row.state !== "online";
}

function devicesPage() {
  const params = new URLSearchParams(location.search);
  const form = el("form", { className: "filters", id: "filters" },
    el("label", {}, "Selector", el("input", { id: "filter-select", name: "select", placeholder: "site=berlin,platform.dla_cores>=1", value: params.get("select") || "" })),
    el("label", {}, "State", el("select", { id: "filter-state", name: "state" },
      ["", "online", "offline", "stale", "unknown"].map((s) => el("option", { value: s, selected: params.get("state") === s }, s || "any")))),
    el("label", {}, "Model", el("input", { id: "filter-model", name: "model", placeholder: "model, version or model:version", value: params.get("model") || "" })),
    el("button", { type: "submit", id: "filter-apply" }, "Filter"));
  const problem = el("p", { id: "filter-error", className: "error" });
  const count = el("p", { id: "device-count", className: "count" }, "…");
  const tbody = el("tbody");
  const table = el("table", { id: "devices" }, el("thead", {}, el("tr", {}, COLUMNS.map((c) => el("th", {}, c)))), tbody);
  $("#app").replaceChildren(el("h1", {}, "Devices"), form, problem, count, table);

  const rows = new Map();
  function place(id, tr) {
    const old = rows.get(id);
    rows.set(id, tr);
    if (old) { old.replaceWith(tr); return; }
    // Keep id order (the server's): insert before the first row with a larger id.
    for (const other of tbody.children) {
      if (other.dataset.device > id) { tbody.insertBefore(tr, other); return; }
    }
    tbody.append(tr);
  }
  function apply(frame) {
    if (frame.full) {
      rows.clear();
      const fragment = document.createDocumentFragment();
      for (const row of frame.upsert) { const tr = deviceRow(row); rows.set(row.id, tr); fragment.append(tr); }
      tbody.replaceChildren(fragment);
    } else {
      for (const row of frame.upsert) place(row.id, deviceRow(row));
      for (const id of frame.remove) { const tr = rows.get(id); if (tr) tr.remove(); rows.delete(id); }
    }
    count.textContent = rows.size + (rows.size === 1 ? " device" : " devices");
    table.dataset.rendered = "1";
  }
  async function start(event) {
    if (event) event.preventDefault();
    const query = new URLSearchParams();
    for (const name of ["select", "state", "model"]) {
      const value = form.elements[name].value.trim();
      if (value) query.set(name, value);
    }
    try {
      await getJSON("/api/devices?" + query.toString()); // checks the filter: a bad one says why
    } catch (error) {
      problem.textContent = safe(error.message, 500);
      return;
    }
    problem.textContent = "";
    history.replaceState(null, "", query.toString() ? "/?" + query.toString() : "/");
    query.set("want", "devices");
    listen(query, { devices: apply });
  }
  form.addEventListener("submit", start);
  start();
}

// -- one device ------------------------------------------------------------------------------------

function kv(entries) {
  return el("dl", { className: "kv" }, entries.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v === null || v === undefined || v === "" ? "-" : v)]));
}

function table(id, headers, rows) {
  return el("table", { id }, el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colSpan: headers.length, className: "muted" }, "none"))));
}

// A device's figure as a person reads it: 0.9096 -> "0.91", 0.97341 -> "0.973", 41.537 -> "41.54".
function round(v) {
  return typeof v === "number" ? String(+v.toFixed(Math.abs(v) < 1 ? 3 : 2)) : safe(v);
}

// Shadow figures in words: "120 frames, agreement 0.97, latency x1.4".
function shadowWords(s) {
  if (!s) return "-";
  return [plural(s.frames, "frame"),
    s.agreement !== null && s.agreement !== undefined && "agreement " + round(s.agreement),
    s.latency_ratio !== null && s.latency_ratio !== undefined && "latency x" + round(s.latency_ratio),
    s.top5_overlap !== null && s.top5_overlap !== undefined && "top-5 overlap " + round(s.top5_overlap),
    s.bad_outputs && plural(s.bad_outputs, "bad output")].filter(Boolean).join(", ");
}

// The figure that ended a probation: "p99_ratio 3.1 crossed its bar 2".
function failedWords(f) {
  return f ? f.figure + " " + round(f.value) + " crossed its bar " + round(f.bar) : "";
}

// Probation figures: how far it went, then baseline against current as a small table.
function probationBox(p) {
  if (!p) return "-";
  const names = [...new Set([...Object.keys(p.baseline || {}), ...Object.keys(p.current || {})])].sort();
  const rows = names.map((name) => el("tr", {}, el("td", {}, name),
    el("td", { className: "num" }, name in (p.baseline || {}) ? round(p.baseline[name]) : "-"),
    el("td", { className: "num" }, name in (p.current || {}) ? round(p.current[name]) : "-")));
  return el("div", { className: "probation" },
    el("div", {}, duration(p.elapsed_s) + " of " + duration(p.probation_s)),
    p.failed ? el("div", { className: "error failed-figure" }, failedWords(p.failed)) : null,
    names.length ? el("table", { className: "figures" },
      el("thead", {}, el("tr", {}, el("th", {}, "figure"), el("th", {}, "baseline"), el("th", {}, "current"))),
      el("tbody", {}, rows)) : null);
}

const charts = {};
//: The narrowest time axis, in seconds: one point or a few are drawn in the middle of a minute.
const MIN_SPAN_S = 60;

function timeRange(u, min, max) {
  // From the data, not min/max: for a single point uPlot passes max = min + 86400 / its time unit.
  const times = u && u.data && u.data[0] ? u.data[0].filter((t) => t !== null && isFinite(t)) : [];
  if (times.length) { min = Math.min(...times); max = Math.max(...times); }
  if (min === null || max === null || !isFinite(min) || !isFinite(max)) {
    const now = Date.now() / 1000;
    return [now - MIN_SPAN_S, now];
  }
  if (max - min >= MIN_SPAN_S) return [min, max];
  const middle = (min + max) / 2;
  return [middle - MIN_SPAN_S / 2, middle + MIN_SPAN_S / 2];
}

function chart(key, title, columns, series) {
  const box = el("div", { className: "chart card", id: "chart-" + key }, el("h2", {}, title));
  if (typeof uPlot === "undefined") { box.append(el("p", { className: "muted" }, "chart library not loaded")); return box; }
  const data = [columns.ts, ...series.map((s) => columns[s.field])];
  // Away from the cursor the legend shows the latest point (uPlot's own legend reads "--" there,
  // like an empty field); over the chart, the point under the cursor.
  const latest = (u, i) => { const column = u.data[i]; for (let j = column.length - 1; j >= 0; j--) if (column[j] !== null && column[j] !== undefined) return column[j]; return null; };
  const shownAt = (u, v, i, idx) => (idx === null || idx === undefined ? latest(u, i) : v);
  const time = (u, v, i, idx) => { const t = shownAt(u, v, i, idx); return t === null ? "no data yet" : new Date(t * 1000).toLocaleTimeString() + (idx === null || idx === undefined ? " (latest)" : ""); };
  const value = (u, v, i, idx) => { const x = shownAt(u, v, i, idx); return x === null ? "none yet" : num(x); };
  const options = {
    width: 560, height: 200,
    series: [{ label: "time", value: time }, ...series.map((s) => ({ label: s.label, stroke: s.color, width: 1.5, spanGaps: false, value }))],
    axes: [{}, { size: 50 }],
    // From 0: a steady 10 fps must read as flat, not as spikes across 9.99-10.01.
    // The time axis spans what was received: uPlot widens a single point into years of empty
    // axis, so a short history is centred in a minute instead.
    scales: { x: { time: true, range: timeRange }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] } },
  };
  charts[key] = new uPlot(options, data, box);
  return box;
}

async function devicePage(deviceId) {
  let detail;
  try {
    detail = await getJSON("/api/device/" + encodeURIComponent(deviceId));
  } catch (error) {
    $("#app").replaceChildren(el("h1", {}, deviceId), el("p", { className: "error" }, error.message));
    return;
  }
  const row = detail.row;
  const slots = Object.entries(detail.slots).map(([name, s]) => el("tr", {},
    el("td", {}, name), el("td", {}, s.model_id), el("td", {}, s.version),
    el("td", { className: "mono", title: s.sha256 || "" }, s.sha256 ? s.sha256.slice(0, 12) : "-"),
    el("td", {}, badge(s.state || "-")), el("td", { className: "runs" + (s.runs && s.runs.fallback ? " fallback" : "") }, runsWords(s.runs)), el("td", {}, s.last_job),
    el("td", {}, s.last_job_state), el("td", { className: "error" }, s.last_job_error_code || ""),
    el("td", {}, [s.reason || (s.last_failure ? "last failure: " + [s.last_failure.state, s.last_failure.error_code, s.last_failure.error].filter(Boolean).join(" ") : ""),
      s.release_revoked ? "revoked key: " + s.release_revoked : "",
      s.serving === "interim" ? "serving its ONNX model while its engine builds" : "",
      s.runs && s.runs.fallback ? "runs " + s.runs.precision + ", " + s.runs.requested + " asked: " + s.runs.fallback : "",
      s.building ? "building: " + s.building : ""].filter(Boolean).join("; "))));
  const jobs = detail.jobs.map((j) => el("tr", {},
    el("td", { className: "mono" }, j.job_id), el("td", {}, j.slot),
    el("td", {}, badge(j.state), j.build ? el("span", { className: "build-note muted" }, " " + j.build) : null), el("td", {}, when(j.at)),
    el("td", { className: "error" }, j.error_code || ""), el("td", {}, j.error || "")));
  const verdicts = detail.jobs.filter((j) => j.shadow || j.probation).map((j) => el("tr", {},
    el("td", { className: "mono" }, j.job_id), el("td", {}, j.state),
    el("td", { className: "shadow" }, shadowWords(j.shadow)), el("td", {}, probationBox(j.probation))));
  const temps = Object.entries(detail.temperatures).map(([zone, c]) => el("tr", {}, el("td", {}, zone), el("td", { className: "num" }, num(c))));
  const p = detail.platform;
  // An offline (or silent) device's figures are its last ones: greyed and marked, never shown as live.
  const old = stale(row) ? " (stale: last heard " + (detail.telemetry_at ? age(detail.telemetry_at) + " ago" : "never") + ")" : "";
  const figure = (text) => el("span", { className: old ? "stale" : "" }, text + (text === "-" ? "" : old));
  const cameras = detail.cameras.map((c) => el("tr", { className: "camera" + (c.state === "streaming" || c.state === "ended" ? "" : " down") },
    el("td", {}, c.stream), el("td", {}, badge(c.state), " for " + age(c.since)),
    el("td", { className: "num" }, figure(num(c.capture_fps))),
    el("td", { className: "num" }, figure(c.last_frame_age_s === null ? "-" : duration(c.last_frame_age_s) + " ago")),
    el("td", { className: "num" }, String(c.reconnects)),
    el("td", { className: "error" }, c.last_error ? c.last_error + " (" + age(c.last_error_at) + " ago)" : "")));
  const focus = keptFocus();
  $("#app").replaceChildren(...[
    el("h1", { id: "device-title" }, row.id, " ", badge(row.state)),
    el("div", { className: "grid" },
      el("div", { className: "card", id: "facts" }, kv([
        ["status", row.state + (row.since ? " for " + age(row.since) : "")], ["session", row.session], ["agent", row.agent],
        ["configuration", targetWords(row.config, "its own agent.yaml")], ["agent release", targetWords(row.release, "not reported")],
        ["telemetry", detail.telemetry_at ? age(detail.telemetry_at) + " ago" : "none heard"],
        ["fps", figure(num(row.fps))], ["p99 latency ms", figure(num(row.p99_ms))], ["CPU %", figure(num(row.cpu, 0))],
        ["certificate", certWords(detail.cert_not_after)],
        ["labels", Object.entries(row.labels).map(([k, v]) => k + "=" + v).join(" ")],
        ["platform", [p.device_model || p.machine, p.jetpack && "JetPack " + p.jetpack, p.tensorrt_version && "TensorRT " + p.tensorrt_version, p.dla_cores && p.dla_cores + " DLA"].filter(Boolean).join(", ")],
      ])),
      el("div", { className: "card" + (old ? " stale" : "") }, el("h2", {}, "Temperatures" + (old ? " (stale)" : "")), table("temperatures", ["zone", "°C"], temps))),
    el("h2", {}, "Slots"),
    table("slots", ["slot", "model", "version", "sha256", "state", "runs", "last job", "job state", "error code", "note"], slots),
    el("h2", {}, "Cameras"),
    table("cameras", ["stream", "state", "fps", "last frame", "reconnects", "last error"], cameras),
    el("div", { className: "grid" },
      chart("fps", "Frames per second (" + span(detail) + ")", detail.history, [{ field: "fps", label: "fps", color: "#2563eb" }]),
      chart("latency", "End-to-end latency, ms (" + span(detail) + ")", detail.history, [
        { field: "p50_ms", label: "p50", color: "#059669" }, { field: "p99_ms", label: "p99", color: "#dc2626" }])),
    el("h2", {}, "Last jobs"),
    table("jobs", ["job", "slot", "state", "at", "error code", "error"], jobs),
    el("h2", {}, "Shadow and probation figures"),
    table("verdicts", ["job", "state", "shadow", "probation"], verdicts),
    detail.problems.length ? el("div", {}, el("h2", {}, plural(detail.problems.length, "malformed message")), el("ul", { id: "problems" }, detail.problems.map((t) => el("li", {}, t)))) : null,
    el("p", { className: "actions" },
      el("button", { type: "button", id: "decommission", onclick: () => decommission(row.id) }, "Decommission…"),
      el("span", { className: "muted" }, " clears its retained status, info and desired states on the broker; the console forgets it")),
    snapshotPanel(row.id),
    el("div", { className: "card evidence", id: "evidence-panel" },
      el("button", { type: "button", id: "evidence", onclick: () => evidence(row.id) }, "Evidence"),
      evidenceField(deviceId, detail),
      el("span", { className: "muted" }, " the frames a rejected model disagreed on most: the serving model's output beside the candidate's"),
      el("div", { id: "evidence-frames" })),
  ].filter(Boolean));
  focus();
  // The page re-renders on every live update: frames already fetched stay shown.
  if (shownEvidence && shownEvidence.device === deviceId) showEvidence(shownEvidence.ev);
  document.body.dataset.device = "rendered";
}

// The charts' span: the last hour, or since the controller started when that is later (a restarted
// controller has no telemetry from before its start: the page says so rather than show a gap as calm).
function span(detail) {
  const since = detail.history_since;
  if (!since || Date.now() / 1000 - since >= 3590) return "last hour";
  return "since " + new Date(since * 1000).toLocaleTimeString() + ", the controller's start";
}

function deviceView(deviceId) {
  let busy = false;
  devicePage(deviceId);
  const query = new URLSearchParams({ want: "devices", device: deviceId });
  listen(query, {
    devices: async (frame) => {
      if (busy || (!frame.upsert.length && !frame.remove.length)) return;
      busy = true; // one fetch at a time; the stream sends at most a frame a second anyway
      try { await devicePage(deviceId); } finally { busy = false; }
    },
  });
}

// -- rollouts and actions --------------------------------------------------------------------------

function counts(map) {
  return Object.entries(map || {}).map(([k, v]) => k + " " + v).join(", ") || "-";
}

const FINISHED_END = /^(FAILED|REJECTED|ROLLED_BACK|TIMED_OUT)$/;

// A wave's gate figures in words: what went wrong against the limit, and a soak's time left.
function gateWords(w, policy) {
  const f = w.figures;
  const parts = [];
  if (f && typeof f.touched === "number") {
    const bad = f.failed + f.rolled_back + f.unhealthy;
    parts.push(el("div", { className: "gate-count" },
      bad + " of " + plural(f.touched, "device") + " touched went wrong (" + f.failed + " failed, " +
      f.rolled_back + " rolled back, " + f.unhealthy + " unhealthy); the gate allows " + f.limit));
    if (f.min_agreement_seen !== null && f.min_agreement_seen !== undefined) {
      parts.push(el("div", {}, "lowest shadow agreement " + round(f.min_agreement_seen)));
    }
  }
  if (w.soak_left_s !== null && w.soak_left_s !== undefined) {
    // Counted down here between frames, from the controller's figure (not the browser's clock).
    const left = el("span", { className: "soak-left", dataset: { end: String(Date.now() / 1000 + w.soak_left_s) } }, duration(w.soak_left_s));
    parts.push(el("div", { className: "soak" }, "soaking: ", left, " left" + (policy && policy.soak_s ? " of " + duration(policy.soak_s) : "")));
  }
  if (!parts.length) return w.state === "WAITING" ? "not started" : "not judged yet";
  return parts;
}

setInterval(() => {
  for (const span of document.querySelectorAll(".soak-left")) {
    span.textContent = duration(Number(span.dataset.end) - Date.now() / 1000);
  }
}, 1000);

// What an abort's rollback did, in the words `fleet rollout status` prints.
function rollbackWords(rb) {
  if (!rb) return null;
  let text = "rollback: " + plural(rb.by_desired_state, "device") + " sent their previous model, " +
    rb.by_command + " told to roll back";
  text += rb.ends ? " (" + counts(rb.ends) + ")" : " (still going)";
  if (rb.no_previous && rb.no_previous.length) text += "; " + rb.no_previous.length + " had no previous model";
  return el("p", { className: "rollback-outcome" }, text);
}

// The figure that failed a device: its probation's, or a shadow's agreement when that was the code.
function failedFigure(figures) {
  if (!figures) return "";
  if (figures.probation && figures.probation.failed) return failedWords(figures.probation.failed);
  if (figures.error_code === "shadow_disagrees" && figures.shadow && figures.shadow.agreement !== null) {
    return "shadow agreement " + round(figures.shadow.agreement);
  }
  return "";
}

// At most this many device rows per rollout on the page (those that went wrong first).
const DEVICE_ROWS_SHOWN = 500;
const rolloutDevices = new Map(); // rollout id -> {key, rows}: fetched when its list is open
const openLists = new Set(), rollbackTicked = new Set(), loading = new Set();

function deviceRowsTable(rows) {
  const bad = (d) => (d.end && FINISHED_END.test(d.end)) || (d.figures && d.figures.error_code) ? 0 : 1;
  const sorted = [...rows].sort((a, b) => bad(a) - bad(b));
  const shown = sorted.slice(0, DEVICE_ROWS_SHOWN).map((d) => el("tr", { dataset: { device: d.device } },
    el("td", { className: "id" }, el("a", { href: "/device/" + encodeURIComponent(d.device) }, d.device)),
    el("td", { className: "num" }, d.wave),
    el("td", { className: "device-state" }, badge(d.end && d.step === "ENDED" ? d.end : d.step)),
    el("td", { className: "error code" }, (d.figures && d.figures.error_code) || ""),
    el("td", { className: "failed-figure" }, failedFigure(d.figures)),
    el("td", { className: "evidence" }, evidenceLink(d))));
  const more = rows.length - DEVICE_ROWS_SHOWN;
  const note = more > 0 ? [el("p", { className: "muted" }, more + " more not shown")] : [];
  return [table("", ["device", "wave", "state", "error code", "figure that failed", "evidence"], shown), ...note];
}

// A device whose shadow rejected the rollout's model (or whose probation found it unhealthy) kept the
// frames it disagreed on: its page shows them.
const SHADOW_CODES = new Set(["shadow_disagrees", "too_slow", "bad_output", "unhealthy"]);
function evidenceLink(d) {
  const code = d.figures && d.figures.error_code;
  if (!SHADOW_CODES.has(code) || !d.job_id) return "";
  const href = "/device/" + encodeURIComponent(d.device) + "?evidence=" + encodeURIComponent(d.job_id);
  return el("a", { href, className: "evidence-link" }, "frames");
}

async function loadDevices(r, box) {
  const key = r.updated_at + " " + JSON.stringify(r.devices);
  const cached = rolloutDevices.get(r.rollout_id);
  if (cached) { box.replaceChildren(...deviceRowsTable(cached.rows)); box.dataset.rendered = "1"; }
  if (cached && cached.key === key) return;
  // One read per change: the toggle event of a list re-rendered open calls this a second time.
  const asking = r.rollout_id + " " + key;
  if (loading.has(asking)) return;
  loading.add(asking);
  try {
    const detail = await getJSON("/api/rollout/" + encodeURIComponent(r.rollout_id));
    rolloutDevices.set(r.rollout_id, { key, rows: detail.device_rows });
    // The list may have been re-rendered meanwhile: fill the one on the page now.
    const shown = document.querySelector('section[data-rollout="' + CSS.escape(r.rollout_id) + '"] .device-rows') || box;
    shown.replaceChildren(...deviceRowsTable(detail.device_rows));
    shown.dataset.rendered = "1";
  } catch (error) {
    box.replaceChildren(el("p", { className: "error" }, error.message));
  } finally {
    loading.delete(asking);
  }
}

// The devices building their engine now: phase, frames, elapsed and estimate, in the words of
// `fleet deploy` and `fleet rollout status` (the controller writes the note; the page adds nothing).
function buildingBox(r) {
  const building = r.building || [];
  if (!building.length) return null;
  const total = building.length + (r.building_left_off || 0);
  const rows = building.map((b) => el("tr", { dataset: { device: b.device } },
    el("td", { className: "id" }, el("a", { href: "/device/" + encodeURIComponent(b.device) }, b.device)),
    el("td", { className: "num" }, b.wave),
    el("td", { className: "build-note" }, b.note)));
  const more = r.building_left_off ? el("p", { className: "muted" }, r.building_left_off + " more building, not listed") : null;
  return el("div", { className: "building" },
    el("p", { className: "building-head" }, plural(total, "device") + " building the engine:"),
    table("", ["device", "wave", "build"], rows), more);
}

// What a slot really runs, in the words of `fleet status`: "fp32 built, int8 asked" for a fallback.
function runsWords(runs) {
  if (!runs) return "";
  if (runs.source === "interim") return "interim" + (runs.requested ? ", " + runs.requested + " builds" : "");
  if (runs.source === "model") return "as given";
  const text = (runs.precision || "?") + " " + runs.source;
  return runs.fallback && runs.requested ? text + ", " + runs.requested + " asked" : text;
}

// What the rollout's ACTIVE devices run against the precision it asked for, and each device that
// runs another, with why (as `fleet rollout status` prints it).
function precisionBox(r) {
  const p = r.precision;
  if (!p || !Object.keys(p.running).length) return null;
  const head = el("p", { className: "precision-head" + (p.fell_back_count ? " fallback" : "") },
    p.requested + " asked; running " + counts(p.running) + " (" + counts(p.sources) + ")" +
    (p.fell_back_count ? "; " + plural(p.fell_back_count, "device") + " fell back" : ""));
  const rows = p.fell_back.map((f) => el("tr", { dataset: { device: f.device } },
    el("td", { className: "id" }, el("a", { href: "/device/" + encodeURIComponent(f.device) }, f.device)),
    el("td", { className: "num" }, f.wave), el("td", {}, f.running || "?"), el("td", { className: "fallback-reason" }, f.reason)));
  return el("div", { className: "precision" }, head,
    rows.length ? table("", ["device", "wave", "runs", "why"], rows) : null);
}

// "09:16:23-09:26:30 (10m 7s)" for an ended wave, "since 09:26:30" for a running one, as
// `fleet rollout status` prints them (UTC, the controller's clock).
function waveTimes(w) {
  const clock = (ts) => new Date(ts * 1000).toISOString().slice(11, 19);
  if (w.started_at === null || w.started_at === undefined) return "-";
  if (w.ended_at === null || w.ended_at === undefined) return "since " + clock(w.started_at);
  return clock(w.started_at) + "-" + clock(w.ended_at) + " (" + duration(w.ended_at - w.started_at) + ")";
}

function rolloutCard(r) {
  const open = r.state === "RUNNING" || r.state === "PAUSED";
  const id = r.rollout_id;
  const rollback = el("input", { type: "checkbox", className: "rollback", disabled: !open, checked: open && rollbackTicked.has(id),
    onchange: () => { if (rollback.checked) rollbackTicked.add(id); else rollbackTicked.delete(id); } });
  const actions = el("span", { className: "actions" },
    el("button", { type: "button", className: "pause", disabled: r.state !== "RUNNING", onclick: () => act(id, "pause") }, "Pause"),
    el("button", { type: "button", className: "resume", disabled: r.state !== "PAUSED", onclick: () => act(id, "resume") }, "Resume"),
    el("label", { className: open ? "" : "muted", title: open ? "" : "the rollout has finished: nothing to roll back from here" }, rollback, " roll back"),
    el("button", { type: "button", className: "abort", disabled: !open, onclick: () => abort(r, rollback.checked) }, "Abort…"));
  const waves = r.waves.map((w) => el("tr", { dataset: { wave: String(w.index) } },
    el("td", { className: "num" }, w.wave), el("td", { className: "wave-state" }, badge(w.state)),
    el("td", { className: "num wave-devices" }, w.devices), el("td", { className: "wave-steps" }, counts(w.steps)),
    el("td", { className: "wave-ends" }, counts(w.ends)), el("td", { className: "wave-times" }, waveTimes(w)),
    el("td", { className: "wave-gate" }, gateWords(w, r.policy)), el("td", {}, w.reason)));
  const list = el("div", { className: "device-rows" }, el("p", { className: "muted" }, "…"));
  const devices = el("details", { className: "devices", open: openLists.has(id) },
    el("summary", {}, "Devices (" + r.devices.total + "): wave, state, error code, the figure that failed"), list);
  devices.addEventListener("toggle", () => {
    if (devices.open) { openLists.add(id); loadDevices(r, list); } else openLists.delete(id);
  });
  if (devices.open) loadDevices(r, list);
  return el("section", { className: "rollout", dataset: { rollout: id, state: r.state } },
    el("div", { className: "rollout-head" }, el("h2", {}, id), badge(r.state),
      el("span", { className: "muted" }, "slot " + r.slot + " → " + r.to_version + ", " + plural(r.devices.total, "device") + ", updated " + age(r.updated_at) + " ago"),
      actions),
    r.reason ? el("p", { className: "reason" }, r.reason) : null,
    rollbackWords(r.rollback),
    el("p", { className: "totals" }, "steps: " + counts(r.devices.steps) + "; ends: " + counts(r.devices.ends)),
    table("", ["wave", "state", "devices", "steps", "ends", "time (UTC)", "gate", "reason"], waves),
    buildingBox(r),
    precisionBox(r),
    devices);
}

function rolloutsPage() {
  const list = el("div", { id: "rollouts" }, el("p", { className: "muted" }, "…"));
  $("#app").replaceChildren(el("h1", {}, "Rollouts"), list);
  listen(new URLSearchParams({ want: "rollouts" }), {
    rollouts: (frame) => {
      list.replaceChildren(...(frame.rollouts.length ? frame.rollouts.map(rolloutCard) : [el("p", { className: "muted" }, "No rollouts yet.")]));
      list.dataset.rendered = "1";
    },
  });
}

function abort(r, rollback) {
  const devices = plural(r.devices.total, "device");
  const question = "Abort rollout " + r.rollout_id + "? Its waves not started yet are cancelled" +
    (rollback ? ", and its " + devices + " are moved back to their previous model." : "; devices already on " + r.to_version + " stay on it.");
  if (!confirm(question)) { say("abort " + r.rollout_id + ": not done (cancelled)", ""); return; }
  act(r.rollout_id, "abort", rollback);
}

function askToken() {
  return new Promise((resolve) => {
    const box = $("#token-box"), input = $("#token-input");
    box.hidden = false;
    input.value = "";
    input.focus();
    box.onsubmit = (event) => { event.preventDefault(); box.hidden = true; sessionStorage.setItem(TOKEN_KEY, input.value); resolve(input.value); };
    $("#token-cancel").onclick = () => { box.hidden = true; resolve(null); };
  });
}

// Why an action was refused, in words for whoever sits at the browser (the API's text is for scripts).
function refusalWords(status, error) {
  if (status === 401) {
    return "this token is not the console's: paste the content of the controller's http.token_file " +
      "(the wrong one was forgotten; the next click asks again)";
  }
  if (status === 403) {
    return "this console is read-only: the controller has no console token " +
      "(set http.token_file in its controller.yaml to allow actions)";
  }
  return error;
}

// POST an action with the tab's token (asked for once); says what came of it.
async function post(what, url, done = (message) => what + ": " + message) {
  let token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) token = await askToken();
  if (!token) {
    say("no token given: paste the console token (the content of the controller's http.token_file) to " + what, "error");
    return;
  }
  const response = await fetch(url, { method: "POST", headers: { authorization: "Bearer " + token } });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (response.ok) { say(done(body.message), "ok"); return; }
  if (response.status === 401) sessionStorage.removeItem(TOKEN_KEY); // a wrong token: ask again next time
  say(what + " refused (" + response.status + "): " + refusalWords(response.status, body.error), "error");
}

async function act(rolloutId, verb, rollback = false) {
  const url = "/api/rollouts/" + encodeURIComponent(rolloutId) + "/" + verb + (rollback ? "?rollback=1" : "");
  await post(verb + (rollback ? " and roll back " : " ") + rolloutId, url);
}

async function decommission(deviceId) {
  if (!confirm("Decommission " + deviceId + "? Its retained status, info and desired states are cleared on the broker, and the console forgets it. Stop its agent first.")) return;
  await post("decommission " + deviceId, "/api/devices/" + encodeURIComponent(deviceId) + "/decommission", (message) => message);
}

// The snapshot button: the device encodes its latest frame (bounded by its snapshot.* settings) and
// sends the result of that very frame; boxes (source-frame pixels, scaled here) and labels are drawn
// on a canvas over the JPEG. Device text is drawn with fillText: pixels, never markup.
async function snapshot(deviceId) {
  let token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) token = await askToken();
  if (!token) { say("snapshot: cancelled (no token given)", "error"); return; }
  const stream = $("#snapshot-stream").value.trim();
  const url = "/api/devices/" + encodeURIComponent(deviceId) + "/snapshot" + (stream ? "?stream=" + encodeURIComponent(stream) : "");
  const button = $("#snapshot");
  button.disabled = true;
  try {
    const response = await fetch(url, { method: "POST", headers: { authorization: "Bearer " + token } });
    const body = await response.json().catch(() => ({ error: response.statusText }));
    if (!response.ok) {
      if (response.status === 401) sessionStorage.removeItem(TOKEN_KEY);
      say("snapshot of " + deviceId + " refused (" + response.status + "): " + body.error, "error");
      return;
    }
    await drawSnapshot(body.snapshot);
  } finally {
    button.disabled = false;
  }
}

// A re-render replaces the field the operator types in: this puts the focus and caret back in the
// field of the same id afterwards (call before the re-render, run what it returns after it).
function keptFocus() {
  const active = document.activeElement;
  if (!active || !active.id || active.tagName !== "INPUT") return () => {};
  const { id, selectionStart, selectionEnd } = active;
  return () => {
    const again = document.getElementById(id);
    if (!again || again === document.activeElement) return;
    again.focus();
    again.setSelectionRange(selectionStart, selectionEnd);
  };
}

// The snapshot panel of this device's page: the one already on it is moved into each re-render as
// it is (its drawn canvas, caption and stream field), since the page re-renders on every telemetry.
function snapshotPanel(deviceId) {
  const kept = $("#snapshot-panel");
  if (kept && kept.dataset.device === deviceId) return kept;
  const panel = el("div", { className: "card snapshot", id: "snapshot-panel" },
    el("button", { type: "button", id: "snapshot", onclick: () => snapshot(deviceId) }, "Snapshot"),
    el("input", { id: "snapshot-stream", placeholder: "stream (default: its first)", maxLength: 128 }),
    el("span", { className: "muted", id: "snapshot-caption" }, " the latest frame of a stream, with that frame's result drawn on it"),
    el("canvas", { id: "snapshot-canvas", hidden: true }));
  panel.dataset.device = deviceId;
  return panel;
}

let shownEvidence = null; // {device, ev}: the evidence last shown, kept across re-renders

// What the evidence field starts with: the job shown, the one a rollout page linked to
// (?evidence=JOB), else the device's latest REJECTED or ROLLED_BACK job.
// The evidence job field. What the operator typed on this device's page stays through the
// re-render of each live update; untouched, it follows evidenceJob.
function evidenceField(deviceId, detail) {
  const old = $("#evidence-job");
  const typed = old && old.dataset.device === deviceId && old.dataset.typed === "yes";
  return el("input", {
    id: "evidence-job", placeholder: "rejected job id", maxLength: 128,
    value: typed ? old.value : evidenceJob(deviceId, detail),
    dataset: { device: deviceId, typed: typed ? "yes" : "" },
    oninput: (event) => { event.target.dataset.typed = "yes"; },
  });
}

function evidenceJob(deviceId, detail) {
  if (shownEvidence && shownEvidence.device === deviceId) return shownEvidence.ev.job_id;
  const linked = new URLSearchParams(location.search).get("evidence");
  if (linked) return linked;
  const job = (detail.jobs || []).find((j) => j.state === "REJECTED" || j.state === "ROLLED_BACK");
  return job ? job.job_id : "";
}

// The evidence button: the controller fetches the job's kept frames from the device (one reply
// each) and answers them with both models' outputs; shown side by side, device text as text nodes.
async function evidence(deviceId) {
  let token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) token = await askToken();
  if (!token) { say("evidence: cancelled (no token given)", "error"); return; }
  const job = $("#evidence-job").value.trim();
  if (!job) { say("evidence: name the rejected job", "error"); return; }
  const url = "/api/devices/" + encodeURIComponent(deviceId) + "/evidence/" + encodeURIComponent(job);
  const button = $("#evidence");
  button.disabled = true;
  try {
    const response = await fetch(url, { method: "POST", headers: { authorization: "Bearer " + token } });
    const body = await response.json().catch(() => ({ error: response.statusText }));
    if (!response.ok) {
      if (response.status === 401) sessionStorage.removeItem(TOKEN_KEY);
      say("evidence of " + job + " refused (" + response.status + "): " + body.error, "error");
      return;
    }
    shownEvidence = { device: deviceId, ev: body.evidence };
    showEvidence(body.evidence);
  } finally {
    button.disabled = false;
  }
}

function outputText(output) {
  const items = output.classes || output.detections || [];
  if (!items.length) return output.tensors ? "raw tensors" : "nothing";
  return items.slice(0, 3).map((c) => safe(c.label, 40) + " " + Number(c.score).toFixed(2)).join(", ");
}

function showEvidence(ev) {
  const rows = ev.frames.map((f) => el("tr", { className: "evidence-frame" },
    el("td", {}, el("img", { src: "data:image/jpeg;base64," + f.jpeg_base64, alt: "frame " + f.frame, width: f.width, height: f.height })),
    el("td", { className: "serving" }, outputText(f.serving)),
    el("td", { className: "candidate" }, outputText(f.candidate)),
    el("td", {}, String(f.agreement) + (f.note ? " (" + safe(f.note, 80) + ")" : ""))));
  const box = $("#evidence-frames");
  box.replaceChildren(
    el("p", {}, safe(ev.reason, 40) + ": " + safe(ev.serving_model, 80) + " (serving) against " + safe(ev.candidate_model, 80) + " (candidate), slot " + safe(ev.slot, 64)),
    el("table", { id: "evidence-table" },
      el("thead", {}, el("tr", {}, ["frame", "serving model", "candidate", "agreement"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows)));
  document.body.dataset.evidence = "shown";
}

function drawSnapshot(snap) {
  return new Promise((resolve) => {
    const image = new Image();
    image.onload = () => {
      const canvas = $("#snapshot-canvas");
      canvas.width = image.width;
      canvas.height = image.height;
      const g = canvas.getContext("2d");
      g.drawImage(image, 0, 0);
      const result = snap.result || {};
      const sx = image.width / (snap.source_width || image.width), sy = image.height / (snap.source_height || image.height);
      g.lineWidth = 2;
      g.font = "12px sans-serif";
      g.textBaseline = "top";
      const labels = [];
      for (const d of (result.detections || []).slice(0, 100)) {
        const [x1, y1, x2, y2] = d.box;
        g.strokeStyle = "#22c55e";
        g.strokeRect(x1 * sx, y1 * sy, (x2 - x1) * sx, (y2 - y1) * sy);
        label(g, safe(d.label, 40) + " " + num(d.score, 2), x1 * sx, Math.max(0, y1 * sy - 15));
        labels.push(safe(d.label, 40));
      }
      (result.classes || []).slice(0, 5).forEach((c, i) => {
        label(g, safe(c.label, 40) + " " + num(c.score, 2), 4, 4 + i * 16);
        labels.push(safe(c.label, 40));
      });
      canvas.hidden = false;
      canvas.dataset.frame = String(snap.frame_index);
      canvas.dataset.labels = labels.join("|");
      $("#snapshot-caption").textContent = " " + safe(snap.stream, 64) + " frame " + snap.frame_index + ", " + snap.width + "x" + snap.height + ", " + snap.bytes + " bytes";
      document.body.dataset.snapshot = "drawn";
      resolve();
    };
    image.onerror = () => { say("snapshot: the JPEG does not decode", "error"); resolve(); };
    image.src = "data:image/jpeg;base64," + snap.jpeg_base64;
  });
}

function label(g, text, x, y) {
  const width = g.measureText(text).width + 6;
  g.fillStyle = "rgba(17, 24, 39, 0.75)";
  g.fillRect(x, y, width, 15);
  g.fillStyle = "#fff";
  g.fillText(text, x + 3, y + 1);
}

// -- engines ---------------------------------------------------------------------------------------

// 18984550 -> "18.1 MiB", as `fleet engines list` writes sizes.
function size(n) {
  if (n < 1024) return n + " B";
  let value = n;
  for (const unit of ["KiB", "MiB", "GiB"]) {
    value /= 1024;
    if (value < 1024 || unit === "GiB") return value.toFixed(1) + " " + unit;
  }
  return value.toFixed(1) + " GiB";
}

// Engines change when a device offers or drops one (minutes apart): read again at this interval.
const ENGINES_REFRESH_MS = 5000;

// A key's model, version and precision, as its builder said ("-" where it did not).
function modelCells(row) {
  return [el("td", { className: "model" }, row.model_id || "-"), el("td", { className: "version" }, row.version || "-"),
    el("td", { className: "precision" }, row.precision || "-")];
}

function engineRow(e) {
  return el("tr", { dataset: { key: e.key } },
    el("td", { className: "mono key", title: e.key }, e.key.slice(0, 12)),
    ...modelCells(e),
    el("td", { className: "num size" }, size(e.bytes)),
    el("td", { className: "built-by" }, el("a", { href: "/device/" + encodeURIComponent(e.built_by) }, e.built_by)),
    el("td", { className: "built-at" }, utc(e.built_at)),
    el("td", { className: "num build-seconds" }, e.build_seconds === null || e.build_seconds === undefined ? "-" : duration(e.build_seconds)),
    el("td", { className: "num reuse" }, e.reuse),
    el("td", { className: "last-used muted" }, age(e.last_used) + " ago"));
}

function enginesView(listing) {
  const sharing = listing.sharing ? "sharing on" : listing.signed ? "sharing off" : "sharing off (no signing key)";
  const parts = [el("p", { className: "totals" },
    plural(listing.engines, "engine") + " (" + size(listing.bytes) + "), " + sharing +
    "; reused counts downloads by devices other than the builder")];
  const fingerprints = Object.entries(listing.fingerprints || {}).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  for (const [fingerprint, rows] of fingerprints) {
    parts.push(el("section", { className: "fingerprint", dataset: { fingerprint } },
      el("h2", {}, fingerprint),
      table("", ["key", "model", "version", "precision", "size", "built by", "built at (UTC)", "build", "reused", "last used"], rows.map(engineRow))));
  }
  if (!fingerprints.length) parts.push(el("p", { className: "muted" }, "No engines yet: a device offers its engine once its job ran to ACTIVE through shadow and probation."));
  const claims = listing.claims || [];
  if (claims.length) {
    // One build per key: the device building it now, and how many devices wait for its engine.
    const rows = claims.map((c) => el("tr", { className: "claim", dataset: { key: c.key } },
      el("td", { className: "mono key", title: c.key }, c.key.slice(0, 12)), ...modelCells(c), el("td", {}, c.fingerprint),
      el("td", {}, c.device), el("td", {}, new Date(c.since * 1000).toISOString().slice(0, 19).replace("T", " ")),
      el("td", {}, Math.round(c.heard_s) + " s ago"), el("td", {}, String(c.waiting))));
    parts.push(el("section", { id: "claims" },
      el("h2", {}, "Being built now (" + claims.length + "): one device builds, the others wait and download"),
      table("", ["key", "model", "version", "precision", "fingerprint", "builder", "since (UTC)", "last heard", "waiting"], rows)));
  }
  const withdrawn = listing.withdrawn || [];
  if (withdrawn.length) {
    const rows = withdrawn.map((w) => el("tr", { className: "withdrawn", dataset: { key: w.key } },
      el("td", { className: "mono key", title: w.key }, w.key.slice(0, 12)), el("td", {}, badge("withdrawn")),
      el("td", { className: "mono", title: w.engine_sha256 }, w.engine_sha256.slice(0, 12)),
      el("td", {}, w.built_by || "-"), el("td", {}, w.fingerprint || "-"),
      el("td", {}, w.at ? new Date(w.at * 1000).toISOString().slice(0, 19).replace("T", " ") : "-"),
      el("td", { className: "reason" }, w.reason || "-")));
    const more = listing.withdrawn_total - withdrawn.length;
    parts.push(el("section", { id: "withdrawn" },
      el("h2", {}, "Withdrawn (" + listing.withdrawn_total + "): a device found them bad; never served or taken again"),
      table("", ["key", "state", "engine sha256", "built by", "fingerprint", "withdrawn (UTC)", "why"], rows), more > 0 ? el("p", { className: "muted" }, more + " more not shown") : null));
  }
  return parts;
}

// A page read again every ENGINES_REFRESH_MS: its box shows render(answer of url), or the error.
// Returns the loader (an action calls it to show its outcome at once).
function refreshingPage(id, title, url, render) {
  const box = el("div", { id }, el("p", { className: "muted" }, "…"));
  $("#app").replaceChildren(el("h1", {}, title), box);
  const live = $("#live");
  async function load() {
    try {
      box.replaceChildren(...render(await getJSON(url)));
      box.dataset.rendered = "1";
      live.textContent = "updated " + new Date().toLocaleTimeString();
      live.className = "live on";
    } catch (error) {
      box.replaceChildren(el("p", { className: "error" }, error.message));
      live.className = "live off";
    }
  }
  load();
  setInterval(load, ENGINES_REFRESH_MS);
  return load;
}

function enginesPage() {
  refreshingPage("engines", "Engines", "/api/engines", enginesView);
}

// -- enrollment ------------------------------------------------------------------------------------

// Days until a certificate expires, as `fleet status` says it ("12 days", "5 h", "expired").
function certWords(notAfter) {
  if (notAfter === null || notAfter === undefined) return "none reported";
  const days = (notAfter - Date.now() / 1000) / 86400;
  if (days <= 0) return "expired";
  return days >= 2 ? "expires in " + Math.floor(days) + " days" : "expires in " + Math.round(days * 24) + " h";
}

async function decide(deviceId, verb, reenroll = false) {
  const url = "/api/enrollment/" + encodeURIComponent(deviceId) + "/" + verb + (reenroll ? "?reenroll=1" : "");
  await post(verb + " " + deviceId, url, (message) => message);
  enrollmentLoad();
}

function pendingRow(p) {
  const accept = p.reenroll ? "Accept (re-enroll)" : "Accept";
  return el("tr", { className: "pending", dataset: { device: p.device_id } },
    el("td", { className: "device" }, p.device_id), el("td", {}, p.claim), el("td", {}, p.serial || "-"),
    el("td", { className: "mono", title: p.fingerprint }, p.fingerprint.slice(0, 16)),
    el("td", { className: "num" }, String(p.asks)), el("td", {}, age(p.first_at) + " ago"),
    el("td", {}, [p.reenroll ? "enrolled with another key" : "", p.contested ? p.contested + " request(s) with another key" : ""].filter(Boolean).join("; ")),
    el("td", { className: "actions" },
      el("button", { type: "button", className: "accept", onclick: () => decide(p.device_id, "accept", p.reenroll) }, accept),
      el("button", { type: "button", className: "reject", onclick: () => decide(p.device_id, "reject") }, "Reject")));
}

function enrolledRow(e) {
  return el("tr", { className: "enrolled", dataset: { device: e.device_id } },
    el("td", {}, el("a", { href: "/device/" + encodeURIComponent(e.device_id) }, e.device_id)),
    el("td", { className: "mono" }, e.serial), el("td", { className: "expiry" }, certWords(e.not_after)),
    el("td", {}, e.claim || "-"), el("td", {}, e.hw_serial || "-"));
}

let enrollmentLoad = () => {};

function enrollmentView(listing) {
  return [
    el("h2", {}, "Waiting for an operator (" + listing.pending.length + " of at most " + listing.max_pending + ")"),
    listing.pending.length ? table("pending", ["device", "claim", "serial", "key", "asks", "waiting", "note", ""], listing.pending.map(pendingRow))
      : el("p", { className: "muted", id: "no-pending" }, "No device waits."),
    el("h2", {}, "Enrolled (" + listing.enrolled.length + ")"),
    table("enrolled", ["device", "certificate serial", "expiry", "claim", "hardware serial"], listing.enrolled.map(enrolledRow)),
  ];
}

function enrollmentPage() {
  enrollmentLoad = refreshingPage("enrollment", "Enrollment", "/api/enrollment", enrollmentView);
}

// -- routing ---------------------------------------------------------------------------------------

function route() {
  const path = location.pathname;
  $("#nav-devices").classList.toggle("current", path === "/" || path.startsWith("/device/"));
  $("#nav-rollouts").classList.toggle("current", path === "/rollouts");
  $("#nav-engines").classList.toggle("current", path === "/engines");
  $("#nav-enrollment").classList.toggle("current", path === "/enrollment");
  if (path === "/rollouts") rolloutsPage();
  else if (path === "/engines") enginesPage();
  else if (path === "/enrollment") enrollmentPage();
  else if (path.startsWith("/device/")) deviceView(decodeURIComponent(path.slice("/device/".length)));
  else devicesPage();
}

route();

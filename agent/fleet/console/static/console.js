// The fleet console's page script: three views (devices, one device, rollouts) over the JSON API,
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

function when(ts) {
  return ts ? new Date(ts * 1000).toLocaleString() : "-";
}

function badge(text) {
  // The class is one of our known words only, never device text as a class name.
  const known = /^(online|offline|unknown|stale|ACTIVE|DONE|RUNNING|PAUSED|SOAKING|FAILED|REJECTED|ROLLED_BACK|TRIPPED|ABORTED|WAITING|CANCELLED|SUPERSEDED)$/;
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

const COLUMNS = ["Device", "State", "Agent", "Models", "FPS", "p99 ms", "CPU %", "Temp °C", "Last job", "Labels"];

function deviceRow(row) {
  const models = Object.entries(row.models).map(([slot, model]) => slot + "=" + model).join(" ");
  const labels = Object.entries(row.labels).map(([k, v]) => k + "=" + v).join(" ");
  const job = row.job ? [row.job.slot, row.job.state, row.job.code].filter(Boolean).join(" ") : "";
  const link = el("a", { href: "/device/" + encodeURIComponent(row.id) }, row.id);
  const status = el("td", { className: "state" }, badge(row.state), " ", el("span", { className: "muted" }, age(row.since)));
  return el("tr", { dataset: { device: row.id, state: row.state } },
    el("td", { className: "id" }, link), status,
    el("td", {}, row.agent),
    el("td", { className: "models" }, models || "-"),
    el("td", { className: "num fps" }, num(row.fps)),
    el("td", { className: "num" }, num(row.p99_ms)),
    el("td", { className: "num" }, num(row.cpu, 0)),
    el("td", { className: "num" }, num(row.temp_c, 0)),
    el("td", { className: "job" }, job || "-", row.problems ? el("span", { className: "error" }, " " + row.problems + " malformed") : null),
    el("td", { className: "labels muted" }, labels));
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

function figures(value) {
  if (!value) return "";
  return Object.entries(value).filter(([, v]) => v !== null).map(([k, v]) => k === "soak_until" && typeof v === "number" ? soakLeft(v) : k + "=" + (typeof v === "object" && v !== null ? JSON.stringify(v) : (typeof v === "number" ? +v.toFixed(4) : v))).join("  ");
}

// A soaking wave's end (a Unix time) as time left and a clock, not a raw number (issue 22.8).
function soakLeft(until) {
  const left = Math.round(until - Date.now() / 1000);
  const clock = new Date(until * 1000).toISOString().slice(11, 19) + " UTC";
  if (left <= 0) return "soak over at " + clock;
  const m = Math.floor(left / 60), s = left % 60;
  return "soak: " + (m ? m + " min " + String(s).padStart(2, "0") + " s" : s + " s") + " left (until " + clock + ")";
}

const charts = {};

function chart(key, title, columns, series) {
  const box = el("div", { className: "chart card", id: "chart-" + key }, el("h2", {}, title));
  if (typeof uPlot === "undefined") { box.append(el("p", { className: "muted" }, "chart library not loaded")); return box; }
  const data = [columns.ts, ...series.map((s) => columns[s.field])];
  const options = {
    width: 560, height: 200,
    series: [{}, ...series.map((s) => ({ label: s.label, stroke: s.color, width: 1.5, spanGaps: false }))],
    axes: [{}, { size: 50 }],
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
    el("td", {}, badge(s.state || "-")), el("td", {}, s.last_job),
    el("td", {}, s.last_job_state), el("td", { className: "error" }, s.last_job_error_code || ""),
    el("td", {}, s.reason || (s.last_failure ? "last failure: " + [s.last_failure.state, s.last_failure.error_code, s.last_failure.error].filter(Boolean).join(" ") : ""))));
  const jobs = detail.jobs.map((j) => el("tr", {},
    el("td", { className: "mono" }, j.job_id), el("td", {}, j.slot), el("td", {}, badge(j.state)), el("td", {}, when(j.at)),
    el("td", { className: "error" }, j.error_code || ""), el("td", {}, j.error || "")));
  const verdicts = detail.jobs.filter((j) => j.shadow || j.probation).map((j) => el("tr", {},
    el("td", { className: "mono" }, j.job_id), el("td", {}, j.state),
    el("td", { className: "mono" }, figures(j.shadow)), el("td", { className: "mono" }, figures(j.probation))));
  const temps = Object.entries(detail.temperatures).map(([zone, c]) => el("tr", {}, el("td", {}, zone), el("td", { className: "num" }, num(c))));
  const p = detail.platform;
  $("#app").replaceChildren(...[
    el("h1", { id: "device-title" }, row.id, " ", badge(row.state)),
    el("div", { className: "grid" },
      el("div", { className: "card", id: "facts" }, kv([
        ["status", row.state + (row.since ? " for " + age(row.since) : "")], ["session", row.session], ["agent", row.agent],
        ["telemetry", detail.telemetry_at ? age(detail.telemetry_at) + " ago" : "none heard"],
        ["fps", num(row.fps)], ["p99 latency ms", num(row.p99_ms)], ["CPU %", num(row.cpu, 0)],
        ["labels", Object.entries(row.labels).map(([k, v]) => k + "=" + v).join(" ")],
        ["platform", [p.device_model || p.machine, p.jetpack && "JetPack " + p.jetpack, p.tensorrt_version && "TensorRT " + p.tensorrt_version, p.dla_cores && p.dla_cores + " DLA"].filter(Boolean).join(", ")],
      ])),
      el("div", { className: "card" }, el("h2", {}, "Temperatures"), table("temperatures", ["zone", "°C"], temps))),
    el("h2", {}, "Slots"),
    table("slots", ["slot", "model", "version", "sha256", "state", "last job", "job state", "error code", "note"], slots),
    el("div", { className: "grid" },
      chart("fps", "Frames per second (last hour)", detail.history, [{ field: "fps", label: "fps", color: "#2563eb" }]),
      chart("latency", "End-to-end latency, ms (last hour)", detail.history, [
        { field: "p50_ms", label: "p50", color: "#059669" }, { field: "p99_ms", label: "p99", color: "#dc2626" }])),
    el("h2", {}, "Last jobs"),
    table("jobs", ["job", "slot", "state", "at", "error code", "error"], jobs),
    el("h2", {}, "Shadow and probation figures"),
    table("verdicts", ["job", "state", "shadow", "probation"], verdicts),
    detail.problems.length ? el("div", {}, el("h2", {}, "Malformed messages"), el("ul", { id: "problems" }, detail.problems.map((t) => el("li", {}, t)))) : null,
  ].filter(Boolean));
  document.body.dataset.device = "rendered";
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

function rolloutCard(r) {
  const open = r.state === "RUNNING" || r.state === "PAUSED";
  const rollback = el("input", { type: "checkbox", className: "rollback" });
  const actions = el("span", { className: "actions" },
    el("button", { type: "button", className: "pause", disabled: r.state !== "RUNNING", onclick: () => act(r.rollout_id, "pause") }, "Pause"),
    el("button", { type: "button", className: "resume", disabled: r.state !== "PAUSED", onclick: () => act(r.rollout_id, "resume") }, "Resume"),
    el("label", {}, rollback, " roll back"),
    el("button", { type: "button", className: "abort", disabled: !open, onclick: () => act(r.rollout_id, "abort", rollback.checked) }, "Abort"));
  const waves = r.waves.map((w) => el("tr", { dataset: { wave: String(w.index) } },
    el("td", { className: "num" }, w.index + 1), el("td", { className: "wave-state" }, badge(w.state)),
    el("td", { className: "num wave-devices" }, w.devices), el("td", { className: "wave-steps" }, counts(w.steps)),
    el("td", { className: "wave-ends" }, counts(w.ends)), el("td", { className: "mono" }, figures(w.figures)), el("td", {}, w.reason)));
  return el("section", { className: "rollout", dataset: { rollout: r.rollout_id, state: r.state } },
    el("div", { className: "rollout-head" }, el("h2", {}, r.rollout_id), badge(r.state),
      el("span", { className: "muted" }, "slot " + r.slot + " → " + r.to_version + ", " + r.devices.total + " devices, updated " + age(r.updated_at) + " ago"),
      actions),
    r.reason ? el("p", { className: "reason" }, r.reason) : null,
    el("p", { className: "totals" }, "steps: " + counts(r.devices.steps) + "; ends: " + counts(r.devices.ends)),
    table("", ["wave", "state", "devices", "steps", "ends", "gate figures", "reason"], waves));
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

async function act(rolloutId, verb, rollback = false) {
  let token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) token = await askToken();
  if (!token) { say(verb + ": cancelled (no token given)", "error"); return; }
  const url = "/api/rollouts/" + encodeURIComponent(rolloutId) + "/" + verb + (rollback ? "?rollback=1" : "");
  const response = await fetch(url, { method: "POST", headers: { authorization: "Bearer " + token } });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (response.ok) { say(verb + " " + rolloutId + ": " + body.message, "ok"); return; }
  if (response.status === 401) sessionStorage.removeItem(TOKEN_KEY); // a wrong token: ask again next time
  say(verb + " " + rolloutId + " refused (" + response.status + "): " + body.error, "error");
}

// -- routing ---------------------------------------------------------------------------------------

function route() {
  const path = location.pathname;
  $("#nav-devices").classList.toggle("current", path === "/" || path.startsWith("/device/"));
  $("#nav-rollouts").classList.toggle("current", path === "/rollouts");
  if (path === "/rollouts") rolloutsPage();
  else if (path.startsWith("/device/")) deviceView(decodeURIComponent(path.slice("/device/".length)));
  else devicesPage();
}

route();

// One engine's page: live charts of the last five minutes, its metrics, and its controls.
import { Derivation, historyRows, TimeChart } from "./charts.js";
import * as fmt from "./format.js";
import { connect } from "./live.js";
import { LiveTable, renderKV, requestUrlOf } from "./live_requests.js";

const page = document.querySelector(".engine-page");
const NOW_WINDOW = Number(page.dataset.nowWindow); // seconds the "now" figures are over

// ---------------------------------------------------------------------------- charts

// Each chart: its series ([label, colour, field of Derivation.next's result]) and its axis kind.
const CHARTS = {
  rates: { kind: "rate", series: [["prefill tok/s", "#417690", "prefill"], ["decode tok/s", "#d46a00", "decode"]] },
  requests: { kind: "count", series: [["running", "#417690", "running"], ["waiting", "#ba2121", "waiting"]] },
  batch: { kind: "count", series: [["mean", "#417690", "batch"], ["max", "#79aec8", "batchMax"]] },
  kv: { kind: "percent", series: [["KV cache", "#417690", "kv"], ["prefix hit rate", "#79aec8", "hitRate"]] },
  ttft: { kind: "ms", series: [["p50", "#417690", "ttft50"], ["p99", "#79aec8", "ttft99"]] },
  itl: { kind: "ms", series: [["p50", "#d46a00", "itl50"], ["p99", "#f0a35e", "itl99"]] },
  outcomes: { kind: "rate", series: [["finished/s", "#417690", "finished"], ["aborted/s", "#d46a00", "aborted"],
                                     ["failed/s", "#ba2121", "failed"]] },
  preemptions: { kind: "rate", series: [["preemptions/s", "#ba2121", "preemptions"],
                                        ["KV evictions/s", "#79aec8", "evictions"]] },
};
const charts = {};
for (const [name, spec] of Object.entries(CHARTS)) {
  charts[name] = new TimeChart(page.querySelector(`[data-chart="${name}"]`), spec);
}
let derivation = new Derivation(NOW_WINDOW);
window.enginePage = { charts }; // for a reader in the console, and the browser tests

/** One sample into every chart (a gap in each while the engine gave no numbers). */
function plotSample(at, metrics, draw = true) {
  const d = derivation.next(at, metrics);
  for (const [name, spec] of Object.entries(CHARTS)) {
    charts[name].push(at, spec.series.map(([, , key]) => (d.empty ? null : d[key])), draw);
  }
  // How many samples the charts hold (for a reader of the page, and its tests).
  document.getElementById("charts").dataset.samples = String(charts.rates.data[0].length);
}

/** The last five minutes the server sampled: the charts start full when the page opens. */
function onHistory(history) {
  derivation = new Derivation(NOW_WINDOW);
  Object.values(charts).forEach((chart) => chart.clear());
  for (const row of historyRows(history)) plotSample(row.at, row.metrics, false);
  Object.values(charts).forEach((chart) => chart.draw());
}

// --------------------------------------------------------------------------- metrics

const GROUPS = [
  ["Gauges (as of the read)", ["num_running_requests", "num_waiting_requests", "kv_pages_used", "kv_pages_total", "kv_cache_usage",
           "prefix_cache_hit_rate"]],
  ["Counters", ["num_finished_requests", "num_aborted_requests", "num_failed_requests", "num_prefill_steps",
                "num_decode_steps", "num_preemptions",
                "prefill_tokens_processed", "decode_tokens_processed", "jump_forward_tokens_processed"]],
  ["MLC sums (move when a request finishes)", ["prompt_tokens_sum", "completion_tokens_sum", "prefill_tokens_sum",
           "decode_tokens_sum", "jump_forward_tokens_sum", "engine_prefill_time_sum", "engine_decode_time_sum",
           "engine_jump_forward_time_sum", "prefill_tokens_per_s", "decode_tokens_per_s"]],
];
const DISTRIBUTIONS = ["ttft_s", "inter_token_latency_s", "end_to_end_latency_s", "queue_time_s", "token_gap_s"];

function row(label, value, header = false) {
  const tr = document.createElement("tr");
  const th = document.createElement("th");
  th.scope = header ? "colgroup" : "row";
  th.textContent = label;
  tr.append(th);
  if (header) {
    th.colSpan = 2;
    tr.className = "group";
  } else {
    const td = document.createElement("td");
    td.textContent = value;
    tr.append(td);
  }
  return tr;
}

// MLC's rates are averages over the time the engine spent in those steps since its last reset, not
// the live rate the charts and the overview show: said beside them.
const EXPLAINED = {
  prefill_tokens_per_s: "prefill_tokens_per_s (prefill tokens ÷ prefill step time, since reset)",
  decode_tokens_per_s: "decode_tokens_per_s (decode tokens ÷ decode step time, since reset)",
};

// The engine's "now" figures (`metrics.now`, over its steps of the last few seconds): what the
// charts draw, and the same numbers the overview and the fleet page show.
function nowRows(now) {
  const batch = now.decode_batch_size == null ? "–"
    : `${now.decode_batch_size.toFixed(1)} / ${fmt.count(now.decode_batch_size_max)}`;
  return [
    ["prefill-rate", "prefill tok/s", fmt.rate(now.prefill_tokens_per_s)],
    ["decode-rate", "decode tok/s", fmt.rate(now.decode_tokens_per_s)],
    ["decode-batch", "decode batch size (mean / max)", batch],
    ["busy", "time in steps", fmt.percent(now.busy)],
    ["steps", "steps", fmt.count(now.steps)],
  ].map(([name, label, value]) => {
    const tr = row(`${label}, ${fmt.lastSeconds(now.window_s)}`, value);
    tr.dataset.figure = name;
    return tr;
  });
}

function renderMetrics(m) {
  const body = document.querySelector("#metrics tbody");
  const rows = [];
  if (m.now) rows.push(row(`Now (over the engine steps of the ${fmt.lastSeconds(m.now.window_s)})`, null, true),
                       ...nowRows(m.now));
  for (const [title, keys] of GROUPS) {
    rows.push(row(title, null, true));
    for (const key of keys) if (key in m) rows.push(row(EXPLAINED[key] || key, fmt.metric(key, m[key])));
  }
  const window = (d, name) => (d[name] && d[name].count
    ? `${fmt.seconds(d[name].p50)} / ${fmt.seconds(d[name].p99)}, ${fmt.count(d[name].count)}` : "none");
  rows.push(row("Latency (p50 / p99, count): last minute; last 5 minutes; last 4,096 (p50 / p90 / p99)", null, true));
  for (const key of DISTRIBUTIONS) {
    const d = m[key];
    if (d) rows.push(row(key, `${window(d, "last_60s")}; ${window(d, "last_300s")}; ` +
                              `${fmt.seconds(d.p50)} / ${fmt.seconds(d.p90)} / ${fmt.seconds(d.p99)}`));
  }
  const last = m.last_finished_request || {};
  rows.push(row("Last finished request", null, true));
  for (const [key, value] of Object.entries(last)) rows.push(row(key, fmt.metric(key, value)));
  const byBatch = m.decode_time_by_batch_size || {};
  if (Object.keys(byBatch).length) {
    rows.push(row("Decode step time by batch size", null, true));
    for (const [key, value] of Object.entries(byBatch)) rows.push(row(key, fmt.metric(key, value)));
  }
  body.replaceChildren(...rows);
}

// -------------------------------------------------------------------- recent requests

const historyUrl = document.getElementById("recent-module").dataset.history;
const requestUrl = requestUrlOf(page.dataset.requestUrl);

/** A request's diagnosis in a cell: its first sentence, the others counted (all in the tooltip). */
function diagnosisText(sentences) {
  if (!sentences || !sentences.length) return "—";
  return sentences.length > 1 ? `${sentences[0]} (+${sentences.length - 1})` : sentences[0];
}

/** A table body of one row per item (`cells(item)`: texts, never HTML), or one row saying it is empty. */
function fillTable(body, items, cells, emptyText, decorate = null) {
  if (!items.length) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = document.createElement("td");
    td.colSpan = body.closest("table").querySelectorAll("thead th").length;
    td.textContent = emptyText;
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...items.map((item) => {
    const tr = document.createElement("tr");
    for (const value of cells(item)) {
      const td = document.createElement("td");
      td.textContent = value;  // ids and reasons come from clients: text, never HTML
      tr.append(td);
    }
    // The request id on one line, cut short with an ellipsis; whole in its tooltip; its page's link.
    const id = document.createElement("a");
    id.className = "request-id";
    id.title = id.textContent = tr.firstChild.textContent;
    id.href = requestUrl(item.request_id);
    tr.firstChild.replaceChildren(id);
    if (item.disagg) {  // one half of a disaggregated request: the other has the same id on its engine
      const tag = document.createElement("span");
      tag.className = "disagg-tag";
      tag.textContent = item.disagg;
      tag.title = "Disaggregated serving: the other half ran on another engine under the same request id";
      tr.firstChild.append(tag);
    }
    if (decorate) decorate(item, tr);
    return tr;
  }));
}

function renderRecent(recent) {
  fillTable(document.querySelector("#recent tbody"), recent,
    (r) => [r.request_id, fmt.count(r.prompt_tokens), fmt.count(r.completion_tokens), fmt.seconds(r.queue_s),
      fmt.seconds(r.ttft_s), fmt.rate(r.decode_tokens_per_s), fmt.seconds(r.end_to_end_s), r.finish_reason,
      diagnosisText(r.diagnosis)],
    "No request has ended since the engine started or was reset.",
    (r, tr) => {
      const why = tr.lastChild;
      why.className = "diagnosis-cell";
      why.title = (r.diagnosis || []).join("\n");
      const link = document.createElement("a");
      link.href = `${historyUrl}?q=${encodeURIComponent(r.request_id)}`;
      link.textContent = "history";
      const td = document.createElement("td");
      td.append(link);
      tr.append(td);
    });
}

const liveTable = new LiveTable(document.getElementById("live"), (requestId) => act("abort_request", { request_id: requestId }),
  requestUrl);
window.enginePage.liveTable = liveTable;

// ---------------------------------------------------------------------------- state

/** The watchdog's open incident: what it saw, since when, and its page (once kept). */
let stallShown = null; // the banner's incident as JSON: redrawn only when it changes (text stays selectable)

function showStall(stall) {
  const banner = document.getElementById("stall-banner");
  banner.hidden = !stall;
  const key = stall ? JSON.stringify(stall) : null;
  if (!stall || key === stallShown) {
    stallShown = key;
    return;
  }
  stallShown = key;
  banner.replaceChildren(`Stalled since ${fmt.timeOfDay(stall.since)}: ${stall.detail}. `);
  const link = document.createElement("a");
  link.href = stall.url || `${page.dataset.incidentsUrl}?engine=${encodeURIComponent(page.dataset.engine)}`;
  link.textContent = stall.url ? "Its incident and evidence" : "The incidents";
  banner.append(link);
}

function showState(snap) {
  const el = document.querySelector('h1 [data-field="state"]');
  el.textContent = fmt.state(snap);
  el.dataset.state = fmt.stateKind(snap);
  const reason = document.getElementById("engine-reason");
  const healthy = snap.state === "running" && !snap.slow && !snap.draining;
  reason.hidden = healthy;
  if (healthy) reason.textContent = "";
  else if (snap.draining) reason.textContent = "The server is shutting down: it refuses new requests (503) while those in flight finish.";
  else if (snap.state === "running") reason.textContent = "The engine runs but did not answer the last read in 2 s (a long step or compilation holds it); its numbers are back as soon as it answers.";
  else reason.textContent = `The engine is ${fmt.state(snap)}; its requests answer 503 meanwhile.`;
  controls.engineDown = snap.state === "running" ? null : `the engine is ${fmt.state(snap)}`;
  applyControls();
}

// Which controls can be used: none while the engine is not running (with the reason on them), the
// trace's only while it records one, the profiler's start or stop as it runs or not.
const controls = { engineDown: null, profiling: false, tracing: page.dataset.tracing === "true" };

function applyControls() {
  const down = controls.engineDown;
  const set = (id, off, why) => {
    const button = document.getElementById(id);
    button.disabled = Boolean(down) || off;
    button.title = down ? `Unavailable: ${down}.` : (off ? why : "");
  };
  set("reset", false, "");
  set("save-trace-button", !controls.tracing, "Tracing is off for this engine.");
  set("clear-trace", !controls.tracing, "Tracing is off for this engine.");
  set("profile-start", controls.profiling, "A profile is running.");
  set("profile-stop", !controls.profiling, "No profile is running.");
  const note = document.getElementById("controls-reason");
  note.hidden = !down;
  note.textContent = down ? `The controls wait: ${down}.` : "";
}

// The built-in profiler's state: live from the snapshots, and at once from an action's answer.
function showProfile(profile) {
  if (!profile) return;
  const steps = profile.max_steps ? `${profile.steps} of ${profile.max_steps} steps` : `${profile.steps} steps`;
  const state = document.getElementById("profile-state");
  state.textContent = profile.armed ? `armed: starts at ${profile.trigger}`
    : profile.running ? `profiling: ${steps}${profile.trigger ? ` (started by ${profile.trigger})` : ""}` : "not profiling";
  // An armed profile holds the profiler as a running one does: Stop disarms it.
  controls.profiling = profile.running || Boolean(profile.armed);
  applyControls();
  const last = document.getElementById("profile-last");
  if (profile.last_url) {
    last.href = profile.last_url;
    last.textContent = `last profile (#${profile.last_id})`;
    last.hidden = false;
  }
}

function onSnapshot(snap) {
  showState(snap);
  showProfile(snap.profile);
  showStall(snap.stall);  // a stalled engine's reads go unanswered: before the metrics' return
  const m = snap.metrics;
  document.getElementById("metrics-module").classList.toggle("stale", !m);
  plotSample(snap.at, m);
  if (!m) return;
  renderMetrics(m);
  if (snap.recent_requests) renderRecent(snap.recent_requests);
  if (snap.live_requests) liveTable.render(snap.live_requests, snap.live_total ?? snap.live_requests.length);
  renderKV(snap.kv_cache);
}

// -------------------------------------------------------------------------- controls

let nextId = 1;
const pending = new Map(); // action id -> its log entry

function log(text, level = "info", link = null) {
  const li = document.createElement("li");
  li.className = level;
  li.textContent = text;
  if (link) {
    const a = document.createElement("a");
    a.href = link;
    a.textContent = " open the record";
    li.append(a);
  }
  const list = document.getElementById("action-log");
  list.prepend(li);
  while (list.children.length > 5) list.lastChild.remove();
  return li;
}

function act(action, fields = {}) {
  const id = nextId++;
  if (!socket.send({ action, id, ...fields })) {
    log(`${action}: not connected; try again when the page says "live"`, "error");
    return;
  }
  pending.set(id, log(`${action}: sent…`));
}

function onActionEvent(event) {
  if (event.earlier) { // asked on an earlier page, which closed before it ended
    const what = `${event.action} (asked on an earlier page)`;
    const text = event.type === "done" ? (event.result?.message || "done") : event.message;
    log(`${what}: ${text}`, event.type === "done" ? "success" : "error", event.result?.url || null);
    return;
  }
  const entry = pending.get(event.id);
  if (!entry) {
    if (event.type === "error") log(event.message, "error");
    return;
  }
  const what = event.action || "action";
  if (event.type === "ack") entry.textContent = `${what}: under way…`;
  if (event.type === "progress") entry.textContent = `${what}: ${event.message}`;
  if (event.type === "done" || event.type === "error") {
    pending.delete(event.id);
    entry.className = event.type === "done" ? "success" : "error";
    entry.textContent = `${what}: ${event.type === "done" ? (event.result?.message || "done") : event.message}`;
    if (event.result?.url) {
      const a = document.createElement("a");
      a.href = event.result.url;
      a.textContent = " — open the record";
      entry.append(a);
    }
    if (event.type === "done" && "profiling" in (event.result || {})) {
      showProfile({ running: event.result.profiling, steps: 0, last_url: event.result.url, last_id: event.result.record_id });
    }
  }
}

const socket = connect(page.dataset.ws, (message) => {
  if (message.type === "snapshot") onSnapshot(message);
  else if (message.type === "history") onHistory(message);
  else onActionEvent(message);
});

document.getElementById("reset").addEventListener("click", () => {
  if (confirm(`Reset engine ${page.dataset.engine}? Every running request is aborted and the metrics go to zero.`)) {
    act("reset");
  }
});
document.getElementById("save-trace").addEventListener("submit", (event) => {
  event.preventDefault();
  const tags = document.getElementById("trace-tags").value.split(",").map((t) => t.trim()).filter(Boolean);
  act("save_trace", { note: document.getElementById("trace-note").value, tags });
});
document.getElementById("clear-trace").addEventListener("click", () => act("clear_trace"));
document.getElementById("save-workload").addEventListener("click", () => act("save_workload"));
document.getElementById("profile-start").addEventListener("click", () => {
  const maxSteps = parseInt(document.getElementById("profile-max-steps").value, 10);
  act("profile_start", {
    stack_sampling: document.getElementById("profile-stacks").checked,
    ...(Number.isInteger(maxSteps) && maxSteps > 0 ? { max_steps: maxSteps } : {}),
  });
});
document.getElementById("profile-stop").addEventListener("click", () => act("profile_stop"));

// One engine's page: live charts of the last five minutes, its metrics, and its controls.
import * as fmt from "./format.js";
import { connect, Rate } from "./live.js";

const page = document.querySelector(".engine-page");
const WINDOW_SECONDS = 300;

// ---------------------------------------------------------------------------- charts

const CHARTS = {
  rates: [["prefill tok/s", "#417690"], ["decode tok/s", "#d46a00"]],
  requests: [["running", "#417690"], ["waiting", "#ba2121"]],
  kv: [["KV cache %", "#417690"]],
  latency: [["TTFT p50", "#417690"], ["TTFT p99", "#79aec8"], ["ITL p50", "#d46a00"], ["ITL p99", "#f0a35e"]],
  preemptions: [["preemptions", "#ba2121"]],
};
const series = {}; // chart name -> [xs, ys...]
const plots = {};
for (const name of Object.keys(CHARTS)) series[name] = [[], ...CHARTS[name].map(() => [])];

function plotFor(name) {
  if (plots[name] || !window.uPlot) return plots[name];
  const box = page.querySelector(`[data-chart="${name}"]`);
  plots[name] = new uPlot({
    width: Math.max(280, box.clientWidth - 8), height: 170,
    // The x axis always spans the window, however few points have come yet.
    scales: { x: { time: true, range: (u, min, max) => {
                const end = Number.isFinite(max) ? max : Date.now() / 1000;
                return [end - WINDOW_SECONDS, end];
              } },
              y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
    series: [{}, ...CHARTS[name].map(([label, stroke]) => ({ label, stroke, width: 1.5, points: { show: false } }))],
    axes: [{}, { size: 52 }],
  }, series[name], box);
  return plots[name];
}

function push(name, at, values) {
  const data = series[name];
  data[0].push(at);
  values.forEach((v, i) => data[i + 1].push(v));
  while (data[0].length && data[0][0] < at - WINDOW_SECONDS) data.forEach((column) => column.shift());
  const plot = plotFor(name);
  if (plot) plot.setData(data);
}

// --------------------------------------------------------------------------- metrics

const GROUPS = [
  ["Now", ["num_running_requests", "num_waiting_requests", "kv_pages_used", "kv_pages_total", "kv_cache_usage",
           "prefix_cache_hit_rate"]],
  ["Counters", ["num_finished_requests", "num_prefill_steps", "num_decode_steps", "num_preemptions",
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

function renderMetrics(m) {
  const body = document.querySelector("#metrics tbody");
  const rows = [];
  for (const [title, keys] of GROUPS) {
    rows.push(row(title, null, true));
    for (const key of keys) if (key in m) rows.push(row(key, fmt.metric(key, m[key])));
  }
  rows.push(row("Latency (p50 / p90 / p99, count)", null, true));
  for (const key of DISTRIBUTIONS) {
    const d = m[key];
    if (d) rows.push(row(key, `${fmt.seconds(d.p50)} / ${fmt.seconds(d.p90)} / ${fmt.seconds(d.p99)}, ${fmt.count(d.count)}`));
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

function renderRecent(recent) {
  const body = document.querySelector("#recent tbody");
  if (!recent.length) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = document.createElement("td");
    td.colSpan = 9;
    td.textContent = "No request has ended since the engine started or was reset.";
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...recent.map((r) => {
    const tr = document.createElement("tr");
    const cells = [r.request_id, fmt.count(r.prompt_tokens), fmt.count(r.completion_tokens), fmt.seconds(r.queue_s),
      fmt.seconds(r.ttft_s), fmt.rate(r.decode_tokens_per_s), fmt.seconds(r.end_to_end_s), r.finish_reason];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = value;  // ids and reasons come from clients: text, never HTML
      tr.append(td);
    }
    if (r.disagg) {  // one half of a disaggregated request: the other has the same id on its engine
      const tag = document.createElement("span");
      tag.className = "disagg-tag";
      tag.textContent = r.disagg;
      tag.title = "Disaggregated serving: the other half ran on another engine under the same request id";
      tr.firstChild.append(tag);
    }
    const link = document.createElement("a");
    link.href = `${historyUrl}?q=${encodeURIComponent(r.request_id)}`;
    link.textContent = "history";
    const td = document.createElement("td");
    td.append(link);
    tr.append(td);
    return tr;
  }));
}

// ---------------------------------------------------------------------------- state

const prefillRate = new Rate();
const decodeRate = new Rate();

function showState(snap) {
  const el = document.querySelector('h1 [data-field="state"]');
  el.textContent = fmt.state(snap);
  el.dataset.state = fmt.stateKind(snap);
  const reason = document.getElementById("engine-reason");
  const healthy = snap.state === "running" && !snap.slow;
  reason.hidden = healthy;
  if (healthy) reason.textContent = "";
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
  document.getElementById("profile-state").textContent = profile.running ? `profiling: ${steps}` : "not profiling";
  controls.profiling = profile.running;
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
  const m = snap.metrics;
  document.getElementById("metrics-module").classList.toggle("stale", !m);
  if (!m) return;
  const at = snap.at;
  const prefill = prefillRate.update(m.prefill_tokens_processed, at);
  const decode = decodeRate.update(m.decode_tokens_processed, at);
  if (prefill != null && decode != null) push("rates", at, [prefill, decode]);
  push("requests", at, [m.num_running_requests, m.num_waiting_requests]);
  push("kv", at, [m.kv_cache_usage * 100]);
  push("latency", at, [m.ttft_s.p50, m.ttft_s.p99, m.inter_token_latency_s.p50, m.inter_token_latency_s.p99]
    .map((s) => s * 1000));
  push("preemptions", at, [m.num_preemptions]);
  renderMetrics(m);
  if (snap.recent_requests) renderRecent(snap.recent_requests);
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
document.getElementById("profile-start").addEventListener("click", () => {
  const maxSteps = parseInt(document.getElementById("profile-max-steps").value, 10);
  act("profile_start", {
    stack_sampling: document.getElementById("profile-stacks").checked,
    ...(Number.isInteger(maxSteps) && maxSteps > 0 ? { max_steps: maxSteps } : {}),
  });
});
document.getElementById("profile-stop").addEventListener("click", () => act("profile_stop"));

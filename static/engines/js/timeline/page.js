// The timeline page: a saved trace record or a live engine, with search, filters, the lane
// panel, range statistics, downloads and "Open in Perfetto". User text only ever goes through
// textContent (request ids, names and args are not HTML).

import { connect } from "../live.js";
import { count, rate } from "../format.js";
import { TraceModel, laneSummary } from "./model.js";
import { TimelineView, colourOf, formatUs } from "./view.js";

const source = JSON.parse(document.getElementById("timeline-source").textContent);
// A profile's spans (steps, phases, kernels): no request lanes, so no request search or filters.
const profile = source.kind === "profile";
const $ = (id) => document.getElementById(id);
const model = new TraceModel();
const stats = { mode: source.mode }; // timings, read by the browser tests and the benchmark
window.timeline = { model, stats };

let summaries = null; // saved: request id -> the record's RequestSummary row
let changeUrl = null;
let following = source.mode === "live";
let paused = false;
// Live: the lanes that ended before the window are hidden until asked for (a run of hours has
// thousands; the running requests would be hundreds of lanes down). See shownLanes().
let showFinished = false;
let finishedLanes = new Set(); // the lanes that had ended before the window when it last moved by itself
let hiddenLanes = 0;
let clockOffset = null; // live: server µs minus performance.now() µs
const held = []; // live deltas that arrived while paused

const view = new TimelineView($("timeline"), model, {
  onHover: showTooltip,
  onLane: showLane,
  onRange: showRange,
  onViewChange(reason) {
    if (reason === "user" && following) setFollowing(false);
    updateStatus();
  },
});
window.timeline.view = view;

if (source.mode === "live") {
  view.now = () => (clockOffset === null || paused ? model.last : performance.now() * 1000 + clockOffset);
}

function setText(id, text) {
  const el = $(id);
  if (el) el.textContent = text;
}

function updateStatus() {
  const requests = model.lanes.filter((lane) => lane.kind === "request").length;
  // A profile's trace has no request lanes: say how many lanes it has instead.
  const lanes = profile ? `${count(model.lanes.length)} lanes` : `${count(requests)} request lanes`;
  const parts = [`${count(model.events)} events`, lanes];
  if (view.lanes.length !== model.lanes.length) parts.push(`${count(view.lanes.length - 1)} shown`);
  if (hiddenLanes) parts.push(`${count(hiddenLanes)} finished lane${hiddenLanes === 1 ? "" : "s"} hidden`);
  if (source.mode === "live") {
    parts.push(paused ? "paused" : following ? "following the engine" : "not following (press Follow)");
    if (stats.missed) parts.push(`${count(stats.missed)} events missed (evicted or cleared before they were read)`);
  }
  setText("timeline-status", parts.join(" · "));
}

// ----------------------------------------------------------------------------- legend

let legendSize = 0;
function updateLegend() {
  if (model.names.length === legendSize) return;
  const legend = $("timeline-legend");
  for (let id = legendSize; id < model.names.length; id++) {
    const item = document.createElement("li");
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.style.background = colourOf(model.names[id]);
    item.append(chip, document.createTextNode(model.names[id]));
    legend.append(item);
  }
  legendSize = model.names.length;
}

// ----------------------------------------------------------------------------- tooltip

// What "(n)" after a span's name means, said in every tooltip that shows one.
const COUNTER_NOTE = "the nth span of that name on this lane, e.g. prefill (2): the request's second prefill chunk";

function tooltipLines(found) {
  const { row, index, lane } = found;
  if (!found.kind) { // a lane's label, cut short in the gutter: its whole id
    const lines = [[lane.label, ""], ["lane", lane.kind === "engine" ? "the engine's steps" : "a request's events"]];
    if (lane.kind === "request") lines.push(["", "click to see its summary"]);
    return lines;
  }
  const start = row.start.data[index];
  const counter = found.kind === "span" ? row.counter.data[index] : 0;
  const name = found.kind === "span" ? model.spanName(row.name.data[index], counter) : model.names[row.name.data[index]];
  const lines = [[name, ""], ["lane", lane.label], ["start", `+${formatUs(start - model.first)}`]];
  if (found.kind === "span") {
    const open = row.end.data[index] === Infinity;
    lines.push(["duration", `${formatUs(found.end - start)}${open ? " (still open)" : ""}`]);
    if (name !== model.names[row.name.data[index]]) lines.push(["(n)", COUNTER_NOTE]);
  }
  const args = model.argsOf(row.arg.data[index]);
  for (const [key, value] of Object.entries(args)) {
    lines.push([key, typeof value === "string" ? value : JSON.stringify(value)]);
  }
  return lines;
}

function showTooltip(found, clientX, clientY) {
  const tip = $("timeline-tooltip");
  if (!found || !found.lane) {
    tip.hidden = true;
    return;
  }
  const lines = tooltipLines(found);
  tip.replaceChildren(...lines.map(([key, value], i) => {
    const line = document.createElement("div");
    if (i === 0) {
      line.className = "tip-title";
      line.textContent = key;
    } else {
      if (key) {
        const k = document.createElement("span");
        k.className = "tip-key";
        k.textContent = `${key}: `;
        line.append(k);
      }
      line.append(document.createTextNode(value.length > 300 ? `${value.slice(0, 300)}…` : value));
    }
    return line;
  }));
  tip.hidden = false;
  const x = Math.min(clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = Math.min(clientY + 14, window.innerHeight - tip.offsetHeight - 8);
  tip.style.left = `${x + window.scrollX}px`;
  tip.style.top = `${y + window.scrollY}px`;
}

// ----------------------------------------------------------------------------- lane panel

const SUMMARY_FIELDS = [
  ["prompt_tokens", "prompt tokens", (v) => count(v)],
  ["completion_tokens", "completion tokens", (v) => count(v)],
  ["queue_us", "queue time", (v) => formatUs(v)],
  ["ttft_us", "TTFT", (v) => formatUs(v)],
  ["prefill_us", "prefill time", (v) => formatUs(v)],
  ["decode_us", "decode time", (v) => formatUs(v)],
  ["decode_tokens_per_s", "decode tokens/s", (v) => rate(v)],
  ["e2e_us", "end to end", (v) => formatUs(v)],
  ["finish_reason", "finish reason", (v) => v || "–"],
  ["preemptions", "preemptions", (v) => count(v)],
];

function summaryOf(lane) {
  const own = laneSummary(lane, model.names);
  const saved = summaries && summaries.get(lane.label);
  return saved ? { ...own, ...saved } : own;
}

function showLane(lane) {
  const panel = $("lane-panel");
  if (!lane || lane.kind !== "request") {
    panel.hidden = true;
    return;
  }
  const summary = summaryOf(lane);
  setText("lane-title", lane.label);
  const rows = SUMMARY_FIELDS.map(([key, label, format]) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = label;
    const td = document.createElement("td");
    td.dataset.field = key;
    td.textContent = summary[key] == null ? "–" : format(summary[key]);
    tr.append(th, td);
    return tr;
  });
  $("lane-table").replaceChildren(...rows);
  const link = $("lane-history");
  if (summaries && summaries.has(lane.label) && changeUrl) {
    link.href = changeUrl.replace("/ID/", `/${summaries.get(lane.label).id}/`);
    link.textContent = "Its saved summary: where its time went";
    link.hidden = false;
  } else if (source.request_url) {  // live: the engine's page of the request
    link.href = source.request_url.replace("REQUEST_ID", encodeURIComponent(lane.label));
    link.textContent = "Its request page: where its time went";
    link.hidden = false;
  } else {
    link.hidden = true;
  }
  panel.hidden = false;
}

// ----------------------------------------------------------------------------- range statistics

function showRange(range) {
  const panel = $("range-panel");
  if (!range) {
    panel.hidden = true;
    return;
  }
  setText("range-title", `${formatUs(range[1] - range[0])} from +${formatUs(range[0] - model.first)}`);
  const rows = view.rangeStats(range[0], range[1]).map((entry) => {
    const tr = document.createElement("tr");
    for (const [text, cls] of [[entry.lane, ""], [entry.name, ""], [count(entry.count), "num"],
      [formatUs(entry.total), "num"], [`${((entry.total / (range[1] - range[0])) * 100).toFixed(1)} %`, "num"]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.append(td);
    }
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.style.background = colourOf(entry.name);
    tr.children[1].prepend(chip);
    return tr;
  });
  $("range-table").replaceChildren(...rows);
  panel.hidden = false;
}

// ----------------------------------------------------------------------------- search and filters

let matches = [];
let matchAt = -1;

function find(step) {
  const text = $("timeline-search").value.trim().toLowerCase();
  if (!text) {
    view.highlight = null;
    setText("search-result", "");
    view.invalidate();
    return;
  }
  matches = filteredLanes().filter((lane) => lane.kind === "request" && lane.label.toLowerCase().includes(text));
  if (!matches.length) {
    view.highlight = null;
    setText("search-result", "no request matches");
    view.invalidate();
    return;
  }
  matchAt = (matchAt + step + matches.length) % matches.length;
  const lane = matches[matchAt];
  view.highlight = lane;
  setFollowing(false);
  if (!view.lanes.includes(lane)) setShowFinished(true); // a finished lane, hidden: show them all
  view.reveal(lane);
  view.selectedLane = lane;
  showLane(lane);
  setText("search-result", `${matchAt + 1} of ${matches.length}`);
}

/** The lanes the finish-reason and end-to-end filters let through (every lane without them). */
function filteredLanes() {
  const reason = profile ? "" : $("filter-reason").value;
  const minMs = profile ? NaN : parseFloat($("filter-e2e").value);
  const minUs = Number.isFinite(minMs) && minMs > 0 ? minMs * 1000 : null;
  if (!reason && minUs === null) return model.lanes;
  return model.lanes.filter((lane) => {
    if (lane.kind !== "request") return true;
    const s = summaryOf(lane);
    if (reason && s.finish_reason !== reason) return false;
    if (minUs !== null && !(s.e2e_us >= minUs)) return false;
    return true;
  });
}

/**
 * The lanes to draw, in order. A saved trace: those the filters let through. Live: the same, less
 * the requests that had ended before the window when it last moved by itself (following the
 * present, or Fit): after an hour of serving the running requests and those of the last seconds
 * are at the top, not hundreds of lanes down under the first minute's. The hidden lanes are
 * counted and, once asked for (Show), drawn after the others. While the user zooms or pans, the
 * hidden set stays as it was, so that no lane moves under the pointer; new lanes come at the end.
 */
function shownLanes({ recompute }) {
  const lanes = filteredLanes();
  if (source.mode !== "live") return { lanes, hidden: 0 };
  if (recompute) {
    finishedLanes = new Set(lanes.filter((lane) => lane.kind === "request" && lane.finishTs !== null
      && !lane.openStack.length && lane.last < view.t0));
  }
  const inWindow = lanes.filter((lane) => !finishedLanes.has(lane));
  const hidden = lanes.length - inWindow.length;
  if (!showFinished || !hidden) return { lanes: inWindow, hidden };
  return { lanes: inWindow.concat(lanes.filter((lane) => finishedLanes.has(lane))), hidden: 0 };
}

function sameLanes(a, b) {
  return a.length === b.length && a.every((lane, i) => lane === b[i]);
}

/** Draw shownLanes(), when they changed (a new order re-lays every lane); `recompute`: which lanes
 * ended before the window, anew (the window moved by itself: following, or Fit). */
function updateLanes({ recompute = following } = {}) {
  const { lanes, hidden } = shownLanes({ recompute });
  if (!sameLanes(lanes, view.lanes)) view.setLanes(lanes);
  hiddenLanes = hidden;
  const button = $("show-finished");
  if (button) {
    button.hidden = !hidden && !showFinished;
    button.textContent = showFinished ? "Hide finished lanes" : `Show ${count(hidden)} finished lane${hidden === 1 ? "" : "s"}`;
  }
}

function setShowFinished(on) {
  showFinished = on;
  updateLanes();
  updateStatus();
}

function applyFilters() {
  updateLanes();
  matchAt = -1;
  updateStatus();
}

function updateReasons() {
  const select = $("filter-reason");
  if (!select) return;
  const known = new Set([...select.options].map((o) => o.value));
  const reasons = new Set();
  if (summaries) for (const s of summaries.values()) if (s.finish_reason) reasons.add(s.finish_reason);
  for (const lane of model.lanes) if (lane.finishArgs && lane.finishArgs.finish_reason) reasons.add(String(lane.finishArgs.finish_reason));
  for (const reason of [...reasons].sort()) {
    if (known.has(reason)) continue;
    const option = document.createElement("option");
    option.value = reason;
    option.textContent = reason;
    select.append(option);
  }
}

if (!profile) {
  $("timeline-search").addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      event.preventDefault();
      find(event.shiftKey ? -1 : 1);
    }
  });
  $("timeline-search").addEventListener("input", () => { matchAt = -1; });
  $("search-next").addEventListener("click", () => find(1));
  $("filter-reason").addEventListener("change", applyFilters);
  $("filter-e2e").addEventListener("change", applyFilters);
}
$("fit").addEventListener("click", () => {
  setFollowing(false);
  view.fitAll();
  updateLanes({ recompute: true }); // the whole trace in the window: no lane ended before it
  updateStatus();
});

// ----------------------------------------------------------------------------- downloads and Perfetto

const PERFETTO = "https://ui.perfetto.dev";

async function openInPerfetto() {
  const button = $("perfetto");
  const url = source.download_gzip;
  button.disabled = true;
  setText("perfetto-state", "fetching the trace…");
  try {
    const response = await fetch(url, { credentials: "same-origin" });
    if (!response.ok) throw new Error(`the server answered ${response.status}`);
    const buffer = await response.arrayBuffer();
    const win = window.open(PERFETTO);
    if (!win) throw new Error("the browser blocked the Perfetto window: allow pop-ups for this page");
    // Perfetto's handshake: PING until it answers PONG, then post the trace buffer.
    setText("perfetto-state", "waiting for Perfetto to answer…");
    const timer = setInterval(() => win.postMessage("PING", PERFETTO), 50);
    const onMessage = (event) => {
      if (event.source !== win || event.data !== "PONG") return;
      clearInterval(timer);
      window.removeEventListener("message", onMessage);
      win.postMessage({ perfetto: { buffer, title: document.title, fileName: url.split("/").pop() } }, PERFETTO);
      setText("perfetto-state", "sent to Perfetto");
    };
    window.addEventListener("message", onMessage);
    setTimeout(() => {
      clearInterval(timer);
      window.removeEventListener("message", onMessage);
      if ($("perfetto-state").textContent.startsWith("waiting")) {
        setText("perfetto-state", "Perfetto did not answer (it needs internet access): download the trace instead");
      }
    }, 30000);
  } catch (error) {
    setText("perfetto-state", String(error.message || error));
  } finally {
    button.disabled = false;
  }
}
$("perfetto").addEventListener("click", openInPerfetto);

// ----------------------------------------------------------------------------- saved traces

async function loadSaved() {
  const t0 = performance.now();
  setText("timeline-status", `loading ${count(source.events)} events…`);
  const [response, requests] = await Promise.all([
    fetch(source.data_url, { credentials: "same-origin" }),
    source.requests_url  // a profile's spans have no request summaries
      ? fetch(source.requests_url, { credentials: "same-origin" }).then((r) => (r.ok ? r.json() : null)).catch(() => null)
      : null,
  ]);
  if (!response.ok) {
    setText("timeline-status", `the trace could not be loaded: the server answered ${response.status}`);
    return;
  }
  const text = await response.text(); // gzip on the wire, inflated by the browser
  stats.arrivedMs = performance.now() - t0;
  const trace = JSON.parse(text);
  stats.parseMs = performance.now() - t0 - stats.arrivedMs;
  const t1 = performance.now();
  model.addChromeTrace(trace, { requests: !profile });
  stats.buildMs = performance.now() - t1;
  if (requests) {
    const at = (name) => requests.fields.indexOf(name);
    summaries = new Map();
    for (const row of requests.rows) {
      const s = {};
      requests.fields.forEach((field, i) => { s[field] = row[i]; });
      if (s.completion_tokens && s.decode_us) s.decode_tokens_per_s = s.completion_tokens / (s.decode_us / 1e6);
      summaries.set(row[at("request_id")], s);
    }
    changeUrl = requests.change_url;
  }
  view.setLanes(model.lanes);
  view.fitAll();
  updateLegend();
  updateReasons();
  updateStatus();
  requestAnimationFrame(() => {
    stats.firstFrameMs = performance.now() - t0;
    stats.ready = true;
  });
}

// ----------------------------------------------------------------------------- live engines

function setFollowing(on) {
  following = on && source.mode === "live";
  const button = $("follow");
  if (button) button.classList.toggle("active", following);
  updateStatus();
}

function applyDelta(delta) {
  if (delta.calls.length) model.addCalls(delta.calls);
  stats.missed = (stats.missed || 0) + delta.missed;
  stats.cursor = delta.cursor;
  stats.deltas = (stats.deltas || 0) + 1;
  stats.lastNowUs = delta.now_us;
  if (delta.calls.length) updateLanes();
  updateLegend();
  if (delta.calls.length) updateReasons();
}

function followPresent() {
  const now = view.now();
  if (!Number.isFinite(now) || !Number.isFinite(model.first)) return;
  const width = view.t1 - view.t0 > 1 && stats.windowSet ? view.t1 - view.t0 : 10e6;
  stats.windowSet = true;
  view.setWindow(now - width * 0.95, now + width * 0.05, "follow");
  updateLanes();
}

function startLive() {
  if (!source.tracing) {
    setText("timeline-status", "This engine records no trace: serve it with --enable-tracing.");
    return;
  }
  let cursor = 0;
  const socket = connect(source.ws, (message) => {
    if (message.type === "hello") {
      socket.send({ action: "follow", cursor });
    } else if (message.type === "trace_delta") {
      cursor = message.cursor;
      clockOffset = message.now_us - performance.now() * 1000;
      if (paused) held.push(message);
      else applyDelta(message);
      if (following && !paused) followPresent();
      view.invalidate();
      updateStatus();
    } else if (message.type === "restarted") {
      setText("timeline-notice", "The engine restarted: its trace starts again.");
      cursor = 0;
      held.length = 0;
      // The ruler counts from the restart until the new trace's first event comes.
      model.reset(clockOffset === null ? null : performance.now() * 1000 + clockOffset);
      stats.missed = 0;
      legendSize = 0;
      $("timeline-legend").replaceChildren();
      applyFilters();
      view.invalidate();
    } else if (message.type === "error") {
      setText("timeline-notice", message.message);
    }
  });
  // Open spans grow as time passes: redraw ten times a second while following.
  setInterval(() => {
    if (following && !paused) {
      followPresent();
      view.invalidate();
    }
  }, 100);
  $("follow").addEventListener("click", () => {
    setFollowing(true);
    followPresent();
  });
  $("show-finished").addEventListener("click", () => setShowFinished(!showFinished));
  $("pause").addEventListener("click", () => {
    paused = !paused;
    $("pause").textContent = paused ? "Resume" : "Pause";
    if (!paused) {
      for (const delta of held.splice(0)) applyDelta(delta);
      view.invalidate();
    }
    updateStatus();
  });
  setFollowing(true);
  updateStatus();
}

if (source.mode === "saved") {
  loadSaved().catch((error) => setText("timeline-status", `the trace could not be shown: ${error.message || error}`));
} else {
  startLive();
}

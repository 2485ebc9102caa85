// The engines overview: one row per engine, updated from the overview socket's snapshots, its
// sparkline of the last minute's decode tokens/s starting full from the server's history. The
// tokens/s are the engine's own "now" figures (over its steps of the last few seconds), the same
// numbers its page and the fleet page show.
import { Derivation, historyRows, TimeChart } from "./charts.js";
import * as fmt from "./format.js";
import { connect } from "./live.js";

const SPARK_SECONDS = 60;
const NOW_WINDOW = Number(document.getElementById("content-main").dataset.nowWindow);
const rows = new Map(); // engine name -> {el, derivation, spark}

function field(row, name) {
  return row.el.querySelector(`[data-field="${name}"]`);
}

for (const el of document.querySelectorAll("tr.engine-row")) {
  const row = { el, derivation: new Derivation(NOW_WINDOW), spark: null };
  row.spark = new TimeChart(field(row, "sparkline"), {
    series: [["decode tok/s", "#417690"]], kind: "rate", height: 36, window: SPARK_SECONDS, compact: true,
  });
  rows.set(el.dataset.engine, row);
}

/** The rates of one sample (a snapshot or a history row), into the row's sparkline. */
function plot(row, at, metrics, draw = true) {
  const d = row.derivation.next(at, metrics);
  row.spark.push(at, [d.empty ? null : d.decode], draw);
  return d;
}

function onHistory(history) {
  const row = rows.get(history.engine);
  if (!row) return;
  row.derivation = new Derivation(NOW_WINDOW);
  row.spark.clear();
  for (const sample of historyRows(history)) plot(row, sample.at, sample.metrics, false);
  row.spark.draw();
}

function update(snap) {
  const row = rows.get(snap.engine);
  if (!row) return;
  const m = snap.metrics;
  const stateEl = field(row, "state");
  stateEl.textContent = fmt.state(snap);
  stateEl.dataset.state = fmt.stateKind(snap);
  field(row, "backend").textContent = snap.backend;
  field(row, "dtype").textContent = snap.dtype;
  const d = plot(row, snap.at, m);
  if (!m) {
    for (const name of ["running", "waiting", "kv", "prefill-rate", "decode-rate", "ttft-p50", "ttft-p99"]) {
      field(row, name).textContent = "–";
    }
    return;
  }
  field(row, "running").textContent = fmt.count(m.num_running_requests);
  field(row, "waiting").textContent = fmt.count(m.num_waiting_requests);
  field(row, "kv").textContent = fmt.percent(m.kv_cache_usage);
  field(row, "kv-bar").style.width = `${Math.min(100, m.kv_cache_usage * 100)}%`;
  const over = `over the engine steps of the ${fmt.lastSeconds(m.now.window_s)} (${fmt.count(m.now.steps)} steps)`;
  for (const [name, value] of [["prefill-rate", d.prefill], ["decode-rate", d.decode]]) {
    field(row, name).textContent = fmt.rate(value);
    field(row, name).title = over;
  }
  // The last minute's TTFT: a stall ten minutes ago no longer holds the p99 up.
  const recent = m.ttft_s.last_60s;
  field(row, "ttft-p50").textContent = recent.count ? fmt.seconds(recent.p50) : "–";
  field(row, "ttft-p99").textContent = recent.count ? fmt.seconds(recent.p99) : "–";
}

if (rows.size) {
  connect("/ws/engines/", (message) => {
    if (message.type === "snapshot") update(message);
    else if (message.type === "history") onHistory(message);
  });
}

// The engines overview: one row per engine, updated from the overview socket's snapshots.
import * as fmt from "./format.js";
import { connect, Rate } from "./live.js";

const SPARK_SECONDS = 60;
const rows = new Map(); // engine name -> {el, prefill, decode, history, plot}

for (const el of document.querySelectorAll("tr.engine-row")) {
  rows.set(el.dataset.engine, { el, prefill: new Rate(), decode: new Rate(), history: [[], []], plot: null });
}

function field(row, name) {
  return row.el.querySelector(`[data-field="${name}"]`);
}

function sparkline(row) {
  const box = field(row, "sparkline");
  if (!row.plot && window.uPlot && box) {
    row.plot = new uPlot({
      width: 160, height: 36, legend: { show: false }, cursor: { show: false },
      axes: [{ show: false }, { show: false }],
      scales: { x: { time: false, range: (u, min, max) => [max - SPARK_SECONDS, max] },
                y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
      series: [{}, { stroke: "#417690", fill: "rgba(65,118,144,0.15)", width: 1.5, points: { show: false } }],
    }, row.history, box);
  }
  if (row.plot) row.plot.setData(row.history);
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
  const prefill = row.prefill.update(m.prefill_tokens_processed, snap.at);
  const decode = row.decode.update(m.decode_tokens_processed, snap.at);
  if (prefill != null) field(row, "prefill-rate").textContent = fmt.rate(prefill);
  if (decode != null) {
    field(row, "decode-rate").textContent = fmt.rate(decode);
    const [xs, ys] = row.history;
    xs.push(snap.at);
    ys.push(decode);
    while (xs.length && xs[0] < snap.at - SPARK_SECONDS) {
      xs.shift();
      ys.shift();
    }
    sparkline(row);
  }
  field(row, "ttft-p50").textContent = fmt.seconds(m.ttft_s.p50);
  field(row, "ttft-p99").textContent = fmt.seconds(m.ttft_s.p99);
}

if (rows.size) {
  connect("/ws/engines/", (message) => {
    if (message.type === "snapshot") update(message);
  });
}

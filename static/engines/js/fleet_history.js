// The fleet history page's charts: p99 TTFT and ITL, and the share within the targets, per
// minute (or hour), with a dashed line at every job run across the fleet.
import { TimeChart } from "./charts.js";

const data = JSON.parse(document.getElementById("fleet-history").textContent);
const markers = data.jobs.map((job) => ({ at: job.at, label: job.label }));

function chart(id, series, kind, columns) {
  const box = document.getElementById(id);
  const c = new TimeChart(box, { series, kind, window: data.window, markers });
  for (const row of data.series) c.push(row[0], columns.map((i) => row[i]), false);
  c.draw();
  return c;
}

function start() {
  chart("chart-latency", [["TTFT p99", "#417690"], ["ITL p99", "#e08e0b"]], "ms", [1, 2]);
  chart("chart-within", [["TTFT within", "#417690"], ["ITL within", "#e08e0b"]], "percent", [3, 4]);
}

// uPlot is a deferred classic script: it has run by the time the page's load event fires.
if (window.uPlot) start();
else window.addEventListener("load", start);

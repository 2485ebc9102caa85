// The fleet history page's charts: p99 TTFT and ITL, and the share within the targets, per
// minute (or hour), with a dashed line at every job run across the fleet.
import { TimeChart } from "./charts.js";

const data = JSON.parse(document.getElementById("fleet-history").textContent);
const markers = data.jobs.map((job) => ({ at: job.at, label: job.label }));

function chart(id, series, kind, columns) {
  const box = document.getElementById(id);
  // The window ends now, not at the newest rollup: a lone minute sits where it was, not at the edge.
  const c = new TimeChart(box, { series, kind, window: data.window, markers, end: data.end });
  for (const row of data.series) c.push(row[0], columns.map((i) => row[i]), false);
  c.draw();
  return c;
}

function start() {
  // Kept for the browser tests, which look at what each chart drew.
  window.fleetHistoryCharts = {
    latency: chart("chart-latency", [["TTFT p99", "#417690"], ["ITL p99", "#e08e0b"]], "ms", [1, 2]),
    within: chart("chart-within", [["TTFT within", "#417690"], ["ITL within", "#e08e0b"]], "percent", [3, 4]),
  };
}

// uPlot is a deferred classic script: it has run by the time the page's load event fires.
if (window.uPlot) start();
else window.addEventListener("load", start);

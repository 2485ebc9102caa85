// The regression report's distributions: for each figure (TTFT, ITL, E2E) the CDFs of run A and
// run B on one chart, drawn with the vendored uPlot. The points arrive shaped
// (engines/workloads/run_compare.py, cdf_points: [seconds, fraction at or below] at evenly spaced
// quantiles); the two runs' values differ, so the x axis is their union and each line spans the
// other's points. In the admin's colours (light or dark, drawn again when the theme changes), as
// wide as its box.

import { axisSize, onRestyle, themedAxis } from "../charts.js";

const data = JSON.parse(document.getElementById("report-data").textContent);
const root = document.getElementById("report-charts");
const HEIGHT = 200;
const COLOURS = { a: "#79aec8", b: "#ba2121" };

function width(box) {
  return Math.max(240, box.clientWidth - 8);
}

/** uPlot's columns: x (ms, ascending), A's fraction and B's fraction (null where the other run's point is). */
export function columns(cdf) {
  const points = [...cdf.a.map(([v, f]) => [v * 1000, f, null]), ...cdf.b.map(([v, f]) => [v * 1000, null, f])];
  points.sort((p, q) => p[0] - q[0]);
  return [points.map((p) => p[0]), points.map((p) => p[1]), points.map((p) => p[2])];
}

function draw(name, box) {
  return new uPlot({
    width: width(box), height: HEIGHT,
    scales: { x: { time: false }, y: { range: [0, 1] } },
    legend: { live: false },  // the runs' names; the tables hold the figures
    series: [{ label: "ms", value: (u, v) => (v == null ? "—" : v.toFixed(1)) },
             { label: "A", stroke: COLOURS.a, width: 2, spanGaps: true, points: { show: false } },
             { label: "B", stroke: COLOURS.b, width: 2, spanGaps: true, points: { show: false } }],
    axes: [themedAxis({ size: 40 }), themedAxis({ size: axisSize, values: (u, ticks) => ticks.map((t) => `${Math.round(t * 100)} %`) })],
  }, columns(data.cdfs[name]), box);
}

const boxes = [...root.querySelectorAll("[data-cdf]")].filter((box) => data.cdfs[box.dataset.cdf].a.length
  || data.cdfs[box.dataset.cdf].b.length);
const plots = boxes.map((box) => draw(box.dataset.cdf, box));
onRestyle(() => boxes.forEach((box, i) => {
  plots[i].destroy();
  plots[i] = draw(box.dataset.cdf, box);
}));
new ResizeObserver(() => plots.forEach((plot, i) => plot.setSize({ width: width(boxes[i]), height: HEIGHT })))
  .observe(root);
window.runReport = { plots, data };

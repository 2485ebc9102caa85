// The metrics snapshot list's charts: one server's snapshots of one engine over time, drawn with
// the vendored uPlot. The series arrive shaped (engines/history/metrics_charts.py: rates, idle
// stretches, breaks); this module only draws them, with times as the list prints them (format.js:
// the site's time zone, 24-hour clock), in the admin's colours (light or dark, drawn again when the
// theme changes), and keeps each chart as wide as its box.

import { axisSize, INTEGER_INCRS, onRestyle, themedAxis } from "../charts.js";
import { dateTime, timeTicks, zonedDate } from "../format.js";

const data = JSON.parse(document.getElementById("snapshot-charts-data").textContent);
const root = document.getElementById("snapshot-charts");
const HEIGHT = 180;

function width(box) {
  return Math.max(240, box.clientWidth - 8);
}

/** One chart in `box`, in the admin's colours now. */
function draw(chart, box) {
  return new uPlot({
    width: width(box), height: HEIGHT,
    tzDate: zonedDate,  // ticks on the site's round hours
    cursor: { sync: { key: "snapshot-charts" } },  // one moment under the pointer, on every chart
    scales: { y: { range: (u, min, max) => [0, Math.max(max ?? 0, 1)] } },
    series: [{ label: "time", value: (u, ts) => dateTime(ts) },
             ...chart.series.map((s) => ({ label: s.label, stroke: s.color, width: 1.5,
                                           points: { show: data.x.length < 60 } }))],
    axes: [themedAxis({ values: timeTicks, size: 44 }),
           // "1,000,000" fits as "0.5" does; counts tick at whole numbers
           themedAxis({ size: axisSize, ...(chart.integer ? { incrs: INTEGER_INCRS } : {}) })],
  }, [data.x, ...chart.series.map((s) => s.values)], box);
}

const boxes = data.charts.map((chart) => [chart, root.querySelector(`[data-chart="${chart.key}"]`)]);
const plots = boxes.map(([chart, box]) => draw(chart, box));
onRestyle(() => boxes.forEach(([chart, box], i) => {
  plots[i].destroy();
  plots[i] = draw(chart, box);
}));
new ResizeObserver(() => {
  plots.forEach((plot, i) => plot.setSize({ width: width(boxes[i][1]), height: HEIGHT }));
}).observe(root);
window.snapshotCharts = { plots, data };

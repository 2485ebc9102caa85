// The metrics snapshot list's charts: one server's snapshots of one engine over time, drawn with
// the vendored uPlot. The series arrive shaped (engines/history/metrics_charts.py: rates, idle
// stretches, breaks); this module only draws them, with times as the list prints them (the site's
// time zone, 24-hour clock), in the admin's colours (light or dark, drawn again when the theme
// changes), and keeps each chart as wide as its box.

import { axisSize, onRestyle, themedAxis } from "../charts.js";

const data = JSON.parse(document.getElementById("snapshot-charts-data").textContent);
const root = document.getElementById("snapshot-charts");
const timeZone = root.dataset.timeZone || "UTC";
const HEIGHT = 180;

const parts = new Intl.DateTimeFormat("en-GB", {
  timeZone, hourCycle: "h23", year: "numeric", month: "2-digit", day: "2-digit",
  hour: "2-digit", minute: "2-digit", second: "2-digit",
});

/** Epoch seconds -> {date: "2026-11-27", minute: "08:53", second: "08:53:36"} in the site's zone. */
function clock(ts) {
  const p = Object.fromEntries(parts.formatToParts(new Date(ts * 1000)).map(({ type, value }) => [type, value]));
  const minute = `${p.hour}:${p.minute}`;
  return { date: `${p.year}-${p.month}-${p.day}`, minute, second: `${minute}:${p.second}` };
}

// Tick labels: hours and minutes (and seconds when ticks are under a minute apart), with the date
// under the first tick and under each new day.
function timeTicks(u, splits, axis, space, increment) {
  let day = null;
  return splits.map((ts) => {
    const c = clock(ts);
    const time = increment < 60 ? c.second : c.minute;
    const label = c.date !== day ? `${time}\n${c.date}` : time;
    day = c.date;
    return label;
  });
}

function width(box) {
  return Math.max(240, box.clientWidth - 8);
}

/** One chart in `box`, in the admin's colours now. */
function draw(chart, box) {
  return new uPlot({
    width: width(box), height: HEIGHT,
    tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), timeZone),  // ticks on the zone's round hours
    cursor: { sync: { key: "snapshot-charts" } },  // one moment under the pointer, on every chart
    scales: { y: { range: (u, min, max) => [0, Math.max(max ?? 0, 1)] } },
    series: [{ label: "time", value: (u, ts) => (ts == null ? "–" : `${clock(ts).date} ${clock(ts).second}`) },
             ...chart.series.map((s) => ({ label: s.label, stroke: s.color, width: 1.5,
                                           points: { show: data.x.length < 60 } }))],
    axes: [themedAxis({ values: timeTicks, size: 44 }),
           themedAxis({ size: axisSize })],  // "1,000,000" fits as "0.5" does
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

// A saved profile: the kernel table sorted by any column, the steps' time stacked by phase, the
// engine thread's Python stacks as a flame graph, and the configuration. User text (frame
// names, config values) only ever goes through textContent or canvas text.

import { INTEGER_INCRS, onRestyle, themedAxis } from "../charts.js";
import { count } from "../format.js";
import { FlameGraph } from "./flame.js";

const source = JSON.parse(document.getElementById("profile-source").textContent);
const $ = (id) => document.getElementById(id);
const state = { ready: false }; // read by the browser tests
window.profilePage = state;

// Phase colours: the kernels warm, the host's work cool, the rest grey.
const PHASE_COLOURS = {
  schedule: "#79aec8", prepare: "#417690", kernels: "#d46a00", transfers: "#f0a35e", "forward other": "#c7b299",
  commit: "#8e7cc3", grammar: "#6aa84f", sampling: "#c27ba0", detokenization: "#3d85c6", outputs: "#999999",
};

// ------------------------------------------------------------------------------ kernel table

function sortTable(table, column, descending) {
  const numeric = table.tHead.rows[0].cells[column].dataset.type === "number";
  const rows = [...table.tBodies[0].rows];
  const key = (row) => (numeric ? Number(row.cells[column].dataset.sort) : row.cells[column].dataset.sort || "");
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    const order = numeric ? x - y : String(x).localeCompare(String(y));
    return descending ? -order : order;
  });
  table.tBodies[0].append(...rows);
  for (const [i, th] of [...table.tHead.rows[0].cells].entries()) {
    th.setAttribute("aria-sort", i === column ? (descending ? "descending" : "ascending") : "none");
  }
}

function makeSortable(table) {
  if (!table || table.tBodies[0].rows.length < 2) return;
  for (const [i, th] of [...table.tHead.rows[0].cells].entries()) {
    th.querySelector("button").addEventListener("click", () => {
      // Numbers sort largest first on the first click (what a profile is read for), names A to Z.
      const current = th.getAttribute("aria-sort");
      const descending = current === "none" || current === null
        ? th.dataset.type === "number" : current === "ascending";
      sortTable(table, i, descending);
    });
  }
}
makeSortable($("kernel-table"));

// -------------------------------------------------------------------------- step breakdown

function stepChart(profile) {
  const box = $("step-chart");
  const fields = profile.step_rows.fields;
  const rows = profile.step_rows.rows;
  if (!rows.length || !window.uPlot) {
    box.textContent = "No step was profiled.";
    return;
  }
  if (state.stepChart) state.stepChart.destroy(); // drawn again: another theme or width
  const col = (name) => fields.indexOf(name);
  const xs = rows.map((r) => r[col("index")]);
  const phases = profile.phases.filter((p) => rows.some((r) => r[col(p)] > 0));
  // Stacked by hand: series i is the sum of phases 0..i (ms), drawn from the top down so each
  // phase shows as its own band; the legend shows each phase's own value.
  const own = phases.map((p) => rows.map((r) => r[col(p)] / 1000));
  const stacked = [];
  own.forEach((values, i) => stacked.push(values.map((v, j) => v + (i ? stacked[i - 1][j] : 0))));
  const order = phases.map((_, i) => phases.length - 1 - i);
  const totals = rows.map((r) => r[col("total_us")] / 1000);
  const bars = uPlot.paths.bars({ size: [0.9, 12] });
  const plot = new uPlot({
    width: Math.max(320, box.clientWidth - 8), height: 260,
    scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(max, 0.001) * 1.05] } },
    axes: [themedAxis({ label: "step", size: 36, incrs: INTEGER_INCRS }), themedAxis({ label: "ms", size: 56 })],
    legend: { live: true },
    series: [
      // The hovered step's number and its whole time, beside each phase's share of it.
      { label: "step", value: (u, v, s, idx) => (idx == null ? "–" : `${v}, ${totals[idx].toFixed(2)} ms in all`) },
      ...order.map((i) => ({
        label: phases[i], stroke: PHASE_COLOURS[phases[i]] || "#666", fill: PHASE_COLOURS[phases[i]] || "#666",
        width: 0, paths: bars, points: { show: false },
        value: (u, v, s, idx) => (idx == null ? "–" : `${own[i][idx].toFixed(2)} ms`),
      })),
    ],
  }, [xs, ...order.map((i) => stacked[i])], box);
  // The legend in the step's own order (schedule first): uPlot keeps its rows by reference,
  // so moving them leaves the values it writes in place.
  const legend = plot.root.querySelector(".u-legend tbody");
  if (legend) legend.append(...[...legend.rows].slice(1).reverse());
  state.stepChart = plot;
  const total = rows.reduce((sum, r) => sum + r[col("total_us")], 0) / rows.length;
  const kernels = rows.reduce((sum, r) => sum + r[col("kernels")], 0) / rows.length;
  $("step-summary").textContent = `${count(rows.length)} steps, mean ${(total / 1000).toFixed(2)} ms a step, `
    + `${((100 * kernels) / total).toFixed(1)} % of it in kernels. Hover a step for its phases.`;
}

// ------------------------------------------------------------------------------ the rest

function configTable(config) {
  const body = $("config-table").tBodies[0];
  for (const [key, value] of Object.entries(config || {})) {
    const row = body.insertRow();
    const th = document.createElement("th");
    th.textContent = key;
    row.append(th);
    row.insertCell().textContent = typeof value === "object" ? JSON.stringify(value) : String(value);
  }
}

async function load() {
  const response = await fetch(source.data_url, { credentials: "same-origin" });
  if (!response.ok) {
    const answer = await response.json().catch(() => ({}));
    throw new Error(answer.error || `the server answered ${response.status}`);
  }
  const profile = await response.json();
  const peak = profile.peak || {};
  $("peak").textContent = peak.bandwidth_gbs
    ? `${peak.bandwidth_gbs.toFixed(1)} GB/s (${peak.source === "device" ? "the device's" : "measured on this host"})`
    : "unknown";
  stepChart(profile);
  if (profile.stacks && profile.stacks.samples) {
    state.flame = new FlameGraph($("flame"), $("flame-tip"), profile.stacks);
  }
  onRestyle(() => { // another theme, or another window width: both drawn again to fit
    stepChart(profile);
    state.flame?.draw();
  });
  configTable(profile.config);
  $("profile-status").textContent = "";
  state.ready = true;
}

load().catch((error) => {
  $("profile-status").textContent = `the profile could not be shown: ${error.message || error}`;
});

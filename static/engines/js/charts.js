// Live time-series charts on uPlot for the engine page and the overview: the last five minutes,
// in the admin's colours (light or dark, redrawn when the theme changes), times as the product
// prints them (format.js: 24-hour, the site's time zone), y labels sized to fit, whole numbers on
// count axes, each legend showing the newest values until the cursor points at others, and a gap
// (not a line) where the engine gave no numbers (a value alone between gaps: a dot).
import * as fmt from "./format.js";

export const WINDOW_SECONDS = 300;

/** The steps a count's axis may tick at (uPlot `incrs`): whole numbers only, never 0.5 requests. */
export const INTEGER_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6,
  2e6, 5e6, 1e7];

// What each kind of axis shows, and the steps its ticks may take.
const KINDS = {
  count: { format: (v) => fmt.compact(v), incrs: INTEGER_INCRS },
  rate: { format: (v) => fmt.compact(v) },
  percent: { format: (v) => `${Math.round(v)} %`, max: 100 },
  ms: { format: (v) => fmt.compact(v) },
};

/** The admin's colours for a chart's text and grid, light or dark as the page is now. */
export function themeColours() {
  const css = getComputedStyle(document.documentElement);
  const read = (name, fallback) => css.getPropertyValue(name).trim() || fallback;
  return { text: read("--body-quiet-color", "#666"), grid: read("--hairline-color", "#e8e8e8") };
}

/** uPlot axes in those colours. */
export function themedAxis(extra = {}) {
  const c = themeColours();
  return { stroke: c.text, grid: { stroke: c.grid, width: 1 }, ticks: { stroke: c.grid, width: 1 }, ...extra };
}

/** Call `redraw` when the admin's theme toggle or the system's colour scheme changes, and (after
 * the resizing settles) when the window is made narrower or wider. */
export function onRestyle(redraw) {
  new MutationObserver(redraw).observe(document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
  window.matchMedia?.("(prefers-color-scheme: dark)").addEventListener?.("change", redraw);
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(redraw, 200);
  });
}

const live = new Set();
onRestyle(() => live.forEach((chart) => chart.rebuild()));

/** A y axis as wide as its longest label (uPlot's fixed default clipped "20,000" to "ɛ0,000"):
 * an axis's `size`. */
export function axisSize(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1) return axis._size;
  let size = axis.ticks.size + axis.gap;
  const longest = (values || []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
  if (longest) {
    u.ctx.font = axis.font[0];
    size += u.ctx.measureText(longest).width / devicePixelRatio;
  }
  return Math.ceil(size) + 4;
}

// A value between two gaps draws no line: it is drawn as a dot instead, so that a series of one
// sample (a load that lasted a minute, on the fleet's history) still shows. uPlot calls this with
// `show` false (points are off) and draws the points at the indices it returns.
function lonePoints(u, seriesIdx, show) {
  if (show) return null;
  const ys = u.data[seriesIdx];
  const lone = [];
  for (let i = 0; i < ys.length; i++) {
    if (ys[i] != null && ys[i - 1] == null && ys[i + 1] == null) lone.push(i);
  }
  return lone.length ? lone : null;
}

export class TimeChart {
  /**
   * box: the element to draw in; series: [[label, colour], ...]; kind: count | rate | percent | ms.
   * window: seconds shown (the x axis always spans it, however few points have come).
   * markers: [{at, label}], drawn as dashed vertical lines (the fleet history's jobs).
   * end: the x axis' right end (Unix seconds), fixed; by default the newest sample's time.
   */
  constructor(box, { series, kind = "rate", height = 170, window = WINDOW_SECONDS, compact = false, markers = [],
                     end = null }) {
    this.markers = markers;
    this.end = end;
    this.box = box;
    this.series = series;
    this.kind = KINDS[kind];
    this.height = height;
    this.window = window;
    this.compact = compact; // a sparkline: no axes, no legend
    this.data = [[], ...series.map(() => [])];
    this.plot = null;
    live.add(this);
    this.rebuild();
  }

  rebuild() {
    if (!window.uPlot || !this.box) return;
    if (this.plot) this.plot.destroy();
    const kind = this.kind;
    const axisY = themedAxis({ size: axisSize, values: (u, splits) => splits.map(kind.format),
                               ...(kind.incrs ? { incrs: kind.incrs } : {}) });
    const windowed = (u, min, max) => {
      const end = this.end ?? (Number.isFinite(max) ? max : Date.now() / 1000);
      return [end - this.window, end];
    };
    this.plot = new uPlot({
      width: this.compact ? this.box.clientWidth || 160 : Math.max(280, this.box.clientWidth - 8),
      height: this.height,
      tzDate: fmt.zonedDate,
      legend: { show: !this.compact, live: true },
      cursor: { show: !this.compact },
      scales: {
        x: { time: !this.compact, range: windowed },
        // From zero, a little above the highest value, never below 1 (an idle chart reads 0 to 1).
        y: { range: (u, min, max) => [0, kind.max ?? Math.max(Number.isFinite(max) ? max * 1.1 : 1, 1)] },
      },
      series: [{ value: (u, ts) => fmt.dateTime(ts) }, ...this.series.map(([label, stroke]) => ({
        label, stroke, width: 1.5, points: { show: false, filter: lonePoints, size: 6, stroke, fill: stroke },
        value: (u, v) => (v == null ? "–" : kind.format(v)),
        ...(this.compact ? { fill: `${stroke}26` } : {}),
      }))],
      axes: this.compact ? [{ show: false }, { show: false }] : [themedAxis({ values: fmt.timeTicks }), axisY],
      hooks: {
        setCursor: [(u) => { if (u.cursor.left == null || u.cursor.left < 0) this.showLatest(); }],
        draw: [(u) => this.drawMarkers(u)],
      },
    }, this.data, this.box);
    this.showLatest();
  }

  drawMarkers(u) {
    if (!this.markers.length) return;
    const { left, top, width, height } = u.bbox;
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = themeColours().text;
    ctx.setLineDash([4, 4]);
    ctx.lineWidth = 1;
    for (const marker of this.markers) {
      const x = u.valToPos(marker.at, "x", true);
      if (x < left || x > left + width) continue;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }

  /** The legend shows the newest values while the cursor is off the chart. */
  showLatest() {
    const n = this.data[0].length;
    if (this.plot && n && !this.compact) this.plot.setLegend({ idx: n - 1 });
  }

  /** Add one sample (values in series order; null: no value, drawn as a gap). */
  push(at, values, draw = true) {
    const xs = this.data[0];
    if (xs.length && at <= xs[xs.length - 1]) return; // the history's last sample again
    xs.push(at);
    values.forEach((v, i) => this.data[i + 1].push(v == null || !Number.isFinite(v) ? null : v));
    while (xs.length && xs[0] < at - this.window) this.data.forEach((column) => column.shift());
    if (draw) this.draw();
  }

  /** Drop every sample (a page that gets the history again after a reconnection). */
  clear() {
    this.data = [[], ...this.series.map(() => [])];
  }

  draw() {
    if (!this.plot) return this.rebuild();
    this.plot.setData(this.data);
    this.showLatest();
  }
}

/** The counters the engine page charts as rates (requests ended, preemptions, KV evictions). */
const COUNTERS = ["num_finished_requests", "num_aborted_requests", "num_failed_requests", "num_preemptions",
  "num_kv_evictions"];

/**
 * The engine's numbers a chart draws, from one sample (a snapshot, or a row of the history): its
 * "now" figures as the engine gives them (tokens/s and decode batch size over its steps of the
 * last `windowSeconds`: `metrics.now`), gauges as they are, percentiles in milliseconds, and
 * the request counters as rates over the samples of the same window (since the newest sample at
 * least that old; null until a second sample, and after a gap or a reset). `metrics` null: the
 * engine gave none.
 */
export class Derivation {
  constructor(windowSeconds) {
    this.window = windowSeconds;
    this.samples = []; // {at, m}, oldest first: the newest at or before the window's start, then the rest
  }

  next(at, m) {
    if (!m) {
      this.samples = [];
      return { empty: true };
    }
    const samples = this.samples;
    const last = samples[samples.length - 1];
    const reset = last && COUNTERS.some((key) => m[key] < last.m[key]);
    if (reset) samples.length = 0;
    if (reset || !last || at > last.at) samples.push({ at, m }); // not the history's last sample again
    while (samples.length > 2 && samples[1].at <= at - this.window) samples.shift();
    const base = samples[0];
    const rate = (key) => (base.at < at ? (m[key] - base.m[key]) / (at - base.at) : null);
    const ms = (d, p) => (d && d.last_60s && d.last_60s.count ? d.last_60s[p] * 1000 : null);
    const now = m.now || {};
    return {
      prefill: now.prefill_tokens_per_s ?? null,
      decode: now.decode_tokens_per_s ?? null,
      running: m.num_running_requests,
      waiting: m.num_waiting_requests,
      batch: now.decode_batch_size ?? null,
      batchMax: now.decode_batch_size_max ?? null,
      kv: m.kv_cache_usage * 100,
      hitRate: m.prefix_cache_hit_rate == null ? null : m.prefix_cache_hit_rate * 100,
      ttft50: ms(m.ttft_s, "p50"),
      ttft99: ms(m.ttft_s, "p99"),
      itl50: ms(m.token_gap_s, "p50"),
      itl99: ms(m.token_gap_s, "p99"),
      finished: rate("num_finished_requests"),
      aborted: rate("num_aborted_requests"),
      failed: rate("num_failed_requests"),
      preemptions: rate("num_preemptions"),
      // Absent from a sample of an older server: no rate rather than NaN.
      evictions: m.num_kv_evictions == null ? null : rate("num_kv_evictions"),
    };
  }
}

/** An EngineHistory message's rows, each as {at, metrics} (metrics nested as a snapshot's, or null). */
export function historyRows(history) {
  return history.values.map((row, i) => {
    if (row.every((v) => v == null)) return { at: history.at[i], metrics: null };
    const m = {};
    history.fields.forEach((path, j) => {
      const keys = path.split(".");
      let node = m;
      keys.slice(0, -1).forEach((k) => { node = node[k] ??= {}; });
      node[keys[keys.length - 1]] = row[j];
    });
    return { at: history.at[i], metrics: m };
  });
}

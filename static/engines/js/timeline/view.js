// The timeline drawn on <canvas>: lanes of spans, a ruler, a minimap; zoom, pan, hover, select.
//
// A frame costs what is on screen, not what is in the trace: only the lanes in view are drawn,
// each row is entered by binary search, and where spans are thinner than a pixel the loop
// draws one pixel and jumps (binary search again) to the first span of the next pixel.
import { timeOfDay } from "../format.js";

const ROW_H = 14;
const LANE_PAD = 6;
const GUTTER = 190; // lane labels
const RULER_H = 24;
const MINIMAP_H = 36;
const MIN_SPAN_LABEL_PX = 46;

// Colour by base name: a fixed palette first (the names every trace has), then hashed hues.
const PALETTE = {
  prefill: "#3b7dd8", decode: "#2e9e5b", queue: "#b7b7b7", sampling: "#d98b2b",
  detokenization: "#8b5cc7", "apply logit mask": "#c7508b", tokenization: "#47a9b8",
  "first token": "#f2c200", finish: "#d9453b", preempt: "#000000", "request added to engine": "#6c6c6c",
  "receive request": "#9ad0dc", "kv cache admit": "#b5651d", "jump forward": "#e377c2", "request error": "#ff0000",
};

export function colourOf(name) {
  if (PALETTE[name]) return PALETTE[name];
  let hash = 0;
  for (let i = 0; i < name.length; i++) hash = (hash * 31 + name.charCodeAt(i)) | 0;
  return `hsl(${((hash % 360) + 360) % 360}, 55%, 52%)`;
}

function niceStep(span) {
  const raw = span / 8;
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 5, 10]) if (raw <= m * power) return m * power;
  return 10 * power;
}

/** A duration in µs, readable ("1.25 ms", "812 µs", "3.2 s"). */
export function formatUs(us) {
  const a = Math.abs(us);
  if (a >= 1e6) return `${(us / 1e6).toFixed(a >= 1e7 ? 1 : 3)} s`;
  if (a >= 1e3) return `${(us / 1e3).toFixed(a >= 1e5 ? 1 : 3)} ms`;
  return `${us.toFixed(a >= 100 ? 0 : 1)} µs`;
}

/** The canvas's colours from the admin's CSS variables: light or dark, as the page is. */
function themeColours() {
  const css = getComputedStyle(document.documentElement);
  const read = (name, fallback) => css.getPropertyValue(name).trim() || fallback;
  return {
    bg: read("--body-bg", "#fff"), fg: read("--body-fg", "#333"), quiet: read("--body-quiet-color", "#555"),
    panel: read("--darkened-bg", "#f8f8f8"), line: read("--hairline-color", "#eee"),
    border: read("--border-color", "#ddd"), accent: read("--link-fg", "#417690"),
    selected: read("--selected-row", "#eaf2fb"), found: read("--message-warning-bg", "#fff5c2"),
  };
}

export class TimelineView {
  /**
   * `root` holds a `.tl-minimap` canvas and a `.tl-scroll` div (with a `.tl-canvas` canvas and a
   * `.tl-spacer`); `model` is a TraceModel. `hooks`: onHover(info|null, x, y), onLane(lane),
   * onRange([t0, t1]|null), onViewChange().
   */
  constructor(root, model, hooks = {}) {
    this.root = root;
    this.model = model;
    this.hooks = hooks;
    this.canvas = root.querySelector(".tl-canvas");
    this.minimap = root.querySelector(".tl-minimap");
    this.scroller = root.querySelector(".tl-scroll");
    this.spacer = root.querySelector(".tl-spacer");
    this.ctx = this.canvas.getContext("2d", { alpha: false });
    this.mctx = this.minimap.getContext("2d", { alpha: false });
    this.t0 = 0; // visible window, trace µs
    this.t1 = 1;
    this.lanes = model.lanes; // what is shown, in order (filters narrow it)
    this.laneTops = new Float64Array(1);
    this.laneVersion = -1;
    this.selectedLane = null;
    this.highlight = null; // a lane found by search
    this.range = null; // [t0, t1] selected
    this.now = () => model.last; // live mode makes open spans grow with the clock
    this.frames = []; // [rAF timestamp, draw ms] while recordFrames is on (bench/timeline.py)
    this.recordFrames = false;
    this.pending = false;
    this.keys = new Set();
    this.density = null;
    this.densityVersion = -1;
    this.colours = []; // by name id
    this.theme = themeColours();
    const retheme = () => {
      this.theme = themeColours();
      this.invalidate();
    };
    new MutationObserver(retheme).observe(document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
    window.matchMedia?.("(prefers-color-scheme: dark)").addEventListener?.("change", retheme);
    this.bind();
    this.resize();
  }

  // ------------------------------------------------------------------ layout

  setLanes(lanes) {
    this.lanes = lanes;
    this.laneVersion = -1;
    this.invalidate();
  }

  layoutLanes() {
    if (this.laneVersion === this.model.version && this.laneTops.length === this.lanes.length + 1) return;
    const tops = new Float64Array(this.lanes.length + 1);
    let y = 0;
    for (let i = 0; i < this.lanes.length; i++) {
      tops[i] = y;
      y += Math.max(1, this.lanes[i].rows.length) * ROW_H + LANE_PAD;
    }
    tops[this.lanes.length] = y;
    this.laneTops = tops;
    this.laneVersion = this.model.version;
    this.spacer.style.height = `${y + RULER_H}px`;
  }

  resize() {
    const dpr = window.devicePixelRatio || 1;
    const width = this.scroller.clientWidth;
    const height = this.scroller.clientHeight;
    for (const [canvas, h] of [[this.canvas, height], [this.minimap, MINIMAP_H]]) {
      canvas.width = Math.max(1, Math.floor(width * dpr));
      canvas.height = Math.max(1, Math.floor(h * dpr));
      canvas.style.width = `${width}px`;
      canvas.style.height = `${h}px`;
    }
    this.dpr = dpr;
    this.width = width;
    this.height = height;
    this.densityVersion = -1;
    this.invalidate();
  }

  get plotWidth() {
    return Math.max(1, this.width - GUTTER);
  }

  xOf(t) {
    return GUTTER + ((t - this.t0) / (this.t1 - this.t0)) * this.plotWidth;
  }

  tOf(x) {
    return this.t0 + ((x - GUTTER) / this.plotWidth) * (this.t1 - this.t0);
  }

  setWindow(t0, t1, reason = "user") {
    const min = 0.5; // µs: closer than this there is nothing more to see
    if (t1 - t0 < min) {
      const mid = (t0 + t1) / 2;
      t0 = mid - min / 2;
      t1 = mid + min / 2;
    }
    this.t0 = t0;
    this.t1 = t1;
    if (this.hooks.onViewChange) this.hooks.onViewChange(reason);
    this.invalidate();
  }

  fitAll() {
    const { first, last } = this.model;
    if (!Number.isFinite(first)) return;
    const pad = Math.max(1, (last - first) * 0.02);
    this.setWindow(first - pad, Math.max(last, this.now()) + pad, "fit");
  }

  zoom(factor, atX) {
    const t = this.tOf(atX);
    this.setWindow(t - (t - this.t0) * factor, t + (this.t1 - t) * factor);
  }

  pan(dx) {
    const dt = (dx / this.plotWidth) * (this.t1 - this.t0);
    this.setWindow(this.t0 + dt, this.t1 + dt);
  }

  /** Scroll so that `lane` is in view and show it from its first to its last event. */
  reveal(lane) {
    this.layoutLanes();
    const index = this.lanes.indexOf(lane);
    if (index < 0) return false;
    this.scroller.scrollTop = Math.max(0, this.laneTops[index] - this.height / 3);
    const end = Math.max(lane.last, lane.rows.some((r) => r.count && r.end.data[r.count - 1] === Infinity) ? this.now() : lane.last);
    const pad = Math.max(1, (end - lane.first) * 0.05);
    this.setWindow(lane.first - pad, end + pad, "reveal");
    return true;
  }

  // ------------------------------------------------------------------ drawing

  invalidate() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame((stamp) => {
      this.pending = false;
      this.stepKeys();
      const began = performance.now();
      this.draw();
      if (this.recordFrames) this.frames.push([stamp, performance.now() - began]);
      if (this.keys.size) this.invalidate();
    });
  }

  draw() {
    this.layoutLanes();
    const ctx = this.ctx;
    const dpr = this.dpr;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = this.theme.bg;
    ctx.fillRect(0, 0, this.width, this.height);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    const scrollTop = this.scroller.scrollTop;
    const top = RULER_H;
    const now = this.now();
    const tops = this.laneTops;
    // First lane in view: binary search on the lane tops.
    let lo = 0;
    let hi = this.lanes.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (tops[mid + 1] <= scrollTop) lo = mid + 1;
      else hi = mid;
    }
    const k = this.plotWidth / (this.t1 - this.t0);
    const paths = new Map(); // colour -> Path2D: one fill per colour per frame
    const labels = [];
    const marks = new Map(); // colour -> Path2D of instant markers
    const rangeT0 = this.t0;
    const rangeT1 = this.t1;
    for (let li = lo; li < this.lanes.length; li++) {
      const y0 = top + tops[li] - scrollTop;
      if (y0 > this.height) break;
      const lane = this.lanes[li];
      if (lane === this.selectedLane || lane === this.highlight) {
        ctx.fillStyle = lane === this.highlight ? this.theme.found : this.theme.selected;
        ctx.fillRect(0, y0, this.width, tops[li + 1] - tops[li]);
      }
      for (let depth = 0; depth < lane.rows.length; depth++) {
        this.drawRow(lane.rows[depth], y0 + depth * ROW_H + 1, k, rangeT0, rangeT1, now, paths, labels);
      }
      this.drawInstants(lane.instants, y0, k, rangeT0, rangeT1, marks);
    }
    for (const [colour, path] of paths) {
      ctx.fillStyle = colour;
      ctx.fill(path);
    }
    ctx.fillStyle = "#fff";
    for (const [text, x, y, w] of labels) {
      ctx.save();
      ctx.beginPath();
      ctx.rect(x, y - ROW_H / 2, w, ROW_H);
      ctx.clip();
      ctx.fillText(text, x + 3, y);
      ctx.restore();
    }
    ctx.strokeStyle = "rgba(0, 0, 0, 0.55)";
    ctx.lineWidth = 0.75;
    for (const [colour, path] of marks) {
      ctx.fillStyle = colour;
      ctx.fill(path);
      ctx.stroke(path);
    }
    this.drawRange(top);
    this.drawGutter(lo, top, scrollTop);
    this.drawRuler();
    this.drawMinimap();
  }

  drawRow(row, y, k, t0, t1, now, paths, labels) {
    const n = row.count;
    if (!n) return;
    const start = row.start.data;
    const end = row.end.data;
    const nameOf = row.name.data;
    const colours = this.colours;
    const names = this.model.names;
    const h = ROW_H - 2;
    let i = row.firstEndingAfter(t0);
    while (i < n) {
      const s = start[i];
      if (s > t1) break;
      let e = end[i];
      if (e === Infinity) e = Math.max(now, s);
      const x0 = GUTTER + (s - t0) * k;
      const x1 = GUTTER + (e - t0) * k;
      const id = nameOf[i];
      const colour = colours[id] || (colours[id] = colourOf(names[id]));
      let path = paths.get(colour);
      if (!path) paths.set(colour, (path = new Path2D()));
      if (x1 - x0 >= 1) {
        const left = Math.max(x0, GUTTER);
        const width = Math.min(x1, this.width) - left;
        path.rect(left, y, Math.max(width, 1), h);
        if (width >= MIN_SPAN_LABEL_PX) labels.push([this.model.spanName(nameOf[i], row.counter.data[i]), left, y + h / 2, width]);
        i += 1;
        continue;
      }
      // Thinner than a pixel: one pixel stands for every span that starts inside it.
      const px = Math.floor(x0);
      path.rect(Math.max(px, GUTTER), y, 1, h);
      i = row.firstStartingAt(t0 + (px + 1 - GUTTER) / k, i + 1);
    }
  }

  drawInstants(row, y0, k, t0, t1, marks) {
    const n = row.count;
    if (!n) return;
    const ts = row.start.data;
    const nameOf = row.name.data;
    const colours = this.colours;
    let i = row.firstStartingAt(t0);
    while (i < n && ts[i] <= t1) {
      const x = GUTTER + (ts[i] - t0) * k;
      const px = Math.floor(x);
      const id = nameOf[i];
      const colour = colours[id] || (colours[id] = colourOf(this.model.names[id]));
      let path = marks.get(colour);
      if (!path) marks.set(colour, (path = new Path2D()));
      path.moveTo(x - 3.5, y0);
      path.lineTo(x + 3.5, y0);
      path.lineTo(x, y0 + 6);
      path.closePath();
      i = row.firstStartingAt(t0 + (px + 2 - GUTTER) / k, i + 1); // two pixels per marker at most
    }
  }

  drawRange(top) {
    if (!this.range) return;
    const ctx = this.ctx;
    const x0 = Math.max(GUTTER, this.xOf(this.range[0]));
    const x1 = Math.min(this.width, this.xOf(this.range[1]));
    if (x1 <= x0) return;
    ctx.fillStyle = "rgba(66, 120, 200, 0.15)";
    ctx.fillRect(x0, top, x1 - x0, this.height - top);
    ctx.fillStyle = "#4278c8";
    ctx.fillRect(x0, top, 1, this.height - top);
    ctx.fillRect(x1 - 1, top, 1, this.height - top);
  }

  drawGutter(lo, top, scrollTop) {
    const ctx = this.ctx;
    ctx.fillStyle = this.theme.panel;
    ctx.fillRect(0, top, GUTTER, this.height - top);
    ctx.fillStyle = this.theme.border;
    ctx.fillRect(GUTTER - 1, top, 1, this.height - top);
    const tops = this.laneTops;
    for (let li = lo; li < this.lanes.length; li++) {
      const y0 = top + tops[li] - scrollTop;
      if (y0 > this.height) break;
      const lane = this.lanes[li];
      ctx.fillStyle = lane.kind === "engine" ? this.theme.accent : this.theme.fg;
      ctx.save();
      ctx.beginPath();
      ctx.rect(0, y0, GUTTER - 6, ROW_H);
      ctx.clip();
      ctx.fillText(lane.label, 6, y0 + ROW_H / 2);
      ctx.restore();
      ctx.fillStyle = this.theme.line;
      ctx.fillRect(0, top + tops[li + 1] - scrollTop - 1, this.width, 1);
    }
  }

  drawRuler() {
    const ctx = this.ctx;
    ctx.fillStyle = this.theme.panel;
    ctx.fillRect(0, 0, this.width, RULER_H);
    ctx.fillStyle = this.theme.border;
    ctx.fillRect(0, RULER_H - 1, this.width, 1);
    const origin = this.model.origin ?? this.t0;
    const step = niceStep(this.t1 - this.t0);
    const first = Math.ceil((this.t0 - origin) / step) * step + origin;
    ctx.fillStyle = this.theme.quiet;
    ctx.textBaseline = "middle";
    const ticks = [];
    for (let t = first; t <= this.t1; t += step) {
      const x = this.xOf(t);
      if (x < GUTTER) continue;
      ctx.fillRect(x, RULER_H - 7, 1, 6);
      ctx.fillText(t - origin < 0 ? `−${formatUs(origin - t)}` : `+${formatUs(t - origin)}`, x + 3, RULER_H / 2 - 2);
      ticks.push(t);
    }
    this.ticks = ticks;
    // The trace's own clock: the wall time of the view's left edge (ts is µs since the epoch).
    ctx.fillStyle = "#417690";
    const clock = Number.isFinite(this.t0) && this.t0 > 1e12
      ? `${timeOfDay(this.t0 / 1e6)}.${String(Math.floor((this.t0 / 1000) % 1000)).padStart(3, "0")}`
      : "";
    ctx.fillText(clock, 6, RULER_H / 2);
  }

  drawMinimap() {
    const ctx = this.mctx;
    const dpr = this.dpr;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = this.theme.panel;
    ctx.fillRect(0, 0, this.width, MINIMAP_H);
    const { first } = this.model;
    if (!Number.isFinite(first)) return;
    const last = Math.max(this.model.last, this.now());
    const density = this.minimapDensity(first, last);
    const w = this.plotWidth;
    let max = 1;
    for (let i = 0; i < density.length; i++) if (density[i] > max) max = density[i];
    ctx.fillStyle = "#79aec8";
    for (let i = 0; i < density.length; i++) {
      if (!density[i]) continue;
      const h = Math.max(1, (density[i] / max) * (MINIMAP_H - 4));
      ctx.fillRect(GUTTER + i, MINIMAP_H - h, 1, h);
    }
    const span = last - first || 1;
    const x0 = GUTTER + ((this.t0 - first) / span) * w;
    const x1 = GUTTER + ((this.t1 - first) / span) * w;
    ctx.fillStyle = "rgba(65, 118, 144, 0.25)";
    ctx.fillRect(Math.max(GUTTER, x0), 0, Math.max(2, Math.min(this.width, x1) - Math.max(GUTTER, x0)), MINIMAP_H);
    ctx.fillStyle = "#417690";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.fillText("whole trace", 6, MINIMAP_H / 2);
    this.minimapSpan = [first, last];
  }

  /** Span starts per minimap pixel over the whole trace; recomputed when the data changes. */
  minimapDensity(first, last) {
    const w = Math.floor(this.plotWidth);
    const key = `${this.model.version}:${w}:${first}:${Math.floor(last / 1e5)}`;
    if (this.density && this.densityKey === key) return this.density;
    const density = new Float64Array(w);
    const scale = w / (last - first || 1);
    for (const lane of this.model.lanes) {
      for (const row of lane.rows) {
        const start = row.start.data;
        for (let i = 0; i < row.count; i++) {
          const b = Math.min(w - 1, Math.max(0, Math.floor((start[i] - first) * scale)));
          density[b] += 1;
        }
      }
    }
    this.density = density;
    this.densityKey = key;
    return density;
  }

  // ------------------------------------------------------------------ finding things

  /** The lane and the span or instant under (x, y) in canvas coordinates, or null. */
  hit(x, y) {
    if (y < RULER_H) return null;
    const laneY = y - RULER_H + this.scroller.scrollTop;
    const tops = this.laneTops;
    let lo = 0;
    let hi = this.lanes.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (tops[mid + 1] <= laneY) lo = mid + 1;
      else hi = mid;
    }
    const lane = this.lanes[lo];
    if (!lane) return null;
    if (x < GUTTER) return { lane };
    const inLane = laneY - tops[lo];
    const t = this.tOf(x);
    const slop = (3 * (this.t1 - this.t0)) / this.plotWidth;
    if (inLane < 7 && lane.instants.count) {
      const row = lane.instants;
      const i = row.firstStartingAt(t - slop);
      if (i < row.count && row.start.data[i] <= t + slop) {
        return { lane, kind: "instant", row, index: i };
      }
    }
    const depth = Math.floor(inLane / ROW_H);
    const row = lane.rows[depth];
    if (!row) return { lane };
    const now = this.now();
    // The last span starting at or before t + slop; it is hit when it ends after t - slop.
    const i = row.firstStartingAt(t + slop) - 1;
    if (i >= 0) {
      const end = row.end.data[i] === Infinity ? now : row.end.data[i];
      if (end >= t - slop) return { lane, kind: "span", row, index: i, end };
    }
    return { lane };
  }

  /** Per base name: spans and time inside [t0, t1] (clipped), over the lanes shown. */
  rangeStats(t0, t1) {
    const now = this.now();
    const stats = new Map(); // "kind\u0000name" -> {lane kind, name, count, total}
    for (const lane of this.lanes) {
      for (const row of lane.rows) {
        const start = row.start.data;
        const end = row.end.data;
        for (let i = row.firstEndingAfter(t0); i < row.count && start[i] <= t1; i++) {
          const e = end[i] === Infinity ? now : end[i];
          const clipped = Math.min(e, t1) - Math.max(start[i], t0);
          if (clipped < 0) continue;
          const name = this.model.names[row.name.data[i]];
          const key = `${lane.kind}\u0000${name}`;
          let entry = stats.get(key);
          if (!entry) stats.set(key, (entry = { lane: lane.kind, name, count: 0, total: 0 }));
          entry.count += 1;
          entry.total += clipped;
        }
      }
    }
    return [...stats.values()].sort((a, b) => b.total - a.total);
  }

  // ------------------------------------------------------------------ input

  bind() {
    const canvas = this.canvas;
    new ResizeObserver(() => this.resize()).observe(this.scroller);
    this.scroller.addEventListener("scroll", () => this.invalidate());
    canvas.addEventListener("wheel", (event) => {
      if (event.shiftKey) return; // the native vertical scroll of the lanes
      event.preventDefault();
      const rect = canvas.getBoundingClientRect();
      if (Math.abs(event.deltaX) > Math.abs(event.deltaY)) {
        this.pan(event.deltaX);
      } else {
        const scale = event.deltaMode === 1 ? 0.05 : 0.002; // lines or pixels
        this.zoom(Math.exp(event.deltaY * scale), event.clientX - rect.left);
      }
    }, { passive: false });
    let drag = null;
    canvas.addEventListener("pointerdown", (event) => {
      const rect = canvas.getBoundingClientRect();
      const x = event.clientX - rect.left;
      const y = event.clientY - rect.top;
      canvas.setPointerCapture(event.pointerId);
      const selecting = event.shiftKey || y < RULER_H;
      drag = { x, y, lastX: x, lastY: y, moved: false, selecting, t: this.tOf(x) };
    });
    canvas.addEventListener("pointermove", (event) => {
      const rect = canvas.getBoundingClientRect();
      const x = event.clientX - rect.left;
      const y = event.clientY - rect.top;
      if (!drag) {
        if (this.hooks.onHover) this.hooks.onHover(this.hit(x, y), event.clientX, event.clientY);
        return;
      }
      if (Math.abs(x - drag.x) + Math.abs(y - drag.y) > 3) drag.moved = true;
      if (drag.selecting) {
        const t = this.tOf(x);
        this.range = [Math.min(drag.t, t), Math.max(drag.t, t)];
        this.invalidate();
      } else {
        this.pan(drag.lastX - x);
        this.scroller.scrollTop += drag.lastY - y;
      }
      drag.lastX = x;
      drag.lastY = y;
    });
    canvas.addEventListener("pointerup", (event) => {
      const rect = canvas.getBoundingClientRect();
      const finished = drag;
      drag = null;
      if (!finished) return;
      if (finished.selecting && finished.moved) {
        if (this.hooks.onRange) this.hooks.onRange(this.range);
        return;
      }
      if (!finished.moved) {
        const found = this.hit(event.clientX - rect.left, event.clientY - rect.top);
        this.selectedLane = found ? found.lane : null;
        if (this.hooks.onLane) this.hooks.onLane(this.selectedLane);
        this.invalidate();
      }
    });
    canvas.addEventListener("pointerleave", () => this.hooks.onHover && this.hooks.onHover(null));
    canvas.addEventListener("dblclick", (event) => {
      const rect = canvas.getBoundingClientRect();
      const found = this.hit(event.clientX - rect.left, event.clientY - rect.top);
      if (found && found.kind === "span") {
        const start = found.row.start.data[found.index];
        const pad = Math.max(0.5, (found.end - start) * 0.1);
        this.setWindow(start - pad, found.end + pad);
      }
    });
    // Perfetto's keys: W/S zoom in/out, A/D pan, held down for a smooth move.
    canvas.tabIndex = 0;
    canvas.addEventListener("keydown", (event) => {
      const key = event.key.toLowerCase();
      if ("wasd".includes(key) && key.length === 1 && !event.ctrlKey && !event.metaKey) {
        event.preventDefault();
        this.keys.add(key);
        this.invalidate();
      } else if (event.key === "Escape") {
        this.range = null;
        if (this.hooks.onRange) this.hooks.onRange(null);
        this.invalidate();
      }
    });
    canvas.addEventListener("keyup", (event) => this.keys.delete(event.key.toLowerCase()));
    canvas.addEventListener("blur", () => this.keys.clear());
    let minimapDrag = false;
    const moveTo = (event) => {
      if (!this.minimapSpan) return;
      const rect = this.minimap.getBoundingClientRect();
      const [first, last] = this.minimapSpan;
      const t = first + ((event.clientX - rect.left - GUTTER) / this.plotWidth) * (last - first);
      const half = (this.t1 - this.t0) / 2;
      this.setWindow(t - half, t + half);
    };
    this.minimap.addEventListener("pointerdown", (event) => {
      minimapDrag = true;
      this.minimap.setPointerCapture(event.pointerId);
      moveTo(event);
    });
    this.minimap.addEventListener("pointermove", (event) => minimapDrag && moveTo(event));
    this.minimap.addEventListener("pointerup", () => { minimapDrag = false; });
  }

  stepKeys() {
    if (!this.keys.size) return;
    const centre = GUTTER + this.plotWidth / 2;
    if (this.keys.has("w")) this.zoom(0.92, centre);
    if (this.keys.has("s")) this.zoom(1 / 0.92, centre);
    if (this.keys.has("a")) this.pan(-this.plotWidth * 0.03);
    if (this.keys.has("d")) this.pan(this.plotWidth * 0.03);
  }
}

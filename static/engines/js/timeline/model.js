// The timeline's data: lanes of spans and instants in typed columns, built from a saved Chrome
// trace or, live, from the recorder's raw calls paired by the dump's rules
// (engines/runtime/telemetry/trace_recorder.py; chrome_trace_reference.py states them plainly).

const COUNTER = /^(.*) \((\d+)\)$/;

/** A typed array that grows by doubling. */
class Column {
  constructor(Type, capacity = 64) {
    this.Type = Type;
    this.data = new Type(capacity);
    this.length = 0;
  }

  push(value) {
    if (this.length === this.data.length) {
      const grown = new this.Type(this.data.length * 2);
      grown.set(this.data);
      this.data = grown;
    }
    this.data[this.length++] = value;
    return this.length - 1;
  }
}

/**
 * Spans of one nesting depth of one lane, in start order. Spans at one depth never overlap, so
 * their ends are in order too: both can be binary-searched.
 */
export class Row {
  constructor() {
    this.start = new Column(Float64Array);
    this.end = new Column(Float64Array); // Infinity while open
    this.name = new Column(Int32Array); // base name id (colour, legend)
    this.counter = new Column(Int32Array); // the n of "X (n)", -1 for none
    this.arg = new Column(Int32Array); // index into the model's args, -1 for none
  }

  get count() {
    return this.start.length;
  }

  add(start, end, name, counter, arg) {
    this.start.push(start);
    this.end.push(end);
    this.name.push(name);
    this.counter.push(counter);
    return this.arg.push(arg);
  }

  /** First index whose end is at or after t (open spans end at Infinity). */
  firstEndingAfter(t) {
    const end = this.end.data;
    let lo = 0;
    let hi = this.count;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (end[mid] < t) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  /** First index at or after `from` whose start is at or after t. */
  firstStartingAt(t, from = 0) {
    const start = this.start.data;
    let lo = from;
    let hi = this.count;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (start[mid] < t) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
}

/** One lane: the engine's (tid 0) or a request's. */
export class Lane {
  constructor(key, label, kind) {
    this.key = key;
    this.label = label;
    this.kind = kind; // "engine" | "request" | a profile's lane name ("steps", "phases", "kernels")
    this.rows = [];
    this.instants = new Row(); // start = ts, end = ts
    this.openStack = []; // open spans, outermost first: {name, depth, index}
    this.starts = new Map(); // live pairing: base name -> B's so far
    this.first = Infinity;
    this.last = -Infinity;
    // What a summary needs, kept as events arrive (engines/history/analysis.py's rules).
    this.addedTs = null;
    this.addedArgs = null;
    this.arrivalTs = null; // the earliest "receive request" or queue start: the request's arrival
    this.firstTokenTs = null;
    this.finishTs = null;
    this.finishArgs = null;
    this.preemptions = 0;
    this.totals = new Map(); // base name -> total closed span time (µs)
  }

  row(depth) {
    while (this.rows.length <= depth) this.rows.push(new Row());
    return this.rows[depth];
  }

  touch(ts) {
    if (ts < this.first) this.first = ts;
    if (ts > this.last) this.last = ts;
  }

  arrive(ts) {
    if (this.arrivalTs === null || ts < this.arrivalTs) this.arrivalTs = ts;
  }
}

/** A request lane's summary: the fields of a saved trace's RequestSummary, from its events. */
export function laneSummary(lane, names) {
  if (lane.kind !== "request") return null;
  const finished = lane.finishTs !== null;
  const total = (base) => {
    const id = names.indexOf(base);
    const value = id >= 0 ? lane.totals.get(id) : undefined;
    return value !== undefined ? value : finished ? 0 : null;
  };
  const finishArgs = lane.finishArgs || {};
  const count = (v) => (Number.isInteger(v) && v >= 0 ? v : null);
  const prompt = count(finishArgs.prompt_tokens) ?? count((lane.addedArgs || {}).prompt_tokens);
  const completion = count(finishArgs.completion_tokens);
  const queueId = names.indexOf("queue");
  const decode = total("decode");
  // Counted from the arrival the server stamped (docs/metrics.md); an older trace has only the add.
  const arrival = lane.arrivalTs !== null ? lane.arrivalTs : lane.addedTs;
  return {
    request_id: lane.label,
    prompt_tokens: prompt,
    completion_tokens: completion,
    queue_us: queueId >= 0 && lane.totals.has(queueId) ? lane.totals.get(queueId) : null,
    ttft_us: arrival !== null && lane.firstTokenTs !== null ? lane.firstTokenTs - arrival : null,
    prefill_us: total("prefill"),
    decode_us: decode,
    e2e_us: arrival !== null && finished ? lane.finishTs - arrival : null,
    finish_reason: String(finishArgs.finish_reason || ""),
    preemptions: lane.preemptions,
    decode_tokens_per_s: completion && decode ? completion / (decode / 1e6) : null,
  };
}

export class TraceModel {
  constructor() {
    this.names = []; // base names, by id
    this.nameIds = new Map();
    this.args = []; // args objects (live) or source events (saved), by index
    this.argsAreEvents = false;
    this.lanes = []; // engine lane first, then requests in first-seen order
    this.laneByKey = new Map();
    this.requestLanes = new Map(); // request id -> lane (live pairing)
    this.engineLane = this.lane("1:0", "engine", "engine");
    this.first = Infinity;
    this.last = -Infinity;
    this.events = 0;
    this.orphans = 0;
    this.version = 0; // bumped on every change: views redraw and re-index when it moves
  }

  /** Forget everything (the engine restarted with a new recorder); views see a new version.
   * `epoch` (trace µs, optional): when that happened, the ruler's zero until an event comes. */
  reset(epoch = null) {
    const version = this.version;
    Object.assign(this, new TraceModel());
    this.version = version + 1;
    this.epoch = epoch;
  }

  /** The ruler's zero: the first event, or the restart before any came. */
  get origin() {
    return Number.isFinite(this.first) ? this.first : (this.epoch ?? null);
  }

  nameId(base) {
    let id = this.nameIds.get(base);
    if (id === undefined) {
      id = this.names.length;
      this.names.push(base);
      this.nameIds.set(base, id);
    }
    return id;
  }

  lane(key, label, kind) {
    let lane = this.laneByKey.get(key);
    if (!lane) {
      lane = new Lane(key, label, kind);
      lane.index = this.lanes.length; // a request's tid in the dump: its place after the engine lane
      this.laneByKey.set(key, lane);
      this.lanes.push(lane);
    }
    return lane;
  }

  touch(lane, ts) {
    lane.touch(ts);
    if (ts < this.first) this.first = ts;
    if (ts > this.last) this.last = ts;
  }

  begin(lane, ts, base, counter, arg) {
    const name = this.nameId(base);
    // One deeper than the innermost open span: a row never holds two overlapping spans, even
    // when an outer span closed before an inner one.
    const stack = lane.openStack;
    const depth = stack.length ? stack[stack.length - 1].depth + 1 : 0;
    const index = lane.row(depth).add(ts, Infinity, name, counter, arg);
    lane.openStack.push({ name, depth, index });
    this.touch(lane, ts);
    if (lane.kind === "request" && base === "queue" && counter === 0) lane.arrive(ts);
  }

  /** Close the most recent open span named `base`; false when none is open (an orphan). */
  end(lane, ts, base) {
    const name = this.nameIds.get(base);
    const stack = lane.openStack;
    for (let k = stack.length - 1; k >= 0; k--) {
      if (stack[k].name === name) {
        const { depth, index } = stack[k];
        stack.splice(k, 1);
        const row = lane.rows[depth];
        row.end.data[index] = ts;
        lane.totals.set(name, (lane.totals.get(name) || 0) + (ts - row.start.data[index]));
        this.touch(lane, ts);
        return true;
      }
    }
    return false;
  }

  instant(lane, ts, name, arg, args) {
    lane.instants.add(ts, ts, this.nameId(name), -1, arg);
    this.touch(lane, ts);
    if (lane.kind !== "request") return;
    if (name === "first token") {
      if (lane.firstTokenTs === null) lane.firstTokenTs = ts;
    } else if (name === "finish") {
      lane.finishTs = ts;
      lane.finishArgs = args;
    } else if (name === "request added to engine") {
      if (lane.addedTs === null) {
        lane.addedTs = ts;
        lane.addedArgs = args;
      }
    } else if (name === "receive request") {
      lane.arrive(ts);
    } else if (name === "preempt") {
      lane.preemptions += 1;
    }
  }

  /**
   * A saved trace: Chrome Trace Event Format, object or array form (B/E, X, i/I, M). With
   * `requests: false` (a profile's steps, phases and kernels) no lane is a request's: each
   * lane's kind is its own name, so none gets a request's summary, search or filters, and the
   * range statistics name the lane.
   */
  addChromeTrace(trace, { requests = true } = {}) {
    const events = Array.isArray(trace) ? trace : trace.traceEvents;
    if (!Array.isArray(events)) throw new Error('not a Chrome trace: no "traceEvents" list');
    this.argsAreEvents = true;
    this.args = events;
    const labels = new Map();
    for (const ev of events) {
      if (ev && ev.ph === "M" && ev.name === "thread_name" && ev.args) labels.set(`${ev.pid}:${ev.tid}`, String(ev.args.name));
    }
    // The engine lane made up front is the trace's 1:0: it takes that lane's name ("engine", or in
    // a fleet's merged trace "<engine> @ <server>").
    if (labels.has(this.engineLane.key)) this.engineLane.label = labels.get(this.engineLane.key);
    let lastKey = null;
    let lane = null;
    for (let i = 0; i < events.length; i++) {
      const ev = events[i];
      if (!ev || typeof ev.ts !== "number") continue;
      const ph = ev.ph;
      if (ph === "M") continue;
      const key = `${ev.pid}:${ev.tid}`;
      if (key !== lastKey) {
        lane = this.laneByKey.get(key);
        if (!lane) {
          const label = labels.get(key) ?? `tid ${ev.tid}`;
          const kind = !requests ? label : ev.tid === 0 || label === "engine" ? "engine" : "request";
          lane = this.lane(key, label, kind);
        }
        lastKey = key;
      }
      this.events += 1;
      const name = String(ev.name);
      if (ph === "B" || ph === "X") {
        const match = COUNTER.exec(name);
        const base = match ? match[1] : name;
        this.begin(lane, ev.ts, base, match ? Number(match[2]) : -1, i);
        if (ph === "X") this.end(lane, ev.ts + (typeof ev.dur === "number" ? ev.dur : 0), base);
      } else if (ph === "E") {
        const match = COUNTER.exec(name);
        if (!this.end(lane, ev.ts, match ? match[1] : name)) this.orphans += 1;
      } else if (ph === "i" || ph === "I") {
        this.instant(lane, ev.ts, name, i, ev.args || null);
      }
    }
    // A trace of another process (a profile's kernels) has no engine lane: drop the empty one.
    if (this.engineLane.first === Infinity && this.lanes.length > 1) {
      this.lanes.splice(this.lanes.indexOf(this.engineLane), 1);
      this.lanes.forEach((l, index) => { l.index = index; });
    }
    this.version += 1;
  }

  /**
   * Live: the recorder's calls ([ts_us, [request ids], event, args, engine_lane]) paired as the
   * dump pairs them: a request's lane appears where its id is first seen, "start X" opens
   * "X (n)", "finish X" closes the latest open X of its lane, anything else is an instant, and a
   * batch event also goes once to the engine lane with the batch's request_tids.
   */
  addCalls(calls) {
    for (const [ts, ids, event, rawArgs, onEngineLane] of calls) {
      const args = rawArgs || {};
      const arg = this.args.push(args) - 1;
      const kind = classify(String(event));
      for (const id of ids) {
        let lane = this.requestLanes.get(id);
        if (!lane) {
          lane = this.lane(`1:${this.requestLanes.size + 1}`, id, "request");
          this.requestLanes.set(id, lane);
        }
        this.apply(lane, ts, kind, arg, args);
      }
      if (onEngineLane) {
        const tids = ids.map((id) => this.requestLanes.get(id).index);
        const engineArgs = { request_tids: tids, ...args };
        this.apply(this.engineLane, ts, kind, this.args.push(engineArgs) - 1, engineArgs);
      }
    }
    if (calls.length) this.version += 1;
  }

  apply(lane, ts, [ph, base], arg, args) {
    this.events += 1;
    if (ph === "B") {
      const counter = lane.starts.get(base) || 0;
      lane.starts.set(base, counter + 1);
      this.begin(lane, ts, base, counter, arg);
    } else if (ph === "E") {
      if (!this.end(lane, ts, base)) {
        this.orphans += 1;
        this.events -= 1; // the dump omits it
      }
    } else {
      this.instant(lane, ts, base, arg, args);
    }
  }

  /** The args of a span or instant (as the dump writes them). */
  argsOf(arg) {
    if (arg < 0) return {};
    const value = this.args[arg];
    return (this.argsAreEvents ? value.args : value) || {};
  }

  /** A span's full name as the dump writes it ("decode (3)"). */
  spanName(name, counter) {
    return counter >= 0 ? `${this.names[name]} (${counter})` : this.names[name];
  }

  /**
   * Every span as [lane label, name, start, end] (open spans end at `now`), lane by lane, in
   * start order: what tests compare with a dump.
   */
  spans(now = this.last) {
    const out = [];
    for (const lane of this.lanes) {
      for (const row of lane.rows) {
        for (let i = 0; i < row.count; i++) {
          const end = row.end.data[i];
          out.push([lane.label, this.spanName(row.name.data[i], row.counter.data[i]), row.start.data[i],
            end === Infinity ? now : end]);
        }
      }
      for (let i = 0; i < lane.instants.count; i++) {
        out.push([lane.label, this.names[lane.instants.name.data[i]], lane.instants.start.data[i], null]);
      }
    }
    return out;
  }
}

function classify(event) {
  if (event.startsWith("start ") && event.length > 6) return ["B", event.slice(6)];
  if (event.startsWith("finish ") && event.length > 7) return ["E", event.slice(7)];
  return ["i", event];
}

// Numbers the way a person reads them: units, a few significant digits, never 17 of them.

const grouped = new Intl.NumberFormat(undefined, { maximumFractionDigits: 0 });

export function count(value) {
  return value == null || Number.isNaN(value) ? "–" : grouped.format(value);
}

export function rate(value) {
  if (value == null || Number.isNaN(value)) return "–";
  return value >= 100 ? grouped.format(value) : value.toFixed(1);
}

export function seconds(value) {
  if (value == null || Number.isNaN(value)) return "–";
  if (value === 0) return "0";
  if (value < 1) return `${(value * 1000).toPrecision(3)} ms`;
  return `${value.toPrecision(3)} s`;
}

const short = new Intl.NumberFormat(undefined, { notation: "compact", maximumFractionDigits: 1 });

/** An axis label: "950", "1.2K", "20K", "0.25" (a few characters, whatever the magnitude). */
export function compact(value) {
  if (value == null || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return short.format(value);
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 10 ? value.toFixed(0) : String(Number(value.toPrecision(2)));
}

/** A wall-clock time from Unix seconds, "HH:MM:SS" on a 24-hour clock in the viewer's time zone. */
export function clock(unixSeconds) {
  if (unixSeconds == null || Number.isNaN(unixSeconds)) return "–";
  const d = new Date(unixSeconds * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}

/** The window a "now" figure is over, as its label says it: "last 5 s" (`metrics.now.window_s`). */
export function lastSeconds(seconds) {
  return `last ${compact(seconds)} s`;
}

export function percent(fraction) {
  return fraction == null || Number.isNaN(fraction) ? "–" : `${(fraction * 100).toFixed(1)} %`;
}

/** A metric's value by its key's meaning: times in seconds, ratios, counts, rates. */
export function metric(key, value) {
  if (typeof value !== "number") return String(value);
  if (key.endsWith("_per_s")) return `${rate(value)} tok/s`;
  if (key.endsWith("_s") || key.endsWith("_time_sum") || key.startsWith("mean{")) return seconds(value);
  if (key.endsWith("_rate") || key.endsWith("_usage")) return percent(value);
  return Number.isInteger(value) ? count(value) : value.toPrecision(4);
}

/** Engine state as shown: "running", "running, slow to answer", "restarting (why)", "dead (why, restarts N)". */
export function state(snapshot) {
  if (snapshot.draining) return "draining (the server is shutting down)";
  const s = snapshot.state;
  if (s === "dead") return `dead (${snapshot.reason || "unknown"}, restarts ${snapshot.restarts})`;
  if (s === "restarting") return `restarting (${snapshot.reason || "unknown"})`;
  const shown = s === "running" && snapshot.slow ? "running, slow to answer" : s;
  return snapshot.restarts ? `${shown} (restarts ${snapshot.restarts})` : shown;
}

/** The state a badge is coloured by: the engine's, or "slow" while it runs but does not answer. */
export function stateKind(snapshot) {
  if (snapshot.draining) return "draining";
  return snapshot.state === "running" && snapshot.slow ? "slow" : snapshot.state;
}

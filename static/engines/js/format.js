// Numbers the way a person reads them: units, a few significant digits, never 17 of them; and
// times in one format across the product.

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

// ---------------------------------------------------------------------------------- times

// One format for every time the product shows, the one its admin pages print (Django's
// DATETIME_FORMAT, debugsite/formats): "2026-12-01 20:02:56", 24-hour, or "20:02:56" where only the
// time of day matters; in the site's time zone, which the admin's base page names
// (<meta name="time-zone">; the browser's own on a page that does not).

/** The site's time zone (an IANA name), or undefined for the browser's own. */
export const timeZone = document.querySelector('meta[name="time-zone"]')?.content || undefined;

const clockFormat = new Intl.DateTimeFormat("en-GB", {
  timeZone, hourCycle: "h23", year: "numeric", month: "2-digit", day: "2-digit",
  hour: "2-digit", minute: "2-digit", second: "2-digit",
});

/** Unix seconds -> {date: "2026-12-01", minute: "20:02", second: "20:02:56"} in the site's zone. */
export function clock(epochSeconds) {
  const p = Object.fromEntries(clockFormat.formatToParts(new Date(epochSeconds * 1000))
    .map(({ type, value }) => [type, value]));
  const minute = `${p.hour}:${p.minute}`;
  return { date: `${p.year}-${p.month}-${p.day}`, minute, second: `${minute}:${p.second}` };
}

/** "2026-12-01 20:02:56" (Unix seconds; a dash for none). */
export function dateTime(epochSeconds) {
  if (epochSeconds == null || !Number.isFinite(epochSeconds)) return "–";
  const c = clock(epochSeconds);
  return `${c.date} ${c.second}`;
}

/** "20:02:56" (Unix seconds; a dash for none). */
export function timeOfDay(epochSeconds) {
  return epochSeconds == null || !Number.isFinite(epochSeconds) ? "–" : clock(epochSeconds).second;
}

/** A uPlot time axis's labels (its `values`): hours and minutes, with seconds when the ticks are
 * under a minute apart, and the date under the first tick and under each new day (uPlot's own
 * are 12-hour, "8:00pm 12/1/26"). */
export function timeTicks(u, splits, axisIdx, space, increment) {
  let day = null;
  return splits.map((ts) => {
    const c = clock(ts);
    const time = increment < 60 ? c.second : c.minute;
    const label = c.date !== day ? `${time}\n${c.date}` : time;
    day = c.date;
    return label;
  });
}

/** uPlot's `tzDate`: ticks fall on the site's round minutes and hours, not the browser's. */
export function zonedDate(epochSeconds) {
  const date = new Date(epochSeconds * 1000);
  return timeZone && window.uPlot ? uPlot.tzDate(date, timeZone) : date;
}

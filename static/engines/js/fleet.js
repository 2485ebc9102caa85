// The fleet page: every server and every engine of the fleet in one grid, from the fleet socket's
// view once a second. Rows are kept by key and only the cells that changed are written, so a grid
// of 100 servers x 4 engines redraws in a few milliseconds.
import * as fmt from "./format.js";
import { connect } from "./live.js";

const body = document.getElementById("fleet-body");
const groupSelect = document.getElementById("fleet-group");
const filterInput = document.getElementById("fleet-filter");
const summary = document.getElementById("fleet-summary");
const notice = document.getElementById("fleet-notice");
const CELLS = ["state", "load", "kv", "prefill", "decode", "ttft", "itl", "age"];
const LIVE_CELLS = ["load", "kv", "prefill", "decode", "ttft", "itl"];
const rowEls = new Map(); // "server\u0000engine" -> {tr, cells}
const groupEls = new Map(); // group key -> tr
const selected = new Set(); // row keys of the engines the next job acts on
let latest = null;

function cell(text, className) {
  const td = document.createElement("td");
  if (className) td.className = className;
  td.textContent = text;
  return td;
}

function set(td, text, title) {
  if (td.textContent !== text) td.textContent = text;
  const t = title || "";
  if (td.title !== t) td.title = t;
}

/** A figure, or "not exported" (never 0) when the server has no name for it. */
function figure(row, quantity, format) {
  if (row.not_exported.includes(quantity)) return ["n/e", "not exported by this server"];
  return [format(row.figures[quantity]), ""];
}

function pair(row, quantity) {
  if (row.not_exported.includes(quantity)) return ["n/e", "not exported by this server"];
  const p50 = row.figures[`${quantity}_p50`];
  const p99 = row.figures[`${quantity}_p99`];
  return [`${fmt.seconds(p50)} / ${fmt.seconds(p99)}`, ""];
}

function age(seconds) {
  if (seconds == null) return "–";
  return seconds < 10 ? `${seconds.toFixed(1)} s` : `${Math.round(seconds)} s`;
}

/** Where an engine's name leads: its page on its own server (ours), or its server (foreign). */
function engineLink(row, server) {
  if (!server) return "";
  return (server.engine_pages || {})[row.engine] || (server.kind !== "ours" ? server.url : "");
}

/** What an engine of ours computes with, as its server's card says (null: a foreign or older server). */
function engineWeights(row, server) {
  return (server && (server.engine_weights || {})[row.engine]) || null;
}

/**
 * The row of one engine; under its name, its model (grouped by server) or its server (by model),
 * then the weights it holds in memory ("Q4_1 x210, Q8_0 x1": a GGUF kept in its types; "float32").
 */
function rowFor(key, row, under, link, weights) {
  let entry = rowEls.get(key);
  if (!entry) {
    const tr = document.createElement("tr");
    tr.className = "fleet-row";
    const pick = document.createElement("td");
    pick.className = "fleet-pick";
    const box = document.createElement("input");
    box.type = "checkbox";
    box.addEventListener("change", () => {
      if (box.checked) selected.add(key);
      else selected.delete(key);
      showSelection();
    });
    pick.append(box);
    const th = document.createElement("th");
    th.scope = "row";
    tr.append(pick, th);
    const cells = {};
    for (const name of CELLS) {
      const td = cell(name === "state" ? "" : "–", name === "state" ? "" : "num");
      td.dataset.field = name;
      tr.append(td);
      if (name === "state") {
        const badge = document.createElement("span");
        badge.className = "state";
        td.append(badge);
        cells[name] = badge;
      } else {
        cells[name] = td;
      }
    }
    const last = document.createElement("div");
    last.className = "help fleet-last";
    last.hidden = true;
    entry = { tr, th, cells, box, last, label: "" };
    rowEls.set(key, entry);
  }
  const inMemory = weights ? weights.in_memory : "";
  const label = `${row.engine}\u0000${under}\u0000${link}\u0000${inMemory}\u0000${weights ? weights.stored : ""}`;
  if (entry.label !== label) {
    entry.th.replaceChildren();
    const name = document.createElement(link ? "a" : "span");
    if (link) {
      name.href = link;
      name.title = link;
    }
    name.textContent = row.engine || "(no engine)";
    entry.th.append(name);
    if (under && under !== row.engine) {
      const help = document.createElement("div");
      help.className = "help model-name";
      help.textContent = under;
      entry.th.append(help);
    }
    if (inMemory) {
      const held = document.createElement("div");
      held.className = "help fleet-weights";
      held.textContent = `weights ${inMemory}`;
      held.title = "the weights in memory, as the engine computes with them" +
        (weights.stored ? ` (stored as ${weights.stored})` : "");
      entry.th.append(held);
    }
    entry.th.append(entry.last);
    entry.label = label;
  }
  entry.tr.dataset.server = row.server;
  entry.tr.dataset.engine = row.engine;
  entry.box.checked = selected.has(key);
  entry.box.disabled = !row.engine;
  return entry;
}

/** Whether a row's figures are live: its server is up (a gone, stopped or unreachable one's are not). */
function isLive(server) {
  return server != null && server.state === "up";
}

/** A row's last figures, for a server that is no longer up: when they were read, then each figure. */
function lastFigures(row) {
  const has = (q) => !row.not_exported.includes(q) && row.figures[q] != null;
  const parts = [];
  if (has("running")) parts.push(`${fmt.count(row.figures.running)} running`);
  if (has("waiting")) parts.push(`${fmt.count(row.figures.waiting)} waiting`);
  if (has("kv_usage")) parts.push(`KV ${fmt.percent(row.figures.kv_usage)}`);
  if (has("prompt_tokens")) parts.push(`prefill ${fmt.rate(row.figures.prompt_tokens)} tok/s`);
  if (has("generation_tokens")) parts.push(`decode ${fmt.rate(row.figures.generation_tokens)} tok/s`);
  return [`as of ${fmt.timeOfDay(row.at)}`, ...parts];
}

/** Show `parts` in `line`, "first: a · b · c", each part kept on one line. */
function showParts(line, parts) {
  const text = parts.join("\u0000");
  if (line.dataset.text === text) return;
  line.dataset.text = text;
  line.replaceChildren();
  parts.forEach((part, i) => {
    if (i) line.append(i === 1 ? ": " : " · ");
    const span = document.createElement("span");
    span.className = "fleet-part";
    span.textContent = part;
    line.append(span);
  });
}

function fill(entry, row, now, server) {
  const c = entry.cells;
  const live = isLive(server);
  const state = server && server.state !== "up" ? server.state : row.state;
  set(c.state, state, row.error || "");
  c.state.dataset.state = state === "up" ? "running" : state;
  entry.tr.dataset.live = live ? "yes" : "no";
  const ghost = !live && !row.error;
  entry.last.hidden = !ghost;
  if (ghost) {
    showParts(entry.last, lastFigures(row));
    entry.last.title = "the last figures its server published; they count in no total";
  }
  if (row.error) {
    for (const name of LIVE_CELLS) set(c[name], "–", row.error);
  } else if (!live) {
    for (const name of LIVE_CELLS) set(c[name], "", `no live figure: the server is ${state}`);
  } else {
    const load = row.not_exported.includes("running") ? ["n/e", "not exported by this server"]
      : [`${fmt.count(row.figures.running)} / ${fmt.count(row.figures.waiting)}`, ""];
    set(c.load, ...load);
    set(c.kv, ...figure(row, "kv_usage", fmt.percent));
    set(c.prefill, ...figure(row, "prompt_tokens", fmt.rate));
    set(c.decode, ...figure(row, "generation_tokens", fmt.rate));
    set(c.ttft, ...pair(row, "ttft"));
    set(c.itl, ...pair(row, "itl"));
  }
  const stale = now - row.at;
  set(c.age, age(stale), `read ${fmt.timeOfDay(row.at)}`);
  entry.tr.dataset.stale = stale > 5 ? "yes" : "no";
}

function groupRow(key, text, detail, state, title = "") {
  let tr = groupEls.get(key);
  if (!tr) {
    tr = document.createElement("tr");
    tr.className = "fleet-group";
    const th = document.createElement("th");
    th.colSpan = CELLS.length + 2;
    th.scope = "rowgroup";
    tr.append(th);
    groupEls.set(key, tr);
  }
  const th = tr.firstChild;
  const wanted = `${text}\u0000${detail}\u0000${state || ""}\u0000${title}`;
  if (tr.dataset.text !== wanted) {
    th.replaceChildren();
    const name = document.createElement("span");
    name.className = "fleet-group-name";
    name.textContent = text;
    th.append(name);
    if (state) {
      const badge = document.createElement("span");
      badge.className = "state";
      badge.dataset.state = state === "up" ? "running" : state;
      badge.textContent = state;
      badge.title = title;
      th.append(" ", badge);
    }
    const help = document.createElement("span");
    help.className = "help fleet-group-detail";
    help.textContent = detail;
    th.append(" ", help);
    tr.dataset.text = wanted;
  }
  return tr;
}

/** Seconds as the liveness rule states them: "3 s", "0.3 s". */
function secs(value) {
  return `${Number(value.toPrecision(3))} s`;
}

/** When a server of ours counts as gone, as the view's heartbeat and grace say. */
function goneRule(view) {
  return `no beat for ${secs(view.heartbeat_s + view.grace_s)} ` +
    `(a heartbeat of ${secs(view.heartbeat_s)} + ${secs(view.grace_s)} grace)`;
}

/** A server of ours' state badge's tooltip: its last beat, and when it would be gone. */
function beatTitle(s, view) {
  if (s.kind !== "ours" || s.last_seen == null) return "";
  const last = s.state === "up" ? `last beat ${age(s.age_s)} ago` : `last beat at ${fmt.timeOfDay(s.last_seen)}`;
  return `${last}; a server is gone after ${goneRule(view)}`;
}

function serverDetail(s, now) {
  const parts = [s.kind + (s.version ? ` ${s.version}` : "")];
  if (s.roles && s.roles.length) parts.push(s.roles.join(", "));
  if (s.url) parts.push(s.url);
  if (s.state === "gone" || s.state === "stopped") {
    parts.push(`last seen ${age(s.age_s)} ago (${fmt.timeOfDay(s.last_seen)})`);
  }
  if (s.error) parts.push(s.error);
  const missing = Object.keys(s.missing_controls || {});
  if (missing.length) parts.push(`no ${missing.join(", ")}`);
  return parts.join(" · ");
}

// Render timings, read by bench/fleet.py (the last 200).
window.fleetStats = { renders: [] };

function render() {
  if (!latest) return;
  const started = performance.now();
  renderView(latest);
  const renders = window.fleetStats.renders;
  renders.push(performance.now() - started);
  if (renders.length > 200) renders.shift();
}

function renderView(view) {
  const now = view.at;
  const servers = new Map(view.servers.map((s) => [s.server, s]));
  const needle = filterInput.value.trim().toLowerCase();
  const matches = (row, server) => !needle || [row.engine, row.model, row.server, server && server.name,
    (engineWeights(row, server) || {}).in_memory].some((text) => text && text.toLowerCase().includes(needle));
  const byModel = groupSelect.value === "model";
  const shownRows = view.rows.filter((row) => matches(row, servers.get(row.server)));
  const withRows = new Set(shownRows.map((row) => row.server));
  const shownServers = view.servers.filter((s) => !needle || withRows.has(s.server) ||
    s.name.toLowerCase().includes(needle));
  const groups = new Map();
  if (!byModel) {
    for (const s of shownServers) groups.set(s.server, { header: s, rows: [] });
  }
  for (const row of shownRows) {
    const key = byModel ? (row.model || row.engine) : row.server;
    if (!groups.has(key)) groups.set(key, { header: null, rows: [] });
    groups.get(key).rows.push(row);
  }
  const wanted = [];
  const seen = new Set();
  for (const [key, group] of [...groups].sort((a, b) => a[0].localeCompare(b[0]))) {
    const s = group.header;
    const head = byModel
      ? groupRow(`m:${key}`, key, `${group.rows.length} engine(s)`, null)
      : groupRow(`s:${key}`, s ? s.name : key, s ? serverDetail(s, now) : "", s ? s.state : null,
        s ? beatTitle(s, view) : "");
    wanted.push(head);
    seen.add(head);
    for (const row of group.rows.sort((a, b) => (a.server + a.engine).localeCompare(b.server + b.engine))) {
      const rowKey = `${row.server}\u0000${row.engine}`;
      const server = servers.get(row.server);
      const entry = rowFor(rowKey, row, byModel ? (server ? server.name : row.server) : row.model,
        engineLink(row, server), engineWeights(row, server));
      fill(entry, row, now, server);
      entry.tr.classList.toggle("in-model-group", byModel);
      wanted.push(entry.tr);
      seen.add(entry.tr);
    }
  }
  // Reorder only when the order changed (a steady grid touches no node).
  const current = [...body.children];
  if (current.length !== wanted.length || current.some((el, i) => el !== wanted[i])) body.replaceChildren(...wanted);
  for (const [key, entry] of rowEls) if (!seen.has(entry.tr)) rowEls.delete(key);
  for (const [key, tr] of groupEls) if (!seen.has(tr)) groupEls.delete(key);
  renderTotals(view, shownRows.filter((row) => isLive(servers.get(row.server))), shownServers, needle);
}

function quantile(q) {
  if (!q || q.value == null) return "–";
  return fmt.seconds(q.value);
}

function quantileTitle(q) {
  if (!q || q.value == null) return "no request in the last minute";
  const high = q.high == null ? "above the largest bucket" : fmt.seconds(q.high);
  return `between ${fmt.seconds(q.low)} and ${high} (the servers' buckets); ${fmt.count(q.count)} observations`;
}

/** A quantity summed over rows, as the fleet's totals define it: the rows that report it. */
function sum(rows, quantity) {
  let total = 0;
  for (const row of rows) {
    const value = row.figures[quantity];
    if (value != null && Number.isFinite(value) && !row.not_exported.includes(quantity)) total += value;
  }
  return total;
}

/**
 * The totals row, summed from the rows on screen whose servers are up (so that it always equals
 * the sum of the figures shown beside it, pushes between views included). The percentiles are
 * the server's: they need every engine's histogram, which stays server-side.
 */
function renderTotals(view, liveRows, shownServers, needle) {
  const total = (name) => document.querySelector(`[data-total="${name}"]`);
  const up = shownServers.filter((s) => s.state === "up").length;
  set(total("servers"), `${up} / ${shownServers.length}`);
  set(total("engines"), fmt.count(liveRows.length));
  set(total("load"), `${fmt.count(sum(liveRows, "running"))} / ${fmt.count(sum(liveRows, "waiting"))}`);
  set(total("prefill"), fmt.rate(sum(liveRows, "prompt_tokens")));
  set(total("decode"), fmt.rate(sum(liveRows, "generation_tokens")));
  document.getElementById("fleet-totals-caption").textContent =
    needle ? `Totals of the engines shown (filter “${needle}”)` : "Fleet totals";
  const q = view.totals.quantiles;
  const whose = needle ? "the whole fleet's, not only the engines shown: " : "";
  set(total("ttft"), `${quantile(q.ttft_p50)} / ${quantile(q.ttft_p99)}`, whose + quantileTitle(q.ttft_p99));
  set(total("itl"), `${quantile(q.itl_p50)} / ${quantile(q.itl_p99)}`, whose + quantileTitle(q.itl_p99));
  set(document.getElementById("fleet-liveness"),
    `Servers of ours beat every ${secs(view.heartbeat_s)}; one is gone after ${goneRule(view)}: ` +
    "its live columns go blank, its last figures stay under its engines' names, greyed, as of their " +
    "reading, and count in no total. A server back on its URL takes its own place.");
  const where = view.shared ? `fleet “${view.fleet}”, shared over Redis` : "this server alone (no REDIS_URL)";
  summary.textContent = `${view.servers.length} server(s), ${view.rows.length} engine(s) · ${where} · ` +
    `as of ${fmt.timeOfDay(view.at)}`;
}

function onMessage(message) {
  if (message.type === "fleet") {
    latest = message;
    notice.hidden = true;
    document.body.dataset.feed = "live";
    render();
  } else if (message.type === "fleet_rows" && latest) {
    // Rows servers published since the last view: replace those, keep the rest.
    const fresh = new Map(message.rows.map((row) => [`${row.server}\u0000${row.engine}`, row]));
    latest.rows = latest.rows.map((row) => fresh.get(`${row.server}\u0000${row.engine}`) || row);
    latest.at = message.at;
    render();
  } else if (message.type === "fleet_unavailable") {
    notice.hidden = false;
    notice.textContent = `The live feed is interrupted: ${message.error}. The figures below are from ` +
      (latest ? fmt.timeOfDay(latest.at) : "nowhere yet") + "; retrying every second.";
    document.body.dataset.feed = "interrupted";
  } else if (message.type === "error") {
    notice.hidden = false;
    notice.textContent = message.error;
  }
}

// ------------------------------------------------------------------ jobs across the fleet

const jobPanel = document.getElementById("fleet-job");
const jobBody = document.getElementById("fleet-job-body");
const jobTitle = document.getElementById("fleet-job-title");
const buttons = [...document.querySelectorAll("#fleet-actions button[data-action]")];

function showSelection() {
  const n = selected.size;
  document.getElementById("fleet-selected").textContent =
    n ? `${n} engine${n === 1 ? "" : "s"} selected` : "no engine selected";
  for (const button of buttons) button.disabled = n === 0;
}

document.getElementById("fleet-pick-all").addEventListener("change", (event) => {
  for (const [key, entry] of rowEls) {
    if (!entry.tr.isConnected || entry.box.disabled) continue;
    if (event.target.checked) selected.add(key);
    else selected.delete(key);
    entry.box.checked = event.target.checked;
  }
  showSelection();
});

function showJob(job) {
  jobPanel.hidden = false;
  const finished = job.finished_at != null;
  const errors = job.targets.filter((t) => t.state === "error").length;
  jobTitle.textContent = `Job #${job.id}: ${job.action} on ${job.targets.length} engine(s) · ` +
    (finished ? `finished, ${errors ? `${errors} failed` : "all done"}` : "running…");
  jobBody.replaceChildren(...job.targets.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.state = t.state;
    const badge = document.createElement("span");
    badge.className = "state";
    badge.dataset.state = { done: "running", error: "dead", pending: "waiting", ack: "slow", progress: "slow" }[t.state];
    badge.textContent = t.state;
    const stateCell = cell("");
    stateCell.append(badge);
    tr.append(cell(t.server_name || t.server), cell(t.engine), stateCell, cell(t.message));
    return tr;
  }));
  const merged = document.getElementById("fleet-job-timeline");
  const saved = job.targets.some((t) => t.state === "done" && t.result && t.result.record_id != null);
  merged.hidden = !(finished && job.action === "save_trace" && saved);
  merged.querySelector("a").href = `${form.dataset.jobs}${job.id}/timeline/`;
}

async function runJob(action) {
  const targets = [...selected].map((key) => {
    const [server, engine] = key.split("\u0000");
    return { server, engine };
  });
  const token = document.querySelector("#fleet-attach [name=csrfmiddlewaretoken]").value;
  const reply = await fetch(form.dataset.jobs, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRFToken": token },
    body: JSON.stringify({ action, targets }),
  });
  const answer = await reply.json().catch(() => ({ error: `HTTP ${reply.status}` }));
  if (!reply.ok) {
    notice.hidden = false;
    notice.textContent = `The job was not started: ${answer.error}`;
    return;
  }
  for (;;) {
    const job = await (await fetch(answer.url)).json();
    showJob(job);
    if (job.finished_at != null) break;
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
}

for (const button of buttons) button.addEventListener("click", () => runJob(button.dataset.action));
showSelection();

groupSelect.addEventListener("change", render);
filterInput.addEventListener("input", render);

const form = document.getElementById("fleet-attach");
const result = document.getElementById("attach-result");
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const data = new FormData(form);
  result.textContent = "checking…";
  const reply = await fetch(form.action, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRFToken": data.get("csrfmiddlewaretoken") },
    body: JSON.stringify({
      url: data.get("url"), name: data.get("name"), api_key: data.get("api_key"),
      interval: Number(data.get("interval") || 2),
    }),
  });
  const answer = await reply.json().catch(() => ({ error: `HTTP ${reply.status}` }));
  if (!reply.ok) {
    result.textContent = answer.error || `HTTP ${reply.status}`;
    result.className = "errornote-inline";
    return;
  }
  result.className = "";
  result.textContent = `attached ${answer.name} (${answer.kind}${answer.version ? " " + answer.version : ""})` +
    (answer.metrics_error ? `; its /metrics: ${answer.metrics_error}` : "");
  form.reset();
});

connect("/ws/fleet/", onMessage);

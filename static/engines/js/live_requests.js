// The engine page's live debugger: every request in the engine now, sortable, with a staff
// member's Abort button; and the KV cache opened. Both are drawn from each snapshot (4 Hz).
import * as fmt from "./format.js";

// Each column: its header, the row field it sorts by, how a cell shows the row (text, never HTML:
// ids come from clients), and whether it is a number (right-aligned, sorted numerically).
const COLUMNS = [
  { key: "request_id", label: "request id", cell: null },
  { key: "state", label: "state", cell: (r) => r.state.replace("_", " ") },
  { key: "age_s", label: "age", num: true, cell: (r) => fmt.seconds(r.age_s) },
  { key: "queued_s", label: "queued", num: true, cell: (r) => fmt.seconds(r.queued_s) },
  { key: "prompt_tokens", label: "prompt: cached / computed / left", num: true, cell: null },
  { key: "output_tokens", label: "output / max", num: true,
    cell: (r) => `${fmt.count(r.output_tokens)} / ${fmt.count(r.max_output_tokens)}` },
  { key: "tokens_per_s", label: "tok/s", num: true, cell: (r) => fmt.rate(r.tokens_per_s) },
  { key: "ttft_s", label: "TTFT", num: true, cell: (r) => fmt.seconds(r.ttft_s) },
  { key: "kv_pages", label: "KV pages", num: true, cell: (r) => fmt.count(r.kv_pages) },
  { key: "grammar", label: "grammar", cell: (r) => r.grammar || "no" },
  { key: "temperature", label: "sampling", num: true, cell: (r) => (r.state === "kv_transfer" ? "–"
    : `T ${r.temperature} · p ${r.top_p}${r.n > 1 ? ` · n ${r.n}` : ""}`) },
];
const STATE_ORDER = { waiting: 0, preempted: 1, kv_transfer: 2, prefilling: 3, decoding: 4 };

function compare(key, a, b) {
  const x = key === "state" ? STATE_ORDER[a.state] : a[key];
  const y = key === "state" ? STATE_ORDER[b.state] : b[key];
  if (x == null || y == null) return (x == null) - (y == null); // "not yet" after every value
  return typeof x === "number" ? x - y : String(x).localeCompare(String(y));
}

function text(tag, value, className = "") {
  const el = document.createElement(tag);
  el.textContent = value;
  if (className) el.className = className;
  return el;
}

/** The prompt's progress: cached, computed (cached included) and left, over a bar of the same. */
function promptCell(r) {
  const td = document.createElement("td");
  td.className = "num";
  td.append(text("span", `${fmt.count(r.cached_tokens)} / ${fmt.count(r.computed_tokens)} / ${fmt.count(r.left_tokens)}`));
  td.title = `${r.prompt_tokens} prompt tokens: ${r.cached_tokens} from the prefix cache, ${r.computed_tokens} with K/V ` +
    `now (the cached ones included), ${r.left_tokens} still to compute`;
  const bar = document.createElement("span");
  bar.className = "progress";
  const total = Math.max(r.prompt_tokens, 1);
  const cached = document.createElement("span");
  cached.className = "progress-cached";
  cached.style.width = `${(100 * r.cached_tokens) / total}%`;
  const computed = document.createElement("span");
  computed.className = "progress-computed";
  computed.style.width = `${(100 * Math.max(0, r.computed_tokens - r.cached_tokens)) / total}%`;
  bar.append(cached, computed);
  td.append(bar);
  return td;
}

/** `template` (a URL with REQUEST_ID in it) as a function of a request id: its request page. */
export function requestUrlOf(template) {
  return (requestId) => template.replace("REQUEST_ID", encodeURIComponent(requestId));
}

function idCell(r, requestUrl) {
  const td = document.createElement("td");
  const id = text("a", r.request_id, "request-id");
  id.title = r.request_id;
  id.href = requestUrl(r.request_id);
  td.append(id);
  const client = [r.user && r.user !== r.request_id ? `user ${r.user}` : null,
    r.client_request_id ? `X-Request-Id ${r.client_request_id}` : null].filter(Boolean);
  if (client.length) {
    const ids = text("span", client.join(" · "), "client-ids");
    ids.title = "The client's own ids";
    td.append(ids);
  }
  if (r.prompt_text != null) {  // serve --capture-text: the prompt's start, the output's end
    const said = text("span", `“${r.prompt_text}” → “${r.output_text ?? ""}”`, "request-text");
    said.title = said.textContent;
    td.append(said);
  }
  if (r.disagg) {
    const tag = text("span", r.disagg, "disagg-tag");
    tag.title = "Disaggregated serving: the other half runs on another engine under the same request id";
    td.append(tag);
  }
  return td;
}

/** The live table in `table` (its header made here); `onAbort(requestId)` after the user confirmed;
 * `requestUrl(requestId)`, the page each id links. */
export class LiveTable {
  constructor(table, onAbort, requestUrl) {
    this.table = table;
    this.onAbort = onAbort;
    this.requestUrl = requestUrl;
    this.sort = { key: "age_s", descending: true }; // oldest first, as the engine lists them
    this.rows = [];
    const tr = document.createElement("tr");
    for (const column of COLUMNS) {
      const th = document.createElement("th");
      th.scope = "col";
      th.dataset.sort = column.key;
      const button = text("button", column.label, "sort-button");
      button.type = "button";
      button.title = "Sort by this column (again: the other way)";
      button.addEventListener("click", () => this.sortBy(column.key));
      th.append(button);
      tr.append(th);
    }
    tr.append(text("th", ""));
    table.tHead.replaceChildren(tr);
    // One listener for every row's button: the body is redrawn four times a second.
    table.tBodies[0].addEventListener("click", (event) => {
      const button = event.target.closest("button[data-abort]");
      if (!button) return;
      const id = button.dataset.abort;
      if (confirm(`Abort request ${id}? Its client gets what it has so far, with finish_reason "abort".`)) {
        button.disabled = true;
        this.onAbort(id);
      }
    });
    this.showSort();
  }

  sortBy(key) {
    this.sort = { key, descending: this.sort.key === key ? !this.sort.descending : COLUMNS.find((c) => c.key === key).num };
    this.showSort();
    this.render(this.rows);
  }

  showSort() {
    for (const th of this.table.tHead.querySelectorAll("th[data-sort]")) {
      const on = th.dataset.sort === this.sort.key;
      th.setAttribute("aria-sort", on ? (this.sort.descending ? "descending" : "ascending") : "none");
    }
  }

  render(rows, total = rows.length) {
    this.rows = rows;
    const body = this.table.tBodies[0];
    const count = document.getElementById("live-count");
    if (count) {
      count.textContent = !rows.length ? "" : total > rows.length ? `(${rows.length} of ${total}, the oldest)`
        : `(${rows.length})`;
    }
    if (!rows.length) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = text("td", "No request is in the engine now.");
      td.colSpan = COLUMNS.length + 1;
      tr.append(td);
      body.replaceChildren(tr);
      return;
    }
    const { key, descending } = this.sort;
    const sorted = [...rows].sort((a, b) => (descending ? -1 : 1) * compare(key, a, b));
    body.replaceChildren(...sorted.map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = r.request_id;
      tr.dataset.state = r.state;
      for (const column of COLUMNS) {
        if (column.key === "request_id") tr.append(idCell(r, this.requestUrl));
        else if (column.key === "prompt_tokens") tr.append(promptCell(r));
        else {
          const td = text("td", column.cell(r), column.num ? "num" : "");
          if (column.key === "state") td.className = `state-cell state-${r.state}`;
          if (column.key === "state" && r.preemptions) td.title = `preempted ${r.preemptions} times`;
          tr.append(td);
        }
      }
      const td = document.createElement("td");
      if (r.state !== "kv_transfer") {
        const button = text("button", "Abort…", "button abort-button");
        button.type = "button";
        button.dataset.abort = r.request_id;
        td.append(button);
      }
      tr.append(td);
      return tr;
    }));
  }
}

// ------------------------------------------------------------------------- KV cache

function figureRows(kv) {
  return [
    [`pages (${fmt.count(kv.page_size)} tokens each)`, fmt.count(kv.total_pages)],
    ["used (held or pinned)", `${fmt.count(kv.used_pages)} (${fmt.percent(kv.used_pages / kv.total_pages)})`],
    ["cached (nobody holds them: reusable, evictable)", fmt.count(kv.cached_pages)],
    ["free", fmt.count(kv.free_pages)],
    ["pinned", fmt.count(kv.pinned_pages)],
    ["prefix-cache hit rate (prompt tokens served from it)",
      `${fmt.percent(kv.hit_rate)} (${fmt.count(kv.hit_tokens)} of ${fmt.count(kv.query_tokens)})`],
    ["evictions (cached pages dropped for room)", fmt.count(kv.evictions)],
    ["preemptions (sequences sent back for want of pages)", fmt.count(kv.preemptions)],
  ];
}

function fill(body, rows, emptyText, columns, words = -1) {
  if (!rows.length) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = text("td", emptyText);
    td.colSpan = columns;
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    // The first column names the row; `words`, a text column (one line, cut short); the rest are figures.
    cells.forEach((value, i) => {
      const td = text("td", value, i === words ? "kv-words" : i ? "num" : "");
      if (i === words) td.title = value;
      tr.append(td);
    });
    return tr;
  }));
}

/** The KV section (#kv-module) from a snapshot's `kv_cache`. */
export function renderKV(kv) {
  const module = document.getElementById("kv-module");
  module.classList.toggle("stale", !kv);
  if (!kv) return;
  const bar = module.querySelector(".kv-bar");
  for (const [part, pages] of [["used", kv.used_pages], ["cached", kv.cached_pages], ["free", kv.free_pages]]) {
    const el = bar.querySelector(`[data-part="${part}"]`);
    el.style.width = `${(100 * pages) / kv.total_pages}%`;
    el.title = `${part}: ${pages} pages`;
  }
  const figures = module.querySelector("#kv-figures tbody");
  figures.replaceChildren(...figureRows(kv).map(([label, value]) => {
    const tr = document.createElement("tr");
    tr.append(text("th", label), text("td", value, "num"));
    tr.firstChild.scope = "row";
    return tr;
  }));
  fill(module.querySelector("#kv-requests tbody"),
    kv.requests.map((r) => [r.request_id, fmt.count(r.pages), r.page_ids || "–"]),
    "No request holds pages now.", 3);
  fill(module.querySelector("#kv-entries tbody"),
    kv.entries.map((e) => [fmt.count(e.tokens), fmt.count(e.pages), fmt.count(e.hits), fmt.count(e.prefix_hits),
      `${fmt.seconds(e.last_use_s)} ago`, e.held_by ? `${e.held_by} now` : (e.pinned ? "pinned" : "evictable"),
      e.first_words == null ? "–" : `“${e.first_words}”`]),
    "The prefix cache holds no full page.", 7, 6);
  module.querySelector("#kv-entries-count").textContent = kv.num_entries > kv.entries.length
    ? `(the ${kv.entries.length} most recently used of ${kv.num_entries})` : `(${kv.num_entries})`;
}

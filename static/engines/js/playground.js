// The playground: a chat whose turns go with each new prompt, or a single-turn completion;
// streamed token by token (or answered whole) with its TTFT and tokens/s, its logprobs and
// usage.extra, stoppable; the exact request as curl and both raw sides of it; the chosen
// engine's load beside it. Whatever the model or the server wrote is set as text
// (textContent), never parsed as HTML: tokens and error messages can hold anything.
import * as fmt from "./format.js";
import { connect } from "./live.js";

const form = document.getElementById("playground-form");
const $ = (id) => document.getElementById(id);
const CHAT = "chat/completions";

/** The chat so far, in the API's shape: user and assistant turns, sent before the next prompt
 * (the system prompt is the form's, read at each send). */
let conversation = [];
/** Whether the choices on screen are the answer of the conversation's last assistant turn (so the
 * transcript leaves that turn to them rather than show it twice). */
let lastAnswerShown = false;
let controller = null;

// Error params the server names that are not read from an input called pg-<param>.
const FIELD_OF_PARAM = {
  model: "pg-engine", messages: "pg-prompt", prompt: "pg-prompt", max_completion_tokens: "pg-max-tokens",
  logprobs: "pg-logprobs", top_logprobs: "pg-logprobs",
};

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ------------------------------------------------------------------------- errors, by field

/** The input a request param is read from (``debug_config.ignore_eos`` -> debug_config's), or null. */
function fieldOf(param) {
  const name = String(param).split(/[.[]/)[0];
  const id = Object.hasOwn(FIELD_OF_PARAM, name) ? FIELD_OF_PARAM[name] : `pg-${name.replaceAll("_", "-")}`;
  const field = $(id);
  return field && form.contains(field) && field.closest(".form-row") ? field : null;
}

/** Say ``message`` next to the field ``param`` names; false when no field is read for it. */
function markField(param, message) {
  const field = param == null ? null : fieldOf(param);
  const list = field && field.closest(".form-row").querySelector(".errorlist");
  if (!list) return false;
  field.classList.add("pg-invalid");
  field.setAttribute("aria-invalid", "true");
  list.append(element("li", "", message));
  list.hidden = false;
  return true;
}

function clearErrors() {
  $("pg-error").hidden = true;
  for (const list of form.querySelectorAll(".errorlist")) {
    list.replaceChildren();
    list.hidden = true;
  }
  for (const field of form.querySelectorAll(".pg-invalid")) {
    field.classList.remove("pg-invalid");
    field.removeAttribute("aria-invalid");
  }
}

function showError(message) {
  $("pg-error").hidden = false;
  $("pg-error").textContent = message;
}

// ---------------------------------------------------------------------------- the request

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

/** The request the form describes, and what keeps it from being sent: ``[param, message]`` pairs. */
function buildRequest(kind) {
  const errors = [];
  const json = (id, name) => {
    const text = $(id).value.trim();
    if (!text) return undefined;
    try {
      return JSON.parse(text);
    } catch (error) {
      errors.push([name, `${name} is not JSON: ${error.message}`]);
      return undefined;
    }
  };
  const stream = $("pg-stream").checked;
  const request = {
    model: $("pg-engine").value, stream, stream_options: stream ? { include_usage: true } : undefined,
    max_tokens: number("pg-max-tokens"), temperature: number("pg-temperature"), top_p: number("pg-top-p"),
    top_k: number("pg-top-k") || undefined, seed: number("pg-seed"), n: number("pg-n"),
    response_format: json("pg-response-format", "response_format"), debug_config: json("pg-debug-config", "debug_config"),
  };
  const logprobs = number("pg-logprobs");
  if (logprobs !== undefined) {
    Object.assign(request, kind === CHAT ? { logprobs: true, top_logprobs: logprobs } : { logprobs });
  }
  const prompt = $("pg-prompt").value;
  if (!prompt.trim()) errors.push(["prompt", "The prompt is empty: write one."]);
  if (kind === CHAT) {
    const system = $("pg-system").value.trim();
    request.messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation,
      { role: "user", content: prompt }];
  } else {
    request.prompt = prompt;
  }
  return { request, errors };
}

/** The request as a shell command against the server's own /v1 API (the playground's twin of it). */
function curlCommand(url, body, stream) {
  const quote = (text) => `'${text.replaceAll("'", "'\\''")}'`;
  const keyed = form.dataset.apiKeyRequired === "true";
  return [
    ...(keyed ? ["# This server asks for its API key: export API_KEY=<the key> first."] : []),
    `curl -s${stream ? "N" : ""} ${quote(url)} \\`,
    "  -H 'Content-Type: application/json' \\",
    ...(keyed ? ['  -H "Authorization: Bearer $API_KEY" \\'] : []),
    `  -d ${quote(body)}`,
  ].join("\n");
}

function showExchange(kind, request, body) {
  const url = new URL($("pg-kind").selectedOptions[0].dataset.url, window.location.origin).href;
  $("pg-curl").textContent = curlCommand(url, body, request.stream);
  $("pg-request-json").textContent = JSON.stringify(request, null, 2);
  $("pg-response-raw").replaceChildren();
  $("pg-response-summary").textContent = request.stream ? "Response (server-sent events, as received)" : "Response (JSON)";
  $("pg-copy-status").textContent = "";
  $("pg-exchange").hidden = false;
}

async function copyCurl() {
  const text = $("pg-curl").textContent;
  try {
    await navigator.clipboard.writeText(text); // absent or refused outside a secure context
    $("pg-copy-status").textContent = "Copied to the clipboard.";
  } catch {
    $("pg-curl-details").open = true;
    window.getSelection().selectAllChildren($("pg-curl"));
    $("pg-copy-status").textContent = "The browser keeps the clipboard closed here: the command is selected below, copy it with Ctrl+C.";
  }
}

// ----------------------------------------------------------------------------- the output

function turnBox(role, text, className = "") {
  const box = element("div", `pg-turn ${className}`.trim());
  box.dataset.role = role;
  box.append(element("div", "pg-role", role), element("pre", "pg-turn-text", text));
  return box;
}

/** The transcript: the conversation (less the answer the choices show), then the prompt in flight. */
function renderConversation(pending) {
  const turns = lastAnswerShown ? conversation.slice(0, -1) : conversation;
  $("pg-conversation").replaceChildren(...turns.map((m) => turnBox(m.role, m.content)),
    ...(pending == null ? [] : [turnBox("user", pending, "pg-pending")]));
  $("pg-conversation").hidden = $("pg-kind").value !== CHAT || !$("pg-conversation").hasChildNodes();
}

function renderModeNote() {
  const chat = $("pg-kind").value === CHAT;
  const exchanges = conversation.length / 2;
  $("pg-new-chat").disabled = conversation.length === 0 || controller != null;
  $("pg-mode-note").textContent = !chat ? "Completion is single-turn: only the prompt is sent."
    : exchanges === 0 ? "A new chat."
      : `${exchanges} exchange${exchanges === 1 ? "" : "s"} so far, sent before the next prompt.`;
  $("pg-conversation").hidden = !chat || !$("pg-conversation").hasChildNodes();
}

function newChat() {
  conversation = [];
  lastAnswerShown = false;
  $("pg-choices").replaceChildren();
  $("pg-stats").textContent = "";
  $("pg-usage").hidden = true;
  $("pg-n-note").hidden = true;
  clearErrors();
  renderConversation(null);
  renderModeNote();
}

function choiceBox(index, chat) {
  let box = document.querySelector(`#pg-choices [data-choice="${Number(index)}"]`);
  if (!box) {
    box = element("div", "choice");
    box.dataset.choice = index;
    box.append(element("h3", "", chat ? `assistant · choice ${index}` : `choice ${index}`),
      element("pre", "choice-text"), element("p", "help finish"));
    $("pg-choices").append(box);
  }
  return box;
}

/** One token's logprob and alternatives, from either API's shape: ``[{token, logprob, top: [[token, logprob]]}]``. */
function tokenLogprobs(logprobs) {
  if (!logprobs) return [];
  if (Array.isArray(logprobs.content)) { // chat
    return logprobs.content.map((t) => ({
      token: t.token, logprob: t.logprob, top: (t.top_logprobs || []).map((a) => [a.token, a.logprob]),
    }));
  }
  return (logprobs.tokens || []).map((token, i) => ({ // completions: parallel lists
    token, logprob: (logprobs.token_logprobs || [])[i],
    top: Object.entries((logprobs.top_logprobs || [])[i] || {}).sort((a, b) => b[1] - a[1]),
  }));
}

const shownToken = (token) => JSON.stringify(String(token)); // quotes show its spaces, escapes its newlines
const shownLogprob = (value) => (typeof value === "number" ? value.toFixed(3) : "–");

function appendLogprobs(box, items) {
  if (!items.length) return;
  let table = box.querySelector(".pg-logprobs tbody");
  if (!table) {
    const details = element("details", "pg-logprobs");
    details.open = true;
    const head = element("tr");
    for (const name of ["#", "token", "logprob", "p", "top alternatives"]) head.append(element("th", "", name));
    const thead = element("thead");
    thead.append(head);
    table = element("tbody");
    const grid = element("table");
    grid.append(thead, table);
    const scroll = element("div", "pg-logprobs-scroll"); // a long answer's table scrolls, the page does not
    scroll.append(grid);
    details.append(element("summary"), scroll);
    box.append(details);
  }
  for (const item of items) {
    const row = element("tr");
    const p = typeof item.logprob === "number" ? Math.exp(item.logprob) : null;
    row.title = `${shownToken(item.token)}: logprob ${shownLogprob(item.logprob)}, p ${fmt.percent(p)}`;
    const alternatives = element("td", "pg-alternatives");
    for (const [token, logprob] of item.top) {
      const alt = element("span", token === item.token ? "pg-alt pg-chosen" : "pg-alt");
      alt.append(element("code", "", shownToken(token)), ` ${shownLogprob(logprob)}`);
      alternatives.append(alt);
    }
    row.append(element("td", "pg-num", String(table.rows.length)), element("td", "pg-token", shownToken(item.token)),
      element("td", "pg-num", shownLogprob(item.logprob)), element("td", "pg-num", fmt.percent(p)), alternatives);
    table.append(row);
  }
  box.querySelector(".pg-logprobs summary").textContent = `logprobs: ${table.rows.length} tokens`;
}

function showUsage(usage) {
  const items = [["prompt_tokens", usage.prompt_tokens], ["completion_tokens", usage.completion_tokens],
    ["total_tokens", usage.total_tokens]];
  // usage.extra repeats the counts; the rest is the request's metrics (--enable-debug).
  for (const [key, value] of Object.entries(usage.extra || {})) {
    if (!Object.hasOwn(usage, key) || usage[key] !== value) items.push([key, value]);
  }
  $("pg-usage-list").replaceChildren(...items.map(([key, value]) => {
    const item = element("div");
    item.dataset.key = key;
    item.append(element("dt", "", key), element("dd", "", fmt.metric(key, value)));
    return item;
  }));
  $("pg-usage").hidden = false;
}

// --------------------------------------------------------------------------------- sending

/** One request's progress: what its stats line and the conversation are made from. */
class Run {
  constructor(chat) {
    this.chat = chat;
    this.started = performance.now();
    this.firstAt = null;
    this.chunks = 0;
    this.usage = null;
    this.failed = false;
    this.answered = false; // the choices are complete (finish_reason or the whole reply)
  }

  fail(message, param) {
    this.failed = true;
    showError(message);
    markField(param, message);
    $("pg-stats").textContent = ""; // a failed request has no stats, and the last request's are not its
  }

  /** One choice (a stream's delta or a reply's whole choice) onto the page. */
  absorb(choice) {
    const text = choice.delta ? choice.delta.content : choice.message ? choice.message.content : choice.text;
    const box = choiceBox(choice.index, this.chat);
    if (text) {
      if (this.firstAt == null) this.firstAt = performance.now();
      this.chunks += 1;
      box.querySelector(".choice-text").append(text);
    }
    appendLogprobs(box, tokenLogprobs(choice.logprobs));
    if (choice.finish_reason) {
      box.querySelector(".finish").textContent = `finish_reason: ${choice.finish_reason}`;
      if (choice.index === 0) this.answered = true;
    }
  }

  showStats(whole) {
    if (this.failed) return;
    const extra = this.usage && this.usage.extra;
    const tokens = this.usage ? this.usage.completion_tokens : this.chunks;
    let ttft = this.firstAt == null ? null : (this.firstAt - this.started) / 1000;
    let rate = null;
    if (whole) { // one reply at the end: the server's own timings, when --enable-debug gives them
      ttft = extra ? extra.ttft_s : null;
      rate = extra ? extra.decode_tokens_per_s : tokens / ((performance.now() - this.started) / 1000);
    } else if (this.firstAt != null && performance.now() > this.firstAt) {
      rate = tokens / ((performance.now() - this.firstAt) / 1000);
    }
    $("pg-stats").textContent = `TTFT ${fmt.seconds(ttft)} · ${tokens} tokens · ${fmt.rate(rate)} tok/s`;
  }

  event(data) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) {
      const error = typeof chunk.error === "object" ? chunk.error : chunk;
      this.fail(`The request failed mid-stream: ${error.message}`, error.param);
      return;
    }
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) this.absorb(choice);
    this.showStats(false);
  }
}

async function readStream(response, run) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const raw = $("pg-response-raw");
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    raw.append(value); // a text node a read: the raw stream, without rewriting what is shown
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      if (event.startsWith("data: ")) run.event(event.slice(6));
    }
  }
}

function readReply(reply, run) {
  for (const choice of reply.choices || []) run.absorb(choice);
  run.answered = true;
  run.usage = reply.usage || null;
  run.showStats(true);
}

async function send(event) {
  event.preventDefault();
  if (controller) return;
  clearErrors();
  const kind = $("pg-kind").value;
  const chat = kind === CHAT;
  const { request, errors } = buildRequest(kind);
  if (errors.length) {
    // The last request's stats and usage are not this attempt's (its answer stays: it is in the chat).
    $("pg-stats").textContent = "";
    $("pg-usage").hidden = true;
    for (const [param, message] of errors) markField(param, message);
    // "debug_config is not JSON": the field's own line has the parser's words.
    showError(`Nothing was sent: ${errors.map(([, message]) => message.split(":")[0]).join("; ")} (see the form above).`);
    return;
  }
  const body = JSON.stringify(request);
  const prompt = chat ? request.messages.at(-1).content : null;
  showExchange(kind, request, body);
  $("pg-stats").textContent = "";
  $("pg-choices").replaceChildren();
  $("pg-usage").hidden = true;
  const n = request.n || 1;
  $("pg-n-note").hidden = !(chat && n > 1);
  $("pg-n-note").textContent = `n = ${n}: the conversation goes on with choice 0.`;
  lastAnswerShown = false;
  renderConversation(prompt);

  controller = new AbortController();
  $("pg-send").disabled = true;
  $("pg-stop").disabled = false;
  renderModeNote();
  const run = new Run(chat);
  try {
    const csrf = form.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch(form.dataset.api + kind, {
      method: "POST", body, signal: controller.signal,
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf },
    });
    if (!response.ok) {
      const text = await response.text();
      $("pg-response-summary").textContent = `Response (${response.status} ${response.statusText})`;
      $("pg-response-raw").textContent = text;
      let reply = null;
      try {
        reply = JSON.parse(text);
      } catch {
        // not JSON (a proxy's page): the status says enough
      }
      const error = reply && typeof reply.error === "object" && reply.error ? reply.error : reply || {};
      const param = error.param ? ` (param: ${error.param})` : "";
      run.fail(`${response.status} ${response.statusText}: ${error.message || "no message"}${param}`, error.param);
      return;
    }
    if ((response.headers.get("Content-Type") || "").startsWith("text/event-stream")) {
      await readStream(response, run);
    } else {
      const text = await response.text();
      const reply = JSON.parse(text);
      $("pg-response-raw").textContent = JSON.stringify(reply, null, 2);
      readReply(reply, run);
    }
    if (run.usage && !run.failed) showUsage(run.usage);
  } catch (error) {
    if (error.name === "AbortError") {
      const stats = $("pg-stats").textContent;
      $("pg-stats").textContent = `${stats ? `${stats} · ` : ""}stopped (the request was aborted in the engine)`;
    } else {
      run.fail(String(error));
    }
  } finally {
    controller = null;
    $("pg-send").disabled = false;
    $("pg-stop").disabled = true;
    // A stopped answer stays in the chat as far as it got: it is what the page shows.
    const answer = document.querySelector('#pg-choices [data-choice="0"] .choice-text');
    if (chat && !run.failed && answer && (run.answered || answer.textContent)) {
      conversation.push({ role: "user", content: prompt }, { role: "assistant", content: answer.textContent });
      lastAnswerShown = true;
    } else {
      renderConversation(null); // the prompt was not answered: it stays in its box, out of the chat
    }
    renderModeNote();
  }
}

if (form) {
  form.addEventListener("submit", send);
  $("pg-stop").addEventListener("click", () => controller && controller.abort());
  $("pg-new-chat").addEventListener("click", newChat);
  $("pg-copy-curl").addEventListener("click", copyCurl);
  $("pg-kind").addEventListener("change", renderModeNote);
  $("pg-prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });
  renderModeNote();

  connect("/ws/engines/", (message) => {
    if (message.type !== "snapshot" || message.engine !== $("pg-engine").value) return;
    const m = message.metrics;
    if (!m) {
      $("pg-engine-now").textContent = fmt.state(message);
      return;
    }
    // The engine's own "now" rate, the number its page and the overview show.
    $("pg-engine-now").textContent = `${fmt.state(message)} · running ${m.num_running_requests}, waiting ` +
      `${m.num_waiting_requests} · decode ${fmt.rate(m.now.decode_tokens_per_s)} tok/s ` +
      `(${fmt.lastSeconds(m.now.window_s)}) · KV cache ${fmt.percent(m.kv_cache_usage)}`;
  });
}

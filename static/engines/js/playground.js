// The playground: one chat or completion request, streamed token by token, with its TTFT and
// tokens/s, stoppable; the chosen engine's load beside it.
import * as fmt from "./format.js";
import { connect, Rate } from "./live.js";

const form = document.getElementById("playground-form");
const $ = (id) => document.getElementById(id);
let controller = null;

function optionalJson(id) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  return JSON.parse(text); // a SyntaxError is shown to the user below
}

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function body() {
  const kind = $("pg-kind").value;
  const request = {
    model: $("pg-engine").value, stream: true, stream_options: { include_usage: true },
    max_tokens: number("pg-max-tokens"), temperature: number("pg-temperature"), top_p: number("pg-top-p"),
    top_k: number("pg-top-k") || undefined, seed: number("pg-seed"), n: number("pg-n"),
    response_format: optionalJson("pg-response-format"), debug_config: optionalJson("pg-debug-config"),
  };
  const prompt = $("pg-prompt").value;
  if (kind === "chat/completions") {
    const system = $("pg-system").value.trim();
    request.messages = [...(system ? [{ role: "system", content: system }] : []), { role: "user", content: prompt }];
  } else {
    request.prompt = prompt;
  }
  return request;
}

function choiceBox(index) {
  let box = document.querySelector(`#pg-choices [data-choice="${index}"]`);
  if (!box) {
    box = document.createElement("div");
    box.className = "choice";
    box.dataset.choice = index;
    const label = document.createElement("h3");
    label.textContent = `choice ${index}`;
    const text = document.createElement("pre");
    text.className = "choice-text";
    const finish = document.createElement("p");
    finish.className = "help finish";
    box.append(label, text, finish);
    $("pg-choices").append(box);
  }
  return box;
}

function showError(message) {
  $("pg-error").hidden = false;
  $("pg-error").textContent = message;
}

async function send(event) {
  event.preventDefault();
  $("pg-error").hidden = true;
  $("pg-choices").replaceChildren();
  let request;
  try {
    request = body();
  } catch (error) {
    showError(`response_format or debug_config is not JSON: ${error.message}`);
    return;
  }
  controller = new AbortController();
  $("pg-send").disabled = true;
  $("pg-stop").disabled = false;
  const started = performance.now();
  let firstAt = null;
  let chunks = 0;
  let usage = null;
  const stats = () => {
    const now = performance.now();
    const ttft = firstAt == null ? "–" : fmt.seconds((firstAt - started) / 1000);
    const tokens = usage ? usage.completion_tokens : chunks;
    const rate = firstAt != null && now > firstAt ? tokens / ((now - firstAt) / 1000) : null;
    $("pg-stats").textContent = `TTFT ${ttft} · ${tokens} tokens · ${fmt.rate(rate)} tok/s`;
  };
  try {
    const csrf = form.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch(form.dataset.api + $("pg-kind").value, {
      method: "POST", body: JSON.stringify(request), signal: controller.signal,
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf },
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({ message: response.statusText }));
      showError(`${response.status}: ${error.message}`);
      return;
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const line of events) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) showError(chunk.error.message || chunk.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const text = choice.delta ? choice.delta.content : choice.text;
          const box = choiceBox(choice.index);
          if (text) {
            if (firstAt == null) firstAt = performance.now();
            chunks += 1;
            box.querySelector(".choice-text").textContent += text;
          }
          if (choice.finish_reason) box.querySelector(".finish").textContent = `finish_reason: ${choice.finish_reason}`;
        }
        stats();
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      $("pg-stats").textContent += " · stopped (the request was aborted in the engine)";
    } else {
      showError(String(error));
    }
  } finally {
    $("pg-send").disabled = false;
    $("pg-stop").disabled = true;
    controller = null;
  }
}

if (form) {
  form.addEventListener("submit", send);
  $("pg-stop").addEventListener("click", () => controller && controller.abort());

  const decode = new Map();
  connect("/ws/engines/", (message) => {
    if (message.type !== "snapshot" || message.engine !== $("pg-engine").value) return;
    const m = message.metrics;
    if (!decode.has(message.engine)) decode.set(message.engine, new Rate());
    if (!m) {
      $("pg-engine-now").textContent = fmt.state(message);
      return;
    }
    const rate = decode.get(message.engine).update(m.decode_tokens_processed, message.at);
    $("pg-engine-now").textContent = `${fmt.state(message)} · running ${m.num_running_requests}, waiting ` +
      `${m.num_waiting_requests} · decode ${fmt.rate(rate)} tok/s · KV cache ${fmt.percent(m.kv_cache_usage)}`;
  });
}

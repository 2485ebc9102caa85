"""The playground as someone who keeps it open all day uses it, in a real browser (Debian's
chromium, async Playwright) against a live ``manage.py serve``: a multi-turn chat, the request as
curl and as raw JSON, logprobs, ``usage.extra``, the stats line, and errors that name their field.

SmolLM2 at temperature 0 answers deterministically: "What is the capital of France?" gets
"The capital of France is Paris." on the float32 path, which this module serves
(``--weights-dtype float32``: serve's default keeps the GGUF's types, whose int8 activations
answer as llama.cpp does, "L'Étoile, ...", at length). Screenshots go to
``var/screenshots/playground-*.png``.
"""
from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from tests.browser.conftest import SHOTS

pytestmark = pytest.mark.slow

EXTRA_SERVE_ARGS = ["--weights-dtype", "float32"]  # the answers below are the float32 path's (transformers')
FRANCE = "What is the capital of France?"
PARIS = "The capital of France is Paris."
API = "/dashboard/playground/v1/"


async def open_playground(page, base: str) -> list:
    """Open the page; the list fills with every request it sends to the API, as they go."""
    sent: list = []
    page.on("request", lambda request: sent.append(request) if API in request.url else None)
    await page.goto(f"{base}/dashboard/playground/")
    return sent


async def finished(page) -> None:
    """Wait until the request in flight is over (Send is enabled again)."""
    await page.wait_for_function("() => !document.getElementById('pg-send').disabled", timeout=60000)


async def ask(page, prompt: str) -> None:
    await page.fill("#pg-prompt", prompt)
    await page.click("#pg-send")
    await finished(page)
    assert await page.is_hidden("#pg-error"), await page.text_content("#pg-error")


def body_of(request) -> dict:
    return json.loads(request.post_data)


def sse_data(raw: str) -> list[dict]:
    """The JSON events of a raw server-sent-events body, less ``[DONE]``."""
    return [json.loads(event[6:]) for event in raw.split("\n\n")
            if event.startswith("data: ") and event != "data: [DONE]"]


async def turns(page) -> list[list[str]]:
    return await page.eval_on_selector_all(
        "#pg-conversation .pg-turn",
        "ts => ts.map(t => [t.dataset.role, t.querySelector('.pg-turn-text').textContent])")


async def test_the_overview_names_the_real_models_file(page, dashboard_server) -> None:
    """The engine's cell names the model it runs, the checkpoint's path on hover."""
    await page.goto(f"{dashboard_server.base}/dashboard/")
    model = page.locator('tr.engine-row[data-engine="smollm2"] .model-name')
    await model.wait_for()
    assert (await model.text_content()).strip() == "SmolLM2-135M-Instruct.Q4_1 · GGUF"
    assert (await model.get_attribute("title")).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


async def test_chat_sends_the_conversation_so_far_and_new_chat_clears_it(page, dashboard_server) -> None:
    sent = await open_playground(page, dashboard_server.base)
    assert await page.input_value("#pg-engine") == "smollm2"
    await page.fill("#pg-temperature", "0")
    await page.fill("#pg-logprobs", "3")
    await ask(page, FRANCE)
    assert await page.text_content(".choice-text") == PARIS
    assert "1 exchange so far" in await page.text_content("#pg-mode-note")

    await ask(page, "And of Germany?")
    assert body_of(sent[1])["messages"] == [
        {"role": "user", "content": FRANCE}, {"role": "assistant", "content": PARIS},
        {"role": "user", "content": "And of Germany?"}]
    # The transcript shows what went with the prompt; the answer to it is the choice below, once.
    assert await turns(page) == [["user", FRANCE], ["assistant", PARIS], ["user", "And of Germany?"]]
    assert "Berlin" in await page.text_content(".choice-text")
    assert "2 exchanges so far" in await page.text_content("#pg-mode-note")
    for details in ("#pg-curl-details", "#pg-request-details", "#pg-response-details"):
        await page.click(f"{details} summary")
    await page.evaluate("window.scrollTo(0, 0)")  # the admin's sidebar is sticky: shoot from the top
    await page.screenshot(path=str(SHOTS / "playground-chat.png"), full_page=True)
    await page.set_viewport_size({"width": 900, "height": 1000})
    # Nothing wider than the window: long lines wrap, the logprobs table scrolls in its own box.
    assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    await page.screenshot(path=str(SHOTS / "playground-chat-900.png"), full_page=True)
    await page.set_viewport_size({"width": 1400, "height": 1000})

    await page.click("#pg-new-chat")
    assert await turns(page) == [] and await page.is_hidden("#pg-conversation")
    assert await page.text_content("#pg-choices") == "" and await page.text_content("#pg-stats") == ""
    assert await page.is_disabled("#pg-new-chat")
    await ask(page, FRANCE)
    assert body_of(sent[2])["messages"] == [{"role": "user", "content": FRANCE}]

    # n > 1: every choice is shown, and the chat goes on with the first; the page says so.
    await page.click("#pg-new-chat")
    await page.fill("#pg-logprobs", "")
    await page.fill("#pg-n", "2")
    await page.fill("#pg-temperature", "1")
    await page.fill("#pg-seed", "3")
    await page.fill("#pg-max-tokens", "12")
    await ask(page, "Name a colour.")
    assert await page.locator("#pg-choices .choice").count() == 2
    assert "goes on with choice 0" in await page.text_content("#pg-n-note")
    assert await page.is_visible("#pg-n-note")
    first = await page.text_content('[data-choice="0"] .choice-text')
    await ask(page, "Why?")
    assert body_of(sent[-1])["messages"][1] == {"role": "assistant", "content": first}

    # Completion is single-turn: the chat is neither sent nor shown.
    await page.select_option("#pg-kind", "completions")
    assert "single-turn" in await page.text_content("#pg-mode-note")
    assert await page.is_hidden("#pg-conversation")
    await page.fill("#pg-n", "1")
    await ask(page, "The capital of France is")
    completion = body_of(sent[-1])
    assert completion["prompt"] == "The capital of France is" and "messages" not in completion


async def test_copy_as_curl_gives_the_request_last_sent_and_the_raw_sides_are_shown(page, dashboard_server) -> None:
    base = dashboard_server.base
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    sent = await open_playground(page, base)
    assert await page.is_hidden("#pg-exchange")  # nothing sent yet
    await page.fill("#pg-temperature", "0")
    await ask(page, FRANCE)
    body = sent[0].post_data

    curl = await page.text_content("#pg-curl")
    assert curl.startswith(f"curl -sN '{base}/v1/chat/completions' \\\n")
    assert "  -H 'Content-Type: application/json' \\\n" in curl
    assert curl.endswith(f"  -d '{body}'")  # the body exactly as sent
    assert "Authorization" not in curl  # this server has no API key
    assert await page.is_hidden("#pg-curl")  # in a closed <details> until asked for
    await page.click("#pg-copy-curl")
    await page.wait_for_selector("#pg-copy-status >> text=Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == curl
    # The command works as it stands, from a shell, against the API itself.
    shell = await asyncio.to_thread(subprocess.run, ["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    events = sse_data(shell.stdout)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == PARIS

    assert json.loads(await page.text_content("#pg-request-json")) == json.loads(body)
    raw = await page.text_content("#pg-response-raw")
    assert raw.rstrip().endswith("data: [DONE]")
    assert "".join(c["delta"].get("content") or "" for e in sse_data(raw) for c in e["choices"]) == PARIS
    await page.click("#pg-response-details summary")
    assert await page.is_visible("#pg-response-raw")

    # A quote in the prompt survives the shell's quoting.
    await page.fill("#pg-max-tokens", "4")
    await ask(page, "What's the capital of Italy?")
    assert "What'\\''s the capital" in await page.text_content("#pg-curl")
    shell = await asyncio.to_thread(subprocess.run, ["bash", "-c", await page.text_content("#pg-curl")],
                                    capture_output=True, text=True, timeout=120)
    assert shell.stdout.rstrip().endswith("data: [DONE]"), shell.stdout + shell.stderr

    # On a server with --api-key (the page is told only that there is one) the command sends the header.
    await page.evaluate("document.getElementById('playground-form').dataset.apiKeyRequired = 'true'")
    await ask(page, "And of Spain?")
    keyed = await page.text_content("#pg-curl")
    assert keyed.startswith("# ") and '  -H "Authorization: Bearer $API_KEY" \\\n' in keyed
    await page.evaluate("document.getElementById('playground-form').dataset.apiKeyRequired = 'false'")

    # Not streamed, on the other engine: the final JSON is the raw response, the curl has no -N.
    await page.click("#pg-new-chat")
    await page.select_option("#pg-engine", "demo")
    await page.uncheck("#pg-stream")
    await page.fill("#pg-debug-config", '{"ignore_eos": true}')  # the demo's random weights may end early
    await ask(page, "Hello")
    request = body_of(sent[-1])
    assert request["model"] == "demo" and request["stream"] is False and "stream_options" not in request
    assert (await page.text_content("#pg-curl")).startswith(f"curl -s '{base}/v1/chat/completions'")
    reply = json.loads(await page.text_content("#pg-response-raw"))
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"] == await page.text_content(".choice-text")
    assert reply["usage"]["completion_tokens"] == 4
    assert "4 tokens" in await page.text_content("#pg-stats")


async def test_logprobs_show_every_token_with_its_alternatives(page, dashboard_server) -> None:
    sent = await open_playground(page, dashboard_server.base)
    await page.fill("#pg-temperature", "0")
    await page.fill("#pg-logprobs", "3")
    await ask(page, FRANCE)
    request = body_of(sent[0])
    assert request["logprobs"] is True and request["top_logprobs"] == 3
    expected = [entry for event in sse_data(await page.text_content("#pg-response-raw"))
                for choice in event["choices"] for entry in ((choice.get("logprobs") or {}).get("content") or [])]
    rows = await page.eval_on_selector_all(".pg-logprobs tbody tr", """rows => rows.map(r => ({
        token: r.querySelector('.pg-token').textContent, logprob: r.cells[2].textContent,
        alternatives: [...r.querySelectorAll('.pg-alt code')].map(c => c.textContent),
        chosen: r.querySelector('.pg-chosen code')?.textContent, title: r.title }))""")
    assert len(rows) == len(expected) == 8  # 7 tokens of the answer and its end-of-turn token
    for row, entry in zip(rows, expected, strict=True):
        assert json.loads(row["token"]) == entry["token"]
        assert float(row["logprob"]) == pytest.approx(entry["logprob"], abs=5e-4)
        assert [json.loads(a) for a in row["alternatives"]] == [t["token"] for t in entry["top_logprobs"]]
        assert json.loads(row["chosen"]) == entry["token"]  # greedy: the chosen token is the likeliest
        assert "logprob" in row["title"]  # the row's hover title says it too
    assert "".join(json.loads(row["token"]) for row in rows).startswith(PARIS)
    assert "8 tokens" in await page.text_content(".pg-logprobs summary")

    # Completions ask with logprobs: N, and answer in parallel lists; shown the same way.
    await page.select_option("#pg-kind", "completions")
    await page.fill("#pg-logprobs", "2")
    await page.fill("#pg-max-tokens", "4")
    await ask(page, "The capital of France is")
    request = body_of(sent[1])
    assert request["logprobs"] == 2 and "top_logprobs" not in request
    rows = await page.eval_on_selector_all(".pg-logprobs tbody tr", """rows => rows.map(r => [
        r.querySelector('.pg-token').textContent, r.querySelectorAll('.pg-alt').length])""")
    assert len(rows) == 4 and all(count == 2 for _, count in rows)
    assert json.loads(rows[0][0]) == " Paris"


async def test_hostile_text_from_the_model_and_the_server_stays_text(page, dashboard_server) -> None:
    hostile = '<img src=x onerror="window.__xss=1">'
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": hostile}, "finish_reason": None,
                      "logprobs": {"content": [{"token": hostile, "logprob": -0.5,
                                                "top_logprobs": [{"token": hostile, "logprob": -0.5}]}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                  "extra": {hostile: hostile}}},
    ]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    await open_playground(page, dashboard_server.base)
    await page.route(f"**{API}**", lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse))
    await ask(page, "anything")
    assert await page.text_content(".choice-text") == hostile
    assert json.loads(await page.text_content(".pg-token")) == hostile
    assert hostile in await page.text_content("#pg-usage-list")
    error = {"message": hostile, "param": hostile, "code": 400}
    await page.route(f"**{API}**", lambda route: route.fulfill(status=400, content_type="application/json",
                                                              body=json.dumps({"error": error})))
    await page.click("#pg-send")
    await finished(page)
    assert hostile in await page.text_content("#pg-error")
    assert await page.locator("#content-main img").count() == 0
    assert await page.evaluate("window.__xss") is None


async def test_usage_extra_is_shown_after_the_answer(page, dashboard_server) -> None:
    sent = await open_playground(page, dashboard_server.base)
    await page.fill("#pg-temperature", "0")
    await ask(page, FRANCE)
    assert body_of(sent[0])["stream_options"] == {"include_usage": True}
    usage = next(e["usage"] for e in sse_data(await page.text_content("#pg-response-raw")) if e.get("usage"))
    shown = dict(await page.eval_on_selector_all(
        "#pg-usage-list > div", "items => items.map(i => [i.dataset.key, i.querySelector('dd').textContent])"))
    assert await page.is_visible("#pg-usage")
    assert shown["prompt_tokens"] == str(usage["prompt_tokens"])
    assert shown["completion_tokens"] == "8" == str(usage["completion_tokens"])
    for key in ("ttft_s", "decode_tokens_per_s", "prefill_tokens_per_s", "end_to_end_latency_s",
                "inter_token_latency_s", "queue_time_s"):
        assert key in shown and key in usage["extra"], key
    assert shown["decode_tokens_per_s"].endswith("tok/s")
    assert shown["ttft_s"].endswith(" ms") or shown["ttft_s"].endswith(" s")


async def test_the_stats_line_belongs_to_the_request_in_flight_and_errors_name_their_param(
        page, dashboard_server) -> None:
    sent = await open_playground(page, dashboard_server.base)
    await page.fill("#pg-temperature", "0")
    await ask(page, FRANCE)
    assert "8 tokens" in await page.text_content("#pg-stats")

    # A new request clears the last one's stats the moment it starts (held here before it reaches the server).
    release = asyncio.Event()

    async def hold(route) -> None:
        await release.wait()
        await route.continue_()

    await page.route(f"**{API}**", hold)
    await page.click("#pg-send")
    assert await page.is_disabled("#pg-send")
    assert await page.text_content("#pg-stats") == ""
    release.set()
    await finished(page)
    await page.unroute(f"**{API}**")
    assert "TTFT" in await page.text_content("#pg-stats")

    # Refused by the server: its message and param, next to the field too; no stats left over.
    await page.fill("#pg-temperature", "5")
    await page.click("#pg-send")
    await finished(page)
    error = await page.text_content("#pg-error")
    assert "400" in error and "temperature must be at least 0 and at most 2" in error and "param: temperature" in error
    assert await page.text_content("#pg-stats") == ""
    assert "pg-invalid" in await page.get_attribute("#pg-temperature", "class")
    assert "temperature must be" in await page.text_content(".sampling .errorlist")
    await page.screenshot(path=str(SHOTS / "playground-server-error.png"), full_page=True)

    await page.fill("#pg-temperature", "0")
    await page.fill("#pg-logprobs", "50")
    await page.click("#pg-send")
    await finished(page)
    assert "param: top_logprobs" in await page.text_content("#pg-error")
    assert "pg-invalid" in await page.get_attribute("#pg-logprobs", "class")
    assert "pg-invalid" not in (await page.get_attribute("#pg-temperature", "class") or "")

    await page.fill("#pg-logprobs", "")
    await page.fill("#pg-debug-config", '{"ignore_eos": 3}')
    await page.click("#pg-send")
    await finished(page)
    assert "param: debug_config.ignore_eos" in await page.text_content("#pg-error")
    assert "ignore_eos" in await page.text_content("#pg-debug-config-error")
    await page.fill("#pg-debug-config", "")

    # A stream that fails after its first tokens (the engine died): the error, and no stats.
    chunk = {"choices": [{"index": 0, "delta": {"content": "The"}, "finish_reason": None}]}
    died = {"error": {"message": "The engine died; it restarts.", "type": "service_unavailable", "param": None,
                      "code": 503}}
    sse = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(died)}\n\ndata: [DONE]\n\n"
    await page.route(f"**{API}**", lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse))
    await page.click("#pg-send")
    await finished(page)
    assert "The engine died" in await page.text_content("#pg-error")
    assert await page.text_content("#pg-stats") == ""
    await page.unroute(f"**{API}**")

    # Fixed, it goes through again, and the earlier errors are gone.
    await ask(page, FRANCE)
    assert "TTFT" in await page.text_content("#pg-stats")
    assert await page.locator("#playground-form .pg-invalid").count() == 0
    assert len(sent) >= 5


async def test_a_field_that_is_not_json_is_named_and_nothing_is_sent(page, dashboard_server) -> None:
    sent = await open_playground(page, dashboard_server.base)
    await page.fill("#pg-temperature", "0")
    await page.fill("#pg-debug-config", "{ignore_eos: true}")
    await page.click("#pg-send")
    await page.wait_for_selector("#pg-debug-config-error li")
    assert (await page.text_content("#pg-debug-config-error")).startswith("debug_config is not JSON: ")
    assert await page.is_hidden("#pg-response-format-error")
    assert "Nothing was sent: debug_config is not JSON" in await page.text_content("#pg-error")
    assert "pg-invalid" in await page.get_attribute("#pg-debug-config", "class")
    await page.screenshot(path=str(SHOTS / "playground-bad-json.png"), full_page=True)

    await page.fill("#pg-response-format", "{'type': 'json_object'}")
    await page.click("#pg-send")
    assert (await page.text_content("#pg-response-format-error")).startswith("response_format is not JSON: ")
    assert (await page.text_content("#pg-debug-config-error")).startswith("debug_config is not JSON: ")
    await page.wait_for_timeout(500)
    assert sent == []  # nothing reached the network
    assert await page.is_hidden("#pg-exchange")

    await page.fill("#pg-response-format", "")
    await page.fill("#pg-debug-config", '{"ignore_eos": false}')
    await ask(page, FRANCE)
    assert len(sent) == 1 and body_of(sent[0])["debug_config"] == {"ignore_eos": False}
    assert await page.is_hidden("#pg-debug-config-error") and await page.is_hidden("#pg-response-format-error")
    assert await page.text_content(".choice-text") == PARIS

    # Caught here after an answer: the answer's stats and usage go, they are not this attempt's.
    assert "TTFT" in await page.text_content("#pg-stats") and await page.is_visible("#pg-usage")
    await page.fill("#pg-debug-config", "{ignore_eos}")
    await page.click("#pg-send")
    await page.wait_for_selector("#pg-debug-config-error li")
    assert await page.text_content("#pg-stats") == "" and await page.is_hidden("#pg-usage")
    assert await page.text_content(".choice-text") == PARIS  # the answer is the chat's: it stays
    assert len(sent) == 1
    await page.screenshot(path=str(SHOTS / "playground-bad-json-after-an-answer.png"), full_page=True)

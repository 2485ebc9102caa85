"""What the tools operators already run send and expect (issue 60), through the ASGI app on the real
demo engine: vLLM's sampling extensions at the top level, its usage extensions, the openai client's
``models.retrieve``, ``X-Request-Id``, vLLM's ``/tokenize``, ``/detokenize`` and ``/version``, and its
control routes (``/reset_prefix_cache``, ``/start_profile``, ``/stop_profile``)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

import engines
from engines.registry import registry
from tests.server.conftest import TRACED, UNTRACED, assert_error, sse_payloads, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def eos_id() -> int:
    return registry.get(TRACED).checkpoint.eos_token_ids[0]


def completion(**extra) -> dict:
    """A greedy completion whose every token would be EOS (a +100 bias) unless something holds it off."""
    return {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 9, "temperature": 0,
            "logit_bias": {str(eos_id()): 100}, **extra}


# ---------------------------------------------------------------- ignore_eos, min_tokens


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_top_level_ignore_eos_holds_the_requested_length(client: httpx.AsyncClient, path: str) -> None:
    """guidellm sends ``ignore_eos: true`` on every request to hold output lengths."""
    body = completion()
    if path == CHAT:
        body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": "Hi"}]}
    stops = (await client.post(path, json=body)).json()
    assert stops["usage"]["completion_tokens"] == 1 and stops["choices"][0]["finish_reason"] == "stop"
    held = (await client.post(path, json={**body, "ignore_eos": True})).json()
    assert held["usage"]["completion_tokens"] == 9 and held["choices"][0]["finish_reason"] == "length"


async def test_either_ignore_eos_is_enough(client: httpx.AsyncClient) -> None:
    """Top-level false beside MLC's debug_config true (the server runs with --enable-debug): true wins."""
    body = completion(ignore_eos=False, debug_config={"ignore_eos": True})
    assert (await client.post(COMPLETIONS, json=body)).json()["usage"]["completion_tokens"] == 9


async def test_min_tokens_holds_eos_off_then_it_ends_the_request(client: httpx.AsyncClient) -> None:
    reply = (await client.post(COMPLETIONS, json=completion(min_tokens=5))).json()
    assert reply["usage"]["completion_tokens"] == 6  # 5 held, then the EOS the bias makes likeliest
    assert reply["choices"][0]["finish_reason"] == "stop"
    streamed = await client.post(COMPLETIONS, json=completion(min_tokens=5, stream=True,
                                                              stream_options={"include_usage": True}))
    assert '"completion_tokens":6' in streamed.text


async def test_min_tokens_equal_to_max_tokens_gives_exactly_that_many(client: httpx.AsyncClient) -> None:
    reply = (await client.post(COMPLETIONS, json=completion(min_tokens=9, stop=["e", " "]))).json()
    assert reply["usage"]["completion_tokens"] == 9 and reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"min_tokens": -1}, "min_tokens", "non-negative integer"),
    ({"min_tokens": "3"}, "min_tokens", None),
    ({"min_tokens": 2.0}, "min_tokens", None),
    ({"min_tokens": 10}, "min_tokens", "at most max_tokens (9)"),
    ({"ignore_eos": "yes"}, "ignore_eos", None),
    ({"ignore_eos": 1}, "ignore_eos", None),
])
async def test_bad_ignore_eos_or_min_tokens_is_a_400_naming_it(client: httpx.AsyncClient, fields: dict, param: str,
                                                               says: str | None) -> None:
    error = assert_error(await client.post(COMPLETIONS, json=completion(**fields)), 400)
    assert error["param"] == param
    if says is not None:
        assert says in error["message"]


async def test_min_tokens_over_max_completion_tokens_names_that_field(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
            "min_tokens": 4}
    error = assert_error(await client.post(CHAT, json=body), 400)
    assert error["param"] == "min_tokens" and "at most max_completion_tokens (3)" in error["message"]


# ------------------------------------------------------------ usage.prompt_tokens_details


async def test_usage_says_the_prompt_tokens_the_prefix_cache_served(client: httpx.AsyncClient) -> None:
    """aiperf's cache metrics: two requests sharing a 64-token prefix (4 pages); the second finds it cached."""
    shared = list(range(300, 364))
    first = (await client.post(COMPLETIONS, json={"model": TRACED, "prompt": shared + [500], "max_tokens": 2})).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    body = {"model": TRACED, "prompt": shared + [600, 601], "max_tokens": 2}
    second = (await client.post(COMPLETIONS, json=body)).json()
    assert second["usage"]["prompt_tokens"] == 66
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    streamed = await client.post(COMPLETIONS, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    (usage,) = [e["usage"] for e in sse_payloads(streamed.text) if isinstance(e, dict) and e.get("usage")]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 64}


async def test_chat_usage_has_prompt_tokens_details_even_when_nothing_was_cached(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    usage = (await client.post(CHAT, json=body)).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


# ------------------------------------------------- stream_options.continuous_usage_stats


def stream_events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(client: httpx.AsyncClient, path: str) -> None:
    body = {"model": TRACED, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    hi = [{"role": "user", "content": "Hi"}]
    body.update({"prompt": "Once upon a time"} if path == COMPLETIONS else {"messages": hi})
    events = stream_events(await client.post(path, json=body))
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6  # include_usage: unchanged
    prompt = final["usage"]["prompt_tokens"]
    seen = [chunk["usage"] for chunk in chunks]
    assert all(u is not None and u["prompt_tokens"] == prompt for u in seen)
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in seen)
    assert all(u["prompt_tokens_details"] == {"cached_tokens": 0} for u in seen)
    counts = [u["completion_tokens"] for u in seen]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6
    assert "extra" not in seen[-1] and "extra" in final["usage"]  # the request's metrics stay on the last chunk


async def test_continuous_usage_of_several_prompts_counts_them_all(client: httpx.AsyncClient) -> None:
    """A completion's list of prompts is one reply: its usage so far counts every prompt's tokens
    and every choice's, and ends at the summed final usage."""
    body = {"model": TRACED, "prompt": ["Once upon a time", "Hi"], "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, final = stream_events(await client.post(COMPLETIONS, json=body))
    assert final["usage"]["completion_tokens"] == 6 and final["usage"]["prompt_tokens"] > 3
    seen = [chunk["usage"] for chunk in chunks]
    assert all(u["prompt_tokens"] == final["usage"]["prompt_tokens"] for u in seen)
    assert [u["completion_tokens"] for u in seen][-1] == 6


async def test_continuous_usage_alone_has_no_usage_only_chunk(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    events = stream_events(await client.post(COMPLETIONS, json=body))
    assert all(e["choices"] for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 4


async def test_without_continuous_usage_chunks_carry_none(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    *chunks, final = stream_events(await client.post(COMPLETIONS, json=body))
    assert all(chunk["usage"] is None for chunk in chunks) and final["usage"]["completion_tokens"] == 4


async def test_continuous_usage_counts_cached_tokens_and_is_a_strict_bool(client: httpx.AsyncClient) -> None:
    shared = list(range(300, 364))
    await client.post(COMPLETIONS, json={"model": TRACED, "prompt": shared + [500], "max_tokens": 1})
    body = {"model": TRACED, "prompt": shared + [501], "max_tokens": 3, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    events = stream_events(await client.post(COMPLETIONS, json=body))
    assert {e["usage"]["prompt_tokens_details"]["cached_tokens"] for e in events} == {64}
    body["stream_options"] = {"continuous_usage_stats": "yes"}
    error = assert_error(await client.post(COMPLETIONS, json=body), 400)
    assert error["param"] == "stream_options.continuous_usage_stats"


# -------------------------------------------------------------------- GET /v1/models/{id}


@pytest.fixture
async def openai_client(client: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client on the in-process app (the server ``client`` configured)."""
    from debugsite.asgi import application

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://127.0.0.1")
    async with openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="unused", http_client=http) as oa:
        yield oa


async def test_openai_models_retrieve(openai_client: openai.AsyncOpenAI) -> None:
    model = await openai_client.models.retrieve(TRACED)
    assert (model.id, model.object, model.owned_by) == (TRACED, "model", "engines")
    listed = {m.id: m.created async for m in openai_client.models.list()}
    assert model.created == listed[TRACED]
    with pytest.raises(openai.NotFoundError, match='"nope" does not exist'):
        await openai_client.models.retrieve("nope")


async def test_retrieve_unknown_model_is_a_404_in_error_shape(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.get("/v1/models/org/not-served"), 404)
    assert error["param"] == "model" and '"org/not-served"' in error["message"] and TRACED in error["message"]
    assert_error(await client.post(f"/v1/models/{TRACED}"), 405)
    assert (await client.head(f"/v1/models/{TRACED}")).status_code == 200


async def test_retrieve_model_needs_the_api_key_as_the_list_does(serve) -> None:
    async with serve(api_key="sekrit") as http:
        assert_error(await http.get(f"/v1/models/{TRACED}"), 401)
        reply = await http.get(f"/v1/models/{TRACED}", headers={"Authorization": "Bearer sekrit"})
        assert reply.status_code == 200 and reply.json()["id"] == TRACED


# ------------------------------------------------------------------------- X-Request-Id


def chat(**extra) -> dict:
    return {"model": TRACED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}


async def test_client_request_id_names_the_request_and_is_echoed(client: httpx.AsyncClient) -> None:
    reply = await client.post(CHAT, json=chat(), headers={"X-Request-Id": "req_7f3a"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "req_7f3a"
    assert reply.json()["id"] == "req_7f3a"
    engine = registry.get(TRACED)
    assert "req_7f3a" in engine.engine.tracer.request_ids()  # its trace lane
    ended = (await engine.dashboard_reading()).ended
    assert ended[0]["request_id"] == "req_7f3a"  # what the history records


async def test_user_still_names_the_request_and_the_header_stays_the_client_s(client: httpx.AsyncClient) -> None:
    reply = await client.post(COMPLETIONS, json={"model": TRACED, "prompt": "Hi", "max_tokens": 2, "user": "alice-1"},
                              headers={"X-Request-Id": "trace-42"})
    assert reply.json()["id"] == "alice-1" and reply.headers["x-request-id"] == "trace-42"


async def test_without_one_the_reply_names_the_id_the_request_ran_under(client: httpx.AsyncClient) -> None:
    reply = await client.post(COMPLETIONS, json={"model": TRACED, "prompt": "Hi", "max_tokens": 2})
    assert reply.json()["id"].startswith("cmpl-") and reply.headers["x-request-id"] == reply.json()["id"]
    streamed = await client.post(CHAT, json=chat(stream=True))
    first = sse_payloads(streamed.text)[0]
    assert streamed.headers["x-request-id"] == first["id"] and first["id"].startswith("chatcmpl-")


@pytest.mark.parametrize("sent", ["has spaces in it", "x" * 257, ""])
async def test_an_unusable_request_id_is_replaced(client: httpx.AsyncClient, sent: str) -> None:
    reply = await client.post(COMPLETIONS, json={"model": TRACED, "prompt": "Hi", "max_tokens": 2},
                              headers={"X-Request-Id": sent})
    assert reply.status_code == 200
    assert reply.json()["id"].startswith("cmpl-") and reply.headers["x-request-id"] == reply.json()["id"]


async def test_a_request_id_in_flight_twice_runs_twice(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=12, ignore_eos=True)
    one, two = await asyncio.gather(*(client.post(CHAT, json=body, headers={"X-Request-Id": "dup"}) for _ in "12"))
    ids = sorted(r.json()["id"] for r in (one, two))
    assert ids[0] == "dup" and ids[1].startswith("dup-")
    assert one.headers["x-request-id"] == two.headers["x-request-id"] == "dup"


async def test_every_reply_echoes_it_errors_and_other_routes_too(serve) -> None:
    sent = {"X-Request-Id": "e-1"}
    async with serve(api_key="sekrit") as http:
        assert_error(unauthorized := await http.get("/v1/models", headers=sent), 401)
        assert unauthorized.headers["x-request-id"] == "e-1"
        sent["Authorization"] = "Bearer sekrit"
        for reply in (await http.post(CHAT, json={"model": TRACED}, headers=sent),  # 400
                      await http.get("/v1/nothing", headers=sent),  # 404
                      await http.get("/v1/models", headers=sent),
                      await http.get("/health", headers=sent)):
            assert reply.headers["x-request-id"] == "e-1", reply.url
        generated = await http.get("/health")
        assert len(generated.headers["x-request-id"]) == 32


# ------------------------------------------------------- /tokenize, /detokenize, /version


async def test_tokenize_counts_what_a_completion_prompts_with(client: httpx.AsyncClient) -> None:
    prompt = "Once upon a time, in a land far away"
    tokenized = await client.post("/tokenize", json={"model": TRACED, "prompt": prompt})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["token_strs"] is None
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == registry.get(TRACED).max_seq_len
    used = (await client.post(COMPLETIONS, json={"model": TRACED, "prompt": prompt, "max_tokens": 1})).json()
    assert used["usage"]["prompt_tokens"] == body["count"]
    tokenizer = registry.get(TRACED).tokenizer
    assert body["tokens"] == tokenizer.encode(prompt)
    bare = (await client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False,
                                                 "return_token_strs": True})).json()  # model left out: the first
    assert bare["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert bare["token_strs"] == [tokenizer.id_to_token(t) for t in bare["tokens"]]
    back = await client.post("/detokenize", json={"model": TRACED, "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


async def test_tokenize_a_chat_counts_what_the_chat_route_prompts_with(client: httpx.AsyncClient) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}]
    body = (await client.post("/tokenize", json={"model": TRACED, "messages": messages})).json()
    used = (await client.post(CHAT, json={"model": TRACED, "messages": messages, "max_tokens": 1})).json()
    assert body["count"] == used["usage"]["prompt_tokens"]
    without = (await client.post("/tokenize", json={"model": TRACED, "messages": messages,
                                                    "add_generation_prompt": False})).json()
    assert without["count"] < body["count"] and body["tokens"][:without["count"]] == without["tokens"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": TRACED}, "prompt"),
    ("/tokenize", {"model": TRACED, "prompt": 7}, "prompt"),
    ("/tokenize", {"model": TRACED, "prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"model": TRACED, "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    ("/tokenize", {"model": TRACED, "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False,
                   "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"model": TRACED, "tokens": [1, -2]}, "tokens[1]"),
    ("/detokenize", {"model": TRACED, "tokens": [1, "2"]}, "tokens[1]"),
    ("/detokenize", {"model": TRACED, "tokens": [1, 10**9]}, "tokens"),
])
async def test_tokenize_and_detokenize_refuse_bad_bodies(client: httpx.AsyncClient, path: str, body: dict,
                                                         param: str) -> None:
    assert assert_error(await client.post(path, json=body), 400)["param"] == param


async def test_tokenize_unknown_model_is_404_and_the_routes_need_the_key(serve) -> None:
    async with serve(api_key="sekrit") as http:
        for path, method in (("/tokenize", "POST"), ("/detokenize", "POST"), ("/version", "GET")):
            assert_error(await http.request(method, path, json={"prompt": "x", "tokens": [1]}), 401)
        key = {"Authorization": "Bearer sekrit"}
        assert_error(await http.post("/tokenize", json={"model": "nope", "prompt": "x"}, headers=key), 404)
        assert_error(await http.get("/tokenize", headers=key), 405)
        version = await http.get("/version", headers=key)
        assert version.status_code == 200 and version.json() == {"version": engines.__version__}


# ------------------------------------ vLLM's control routes: /reset_prefix_cache, profiles

CONTROL = ["/reset_prefix_cache", "/start_profile", "/stop_profile"]


def cached_tokens(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_reset_prefix_cache_empties_every_engine_s_cache_and_nothing_else(client: httpx.AsyncClient) -> None:
    shared = list(range(300, 364))
    for model in (TRACED, UNTRACED):
        await client.post(COMPLETIONS, json={"model": model, "prompt": shared + [1], "max_tokens": 1})
        assert cached_tokens(await client.post(COMPLETIONS, json={"model": model, "prompt": shared + [2],
                                                                  "max_tokens": 1})) == 64
    # A request streaming meanwhile runs on: its pages stay its own.
    body = {"model": TRACED, "prompt": shared + [3], "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    stream = asyncio.create_task(client.post(COMPLETIONS, json=body))
    engine = registry.get(TRACED)
    await wait_until(lambda: engine.num_streams > 0)
    metrics_before = (await client.post("/debug/dump_engine_metrics", json={"model": TRACED})).json()["metrics"]
    reply = await client.post("/reset_prefix_cache", content=b"")  # aiperf posts nothing
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] == "reset" and set(reply.json()["engines"]) == {TRACED, UNTRACED}
    assert reply.json()["engines"][TRACED]["pinned_pages"] == 0
    events = sse_payloads((await stream).text)
    assert events[-2]["usage"]["completion_tokens"] == 40 and events[-3]["choices"][0]["finish_reason"] == "length"
    for model in (TRACED, UNTRACED):
        assert cached_tokens(await client.post(COMPLETIONS, json={"model": model, "prompt": shared + [4],
                                                                  "max_tokens": 1})) == 0
    # Not a reset: the metrics keep counting.
    metrics = (await client.post("/debug/dump_engine_metrics", json={"model": TRACED})).json()["metrics"]
    assert metrics["completion_tokens_sum"] > metrics_before["completion_tokens_sum"]


async def test_reset_prefix_cache_of_one_named_engine(client: httpx.AsyncClient) -> None:
    reply = await client.post("/reset_prefix_cache", json={"model": UNTRACED})
    assert reply.status_code == 200 and set(reply.json()["engines"]) == {UNTRACED}
    assert_error(await client.post("/reset_prefix_cache", json={"model": "nope"}), 400)
    assert_error(await client.get("/reset_prefix_cache"), 405)


@pytest.mark.django_db(transaction=True)
async def test_start_and_stop_profile_are_the_built_in_profiler(client: httpx.AsyncClient) -> None:
    started = await client.post("/start_profile", content=b"")
    assert started.status_code == 200 and started.json()["status"] == "profiling"
    assert started.json()["model"] == TRACED  # no model: the first engine
    await client.post(COMPLETIONS, json={"model": TRACED, "prompt": "Hi", "max_tokens": 2})
    stopped = await client.post("/stop_profile", content=b"{}")
    assert stopped.status_code == 200 and stopped.json()["profile_id"] > 0 and stopped.json()["steps"] > 0
    assert_error(await client.post("/stop_profile"), 409)  # none running: as /debug/profile_stop


@pytest.mark.parametrize("path", CONTROL)
async def test_control_routes_exist_only_with_enable_debug(serve, path: str) -> None:
    async with serve(enable_debug=False) as http:
        assert "--enable-debug" in assert_error(await http.post(path), 404)["message"]


@pytest.mark.parametrize("path", CONTROL)
async def test_control_routes_need_the_api_key(serve, path: str) -> None:
    async with serve(api_key="sekrit") as http:
        assert_error(await http.post(path), 401)

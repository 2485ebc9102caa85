"""AsyncEngine: the engine thread behind asyncio callers."""
from __future__ import annotations

import asyncio
import json

import pytest

from engines.runtime.frontend.async_engine import AsyncEngine
from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from engines.runtime.core.request import EngineRequestError, GenerationRequest

from engines.runtime.core.request import GrammarMode
from tests.runtime.demo_engine import collect, consume, prompts, request


@pytest.fixture
def async_engine(demo):
    engine = AsyncEngine(demo, "demo", EngineConfig(max_num_seqs=32, num_pages=256, prefill_chunk_size=256),
                         backend="cpu", enable_tracing=True)
    engine.start()
    yield engine
    engine.shutdown()


async def test_32_concurrent_requests_complete(async_engine, demo):
    reqs = [request(f"c{i}", p, max_tokens=8, ignore_eos=True)
            for i, p in enumerate(prompts(demo, 32, length=12))]
    results = await asyncio.gather(*(consume(async_engine, r) for r in reqs))
    assert all(len(r.tokens) == 8 and r.finish_reason == "length" for r in results)
    assert all(r.usage["completion_tokens"] == 8 for r in results)
    m = await async_engine.metrics()
    assert m["completion_tokens_sum"] == 256
    # Several requests shared decode steps: continuous batching, not one at a time.
    assert any(k.startswith("count{batch_size=") and int(k.split("=")[1][:-1]) > 1
               for k in m["decode_time_by_batch_size"])


async def test_streams_deliver_deltas_as_they_come(async_engine, demo):
    outputs = []
    async for out in async_engine.generate(request("s", prompts(demo, 1)[0], max_tokens=6,
                                                   ignore_eos=True)):
        outputs.append(out)
    # A consumer that keeps up gets a delta per token; on a loaded machine two steps may finish
    # before it wakes, and their deltas come merged (the next test): never all at the end.
    assert 2 <= len(outputs) <= 6 and sum(len(c.token_ids) for o in outputs for c in o.choices) == 6
    assert all(len(o.choices[0].token_ids) >= 1 for o in outputs)
    assert outputs[-1].usage is not None and all(o.usage is None for o in outputs[:-1])


async def test_a_consumer_that_falls_behind_gets_merged_deltas(async_engine, demo):
    """Outputs that piled up are joined: same text and tokens, fewer chunks, usage at the end."""
    def req(rid: str) -> GenerationRequest:
        return request(rid, prompts(demo, 1)[0], max_tokens=12, n=2, temperature=1.0, seed=3, logprobs=True,
                       ignore_eos=True)

    fast = await consume(async_engine, req("fast"))
    outputs = []
    async for out in async_engine.generate(req("slow")):
        outputs.append(out)
        await asyncio.sleep(0.2)  # a slow client: several steps' outputs wait in the queue
    slow: dict = {}
    collect(slow, outputs)
    got = slow["slow"]
    assert len(outputs) < 12
    assert got.token_ids == fast.token_ids and got.texts == fast.texts
    assert {i: [lp.token_id for lp in got.logprobs[i]] for i in (0, 1)} == got.token_ids
    assert got.finish_reasons == {0: "length", 1: "length"} and outputs[-1].usage is not None


async def test_bad_request_raises_before_output_and_engine_keeps_serving(async_engine, demo):
    with pytest.raises(EngineRequestError):
        async for _ in async_engine.generate(request("bad", [demo.config.vocab_size + 1])):
            pass
    res = await consume(async_engine, request("ok", prompts(demo, 1)[0], max_tokens=3))
    assert res.usage is not None and async_engine.is_alive


async def test_cancelled_consumer_aborts_and_frees_pages(async_engine, demo):
    gen = async_engine.generate(request("gone", prompts(demo, 1)[0], max_tokens=500,
                                        ignore_eos=True))
    await gen.__anext__()
    await gen.aclose()  # what a client disconnect does to a streaming view
    for _ in range(100):
        if not async_engine.engine.has_work:
            break
        await asyncio.sleep(0.02)
    assert not async_engine.engine.has_work
    assert async_engine.engine.kv_pool.num_used_pages == 0


async def test_reset_aborts_live_streams_and_completes_before_returning(async_engine, demo):
    reqs = [request(f"l{i}", p, max_tokens=400, ignore_eos=True)
            for i, p in enumerate(prompts(demo, 4))]
    tasks = [asyncio.create_task(consume(async_engine, r)) for r in reqs]
    while (await async_engine.metrics())["num_running_requests"] < 4:
        await asyncio.sleep(0.01)
    await async_engine.reset()
    m = await async_engine.metrics()  # read right after: the reset already happened
    assert m["num_running_requests"] == 0 and m["kv_pages_used"] == 0
    results = await asyncio.gather(*tasks)
    assert all(r.finish_reason == "abort" for r in results)
    assert async_engine.is_alive



async def test_duplicate_request_id_is_refused_and_the_first_stream_completes(async_engine, demo):
    first = asyncio.create_task(consume(async_engine, request("dup", prompts(demo, 1)[0], max_tokens=20,
                                                              ignore_eos=True)))
    await asyncio.sleep(0)  # let the first register its stream
    with pytest.raises(EngineRequestError, match="already running"):
        await consume(async_engine, request("dup", prompts(demo, 1)[0], max_tokens=5))
    res = await asyncio.wait_for(first, 30)
    assert len(res.tokens) == 20 and res.finish_reason == "length"


async def test_a_request_failing_mid_stream_ends_alone_and_the_engine_keeps_serving(async_engine, demo, monkeypatch):
    """A grammar error while consuming a token aborts that stream; the others, and later ones, run on."""
    real_consume = GrammarMatcher.consume

    def consume_then_fail(self, token_ids):
        self.consumed = getattr(self, "consumed", 0) + 1
        if self.consumed > 3:
            raise GrammarError("grammar rejected token(s) [42]: injected")
        real_consume(self, token_ids)

    monkeypatch.setattr(GrammarMatcher, "consume", consume_then_fail)
    p_good, p_bad = prompts(demo, 2, seed=9)
    good = asyncio.create_task(consume(async_engine, request("good", p_good, max_tokens=30, ignore_eos=True)))
    bad = await asyncio.wait_for(consume(async_engine, request(
        "bad", p_bad, max_tokens=30, response_format={"type": "json_object"},
        grammar_mode=GrammarMode.CONSTRAINT)), 30)
    assert bad.finish_reason == "abort" and bad.usage is not None
    res = await asyncio.wait_for(good, 30)
    assert len(res.tokens) == 30 and res.finish_reason == "length"
    assert async_engine.is_alive
    assert (await consume(async_engine, request("after", p_good, max_tokens=3))).usage["completion_tokens"] == 3
    events = json.loads(async_engine.engine.tracer.dump_json())["traceEvents"]
    assert any(e["name"] == "request error" for e in events)


async def test_a_format_the_tokenizer_cannot_serve_is_a_bad_request(async_engine, demo):
    """It used to raise a plain ValueError on the engine thread: the engine died, the caller hung."""
    async_engine.engine.grammars = GrammarCompiler(demo.tokenizer.tokenizer_json, 10, demo.eos_token_ids)
    with pytest.raises(EngineRequestError, match="response_format: structured output is unavailable for this model"):
        await asyncio.wait_for(consume(async_engine, request("json", prompts(demo, 1)[0],
                                                             response_format={"type": "json_object"})), 30)
    assert async_engine.is_alive
    assert (await consume(async_engine, request("text", prompts(demo, 1)[0], max_tokens=3))).usage


async def test_an_unexpected_error_adding_a_request_fails_only_that_request(async_engine, demo, monkeypatch):
    def broken(response_format):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(async_engine.engine.grammars, "compile", broken)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        await asyncio.wait_for(consume(async_engine, request("json", prompts(demo, 1)[0])), 30)
    monkeypatch.undo()
    assert async_engine.is_alive and not async_engine.engine.has_work
    assert (await consume(async_engine, request("text", prompts(demo, 1)[0], max_tokens=3))).usage


async def test_a_finished_stream_frees_its_request_id_at_once(async_engine, demo):
    """The id is free when the last output is out, not when the consumer gets round to closing
    the generator (a view still holding it, a client reusing its ``user`` as the id)."""
    gen = async_engine.generate(request("same", prompts(demo, 1)[0], max_tokens=2))
    async for out in gen:
        if out.finished:
            break
    again = await asyncio.wait_for(consume(async_engine, request("same", prompts(demo, 1)[0], max_tokens=2)), 30)
    assert again.usage is not None
    await gen.aclose()  # closing the first stream late must not touch the second's
    assert (await consume(async_engine, request("same", prompts(demo, 1)[0], max_tokens=2))).usage is not None


async def test_reset_does_not_hang_when_the_engine_dies_first(async_engine, demo, monkeypatch):
    import threading

    from engines.runtime.frontend.async_engine import EngineDeadError

    gate = threading.Event()

    def die() -> None:
        gate.wait()
        raise RuntimeError("boom")

    monkeypatch.setattr(async_engine.engine, "step", die)
    stream = asyncio.create_task(consume(async_engine, request("victim", prompts(demo, 1)[0], max_tokens=5)))
    await asyncio.sleep(0.05)  # the engine thread is inside step() now
    reset = asyncio.create_task(async_engine.reset())  # queued behind the internal error
    await asyncio.sleep(0.05)
    gate.set()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(reset, 10)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(stream, 10)
    assert not async_engine.is_alive
    with pytest.raises(EngineDeadError):
        await async_engine.metrics()


async def test_metrics_are_answered_while_a_step_is_running(async_engine, demo, monkeypatch):
    """A scrape must not wait for a long prefill step: metrics reads skip the command queue."""
    import threading

    gate, inside = threading.Event(), threading.Event()
    real_step = async_engine.engine.step

    def slow_step():
        inside.set()
        gate.wait(30)
        return real_step()

    monkeypatch.setattr(async_engine.engine, "step", slow_step)
    stream = asyncio.create_task(consume(async_engine, request("slow", prompts(demo, 1)[0], max_tokens=2)))
    assert await asyncio.to_thread(inside.wait, 10)
    try:
        m = await asyncio.wait_for(async_engine.metrics(), 5)  # the engine thread is stuck in step()
        assert m["num_waiting_requests"] + m["num_running_requests"] == 1
    finally:
        gate.set()
    assert (await asyncio.wait_for(stream, 30)).usage["completion_tokens"] == 2

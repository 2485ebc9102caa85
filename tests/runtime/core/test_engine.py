"""The synchronous engine: batching, KV pressure, sampling and stop rules, the debug options
(ignore_eos, pinned prompts, grammar modes), reset."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from engines.runtime.core.grammar import GrammarError
from engines.runtime.core.limits import REQUEST_LIMITS
from engines.runtime.core.request import EngineRequestError, GenerationRequest

from engines.runtime.core.request import GrammarMode
from engines.runtime.core.warm_up import warm_up
from tests.runtime.demo_engine import collect, prompts, request, run_all


def test_greedy_matches_model_argmax_step_by_step(make_engine, demo, demo_model):
    """The engine's greedy tokens are the model's argmax, recomputed here from scratch each step."""
    from engines.runtime.model.forward_batch import ForwardBatch

    engine = make_engine()
    prompt = prompts(demo, 1, 12)[0]
    out = run_all(engine, [request("a", prompt, max_tokens=5, ignore_eos=True)])["a"]
    kv = demo_model.new_kv_cache(8, 16)
    seq = list(prompt)
    expected = []
    for _ in range(5):
        batch = ForwardBatch(np.array(seq, np.int32), np.array([0, len(seq)], np.int32),
                             np.array([0], np.int32), np.arange(8, dtype=np.int32)[None, :])
        tok = int(np.argmax(demo_model.forward(batch, kv)[0]))
        expected.append(tok)
        seq.append(tok)
    assert out.tokens == expected
    assert out.finish_reason == "length"


def test_ignore_eos_gives_exactly_max_tokens(make_engine, demo):
    engine = make_engine()
    eos = demo.eos_token_ids[0]
    # A bias that makes EOS the argmax: without ignore_eos the request would stop at once.
    res = run_all(engine, [
        request("ignore", prompts(demo, 1)[0], max_tokens=17, logit_bias={eos: 100},
                ignore_eos=True),
        request("stops", prompts(demo, 1)[0], max_tokens=17, logit_bias={eos: 100}),
    ])
    assert len(res["ignore"].tokens) == 17 and res["ignore"].finish_reason == "length"
    assert res["ignore"].usage["completion_tokens"] == 17
    assert res["stops"].finish_reason == "stop" and len(res["stops"].tokens) == 1


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=3), dict(logprobs=True)])
def test_min_tokens_holds_eos_off_until_then_it_may_stop(make_engine, demo, sampling):
    """vLLM's min_tokens: EOS (made the argmax by a bias) is banned from the first 6 tokens, then ends
    the request; greedy or sampled, with or without logprobs."""
    eos = demo.eos_token_ids[0]
    p = prompts(demo, 1)[0]
    res = run_all(make_engine(), [request("a", p, max_tokens=17, logit_bias={eos: 100}, min_tokens=6,
                                          **sampling)])["a"]
    assert res.finish_reason == "stop"
    assert len(res.tokens) == 7 and res.tokens[-1] == eos and eos not in res.tokens[:6]
    assert res.usage["completion_tokens"] == 7


def test_min_tokens_holds_stop_tokens_and_stop_strings(make_engine, demo):
    p = prompts(demo, 1)[0]
    free = run_all(make_engine(), [request("a", p, max_tokens=16, ignore_eos=True)])["a"]
    target = free.tokens[1]
    held = run_all(make_engine(), [request("a", p, max_tokens=16, stop_token_ids=[target], min_tokens=4)])["a"]
    assert target not in held.tokens[:4]
    stop = free.text[:3]  # at the very start: without min_tokens the text would be empty
    assert run_all(make_engine(), [request("a", p, max_tokens=16, stop=[stop])])["a"].text == ""
    late = run_all(make_engine(), [request("a", p, max_tokens=16, stop=[stop], min_tokens=16)])["a"]
    assert late.finish_reason == "length" and len(late.tokens) == 16


def test_usage_says_the_prompt_tokens_the_prefix_cache_served(make_engine, demo):
    engine = make_engine(num_pages=64)
    shared = prompts(demo, 1, length=48)[0]
    first = run_all(engine, [request("a", shared + [400, 401], max_tokens=2)])["a"]
    assert first.usage["prompt_tokens_details"] == {"cached_tokens": 0}
    second = run_all(engine, [request("b", shared + [500, 501, 502], max_tokens=2)])["b"]
    assert second.usage["prompt_tokens_details"] == {"cached_tokens": 48}
    assert engine.reset_prefix_cache() == {"dropped_pages": 3, "pinned_pages": 0}
    third = run_all(engine, [request("c", shared + [600], max_tokens=2)])["c"]
    assert third.usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_same_seed_same_output_even_in_different_batches(make_engine, demo):
    p = prompts(demo, 3)
    solo = run_all(make_engine(), [request("s", p[0], temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)])
    batched = run_all(make_engine(), [
        request("x", p[1], temperature=1.0, max_tokens=12),
        request("s", p[0], temperature=1.0, top_p=0.9, seed=1234, max_tokens=12),
        request("y", p[2], temperature=0.7, max_tokens=12),
    ])
    other_seed = run_all(make_engine(), [request("s", p[0], temperature=1.0, top_p=0.9, seed=99, max_tokens=12)])
    assert solo["s"].tokens == batched["s"].tokens
    assert solo["s"].tokens != other_seed["s"].tokens


def test_stop_string_trims_output(make_engine, demo):
    tok = demo.tokenizer
    p = prompts(demo, 1)[0]
    free = run_all(make_engine(), [request("a", p, max_tokens=24, ignore_eos=True)])["a"]
    text = free.text
    assert len(text) > 12
    stop = text[6:9]
    cut = text.index(stop)
    stopped = run_all(make_engine(), [request("a", p, max_tokens=24, stop=[stop])])["a"]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert tok.decode(stopped.tokens).startswith(text[:cut])
    # ignore_eos ignores stop strings too (MLC).
    ignored = run_all(make_engine(), [request("a", p, max_tokens=24, stop=[stop],
                                              ignore_eos=True)])["a"]
    assert ignored.text == text and ignored.finish_reason == "length"


def test_stop_token_ids(make_engine, demo):
    p = prompts(demo, 1)[0]
    free = run_all(make_engine(), [request("a", p, max_tokens=10, ignore_eos=True)])["a"]
    target = free.tokens[4]
    first = free.tokens.index(target)
    res = run_all(make_engine(), [request("a", p, max_tokens=10, stop_token_ids=[target])])["a"]
    assert res.finish_reason == "stop"
    assert res.tokens == free.tokens[:first + 1]


def test_n_choices_and_logprobs(make_engine, demo):
    res = run_all(make_engine(), [request("a", prompts(demo, 1)[0], n=3, temperature=1.0, seed=7,
                                          max_tokens=6, logprobs=True, top_logprobs=3,
                                          ignore_eos=True)])["a"]
    assert sorted(res.token_ids) == [0, 1, 2]
    assert all(len(res.token_ids[i]) == 6 for i in range(3))
    assert len({tuple(res.token_ids[i]) for i in range(3)}) > 1
    assert res.usage["completion_tokens"] == 18
    for i in range(3):
        lps = res.logprobs[i]
        assert [lp.token_id for lp in lps] == res.token_ids[i]
        for lp in lps:
            assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
            assert lp.top_logprobs[0][1] >= lp.logprob - 1e-5


def test_kv_pressure_preempts_and_output_is_unchanged(make_engine, demo):
    """A pool too small for the load forces preemptions; greedy output is the same as with room."""
    def reqs() -> list[GenerationRequest]:
        return [request(f"r{i}", p, max_tokens=24, ignore_eos=True)
                for i, p in enumerate(prompts(demo, 6, length=30, seed=3))]

    roomy = make_engine(num_pages=128)
    tight = make_engine(num_pages=12, enable_prefix_cache=False)
    expected = run_all(roomy, reqs())
    got = run_all(tight, reqs())
    assert tight.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0
    for rid, res in expected.items():
        assert got[rid].tokens == res.tokens, rid
        assert got[rid].finish_reason == "length"
    assert tight.kv_pool.num_used_pages == 0
    assert tight.metrics.as_dict()["num_preemptions"] == tight.scheduler.num_preemptions


def test_chunked_prefill_long_prompt_matches_single_chunk(make_engine, demo):
    p = prompts(demo, 1, length=150)[0]
    small = run_all(make_engine(prefill_chunk_size=16), [request("a", p, max_tokens=6)])["a"]
    large = run_all(make_engine(prefill_chunk_size=256), [request("a", p, max_tokens=6)])["a"]
    assert small.tokens == large.tokens


def test_prefix_cache_reuses_pages(make_engine, demo):
    engine = make_engine(num_pages=64)
    shared = prompts(demo, 1, length=48)[0]
    run_all(engine, [request("a", shared + [400, 401], max_tokens=2)])
    before = engine.metrics.as_dict()["prefill_tokens_sum"]
    run_all(engine, [request("b", shared + [500, 501, 502], max_tokens=2)])
    assert engine.metrics.as_dict()["prefill_tokens_sum"] - before == 3
    assert engine.kv_pool.usage().hit_tokens == 48


def test_pinned_system_prompt_survives_eviction(make_engine, demo):
    """MLC's arithmetic: the pinned prompt is prefilled once; an unpinned one again after eviction."""
    engine = make_engine(num_pages=16, max_num_seqs=4)
    system_pinned, system_plain = prompts(demo, 2, length=64, seed=11)
    filler = prompts(demo, 3, length=120, seed=12)

    def prefill_of(req):
        before = engine.metrics.as_dict()["prefill_tokens_sum"]
        run_all(engine, [req])
        return engine.metrics.as_dict()["prefill_tokens_sum"] - before

    assert prefill_of(request("p1", system_pinned + [300, 301], max_tokens=1, pin_system_prompt=True,
                              system_prompt_tokens=64)) == 66
    assert prefill_of(request("u1", system_plain + [300, 301], max_tokens=1)) == 66
    for i, f in enumerate(filler):  # enough distinct tokens to evict every unpinned cached page
        prefill_of(request(f"f{i}", f, max_tokens=1))
    assert prefill_of(request("p2", system_pinned + [302, 303, 304], max_tokens=1)) == 3
    assert prefill_of(request("u2", system_plain + [302, 303, 304], max_tokens=1)) == 67
    engine.reset()
    assert engine.kv_pool.num_pinned_pages == 0
    assert prefill_of(request("p3", system_pinned + [302], max_tokens=1)) == 65


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "color", "address"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("mode", ["constraint", "jump_forward"])
def test_json_schema_output_is_valid(make_engine, demo, mode):
    engine = make_engine()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    res = run_all(engine, [request("a", prompts(demo, 1)[0], max_tokens=200, temperature=0.8, seed=5,
                                   response_format=fmt,
                                   grammar_mode=mode)])["a"]
    assert res.finish_reason == "stop", res.text
    jsonschema.validate(json.loads(res.text), SCHEMA)


def test_jump_forward_runs_fewer_model_steps(make_engine, demo):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    steps, texts = {}, {}
    for mode in ("constraint", "jump_forward"):
        engine = make_engine()
        res = run_all(engine, [request("a", prompts(demo, 1)[0], max_tokens=200, response_format=fmt,
                                       grammar_mode=mode)])["a"]
        steps[mode], texts[mode] = engine.num_steps, res.text
        jump = engine.metrics.as_dict()["jump_forward_tokens_sum"]
        assert (jump > 0) == (mode == "jump_forward")
    jsonschema.validate(json.loads(texts["jump_forward"]), SCHEMA)
    assert steps["jump_forward"] < steps["constraint"]


def test_json_object_mode(make_engine, demo):
    res = run_all(make_engine(), [request("a", prompts(demo, 1)[0], max_tokens=120, temperature=0.9, seed=3,
                                          response_format={"type": "json_object"})])["a"]
    if res.finish_reason == "stop":
        assert isinstance(json.loads(res.text), dict)
    else:  # ran out of tokens inside the object: still a valid prefix of one
        assert res.text.startswith("{")


def test_bad_request_fails_alone(make_engine, demo):
    engine = make_engine()
    good = request("good", prompts(demo, 1)[0], max_tokens=4)
    engine.add_request(good)
    with pytest.raises(EngineRequestError, match="outside the vocabulary"):
        engine.add_request(request("bad", [demo.config.vocab_size + 5]))
    with pytest.raises(EngineRequestError, match="logit_bias"):
        engine.add_request(request("bad2", [400], logit_bias={demo.config.vocab_size + 1: 1.0}))
    with pytest.raises(EngineRequestError, match="context holds at most"):
        engine.add_request(request("long", [400] * (engine.max_seq_len + 1)))
    with pytest.raises(EngineRequestError, match="response_format"):
        engine.add_request(request("schema", [400], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}))
    for bad_id in ("", "i" * (REQUEST_LIMITS.max_request_id_chars + 1)):
        with pytest.raises(EngineRequestError, match="request id must be 1 to"):
            engine.add_request(request(bad_id, [400]))
    engine.add_request(request("i" * REQUEST_LIMITS.max_request_id_chars, [400], max_tokens=2))
    results = run_all(engine, [])
    assert results["good"].finish_reason in ("length", "stop")


def test_abort_frees_pages(make_engine, demo):
    engine = make_engine()
    engine.add_request(request("a", prompts(demo, 1)[0], max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_pool.num_used_pages > 0
    out = engine.abort_request("a")
    assert out.choices[0].finish_reason == "abort" and out.usage is not None
    assert engine.kv_pool.num_used_pages == 0 and not engine.has_work


def test_reset_under_load_zeroes_everything(make_engine, demo):
    engine = make_engine(tracing=True)
    for i, p in enumerate(prompts(demo, 5)):
        engine.add_request(request(f"r{i}", p, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    run_all(engine, [])  # some finish, for non-zero sums
    for i, p in enumerate(prompts(demo, 5, seed=1)):
        engine.add_request(request(f"s{i}", p, max_tokens=30, ignore_eos=True))
    engine.step()
    events_before = engine.tracer.event_count
    outputs = engine.reset()
    assert {o.request_id for o in outputs} == {f"s{i}" for i in range(5)}
    assert all(c.finish_reason == "abort" for o in outputs for c in o.choices)
    m = engine.metrics.as_dict()
    for key in ("prompt_tokens_sum", "completion_tokens_sum", "prefill_tokens_sum", "decode_tokens_sum",
                "engine_prefill_time_sum", "engine_decode_time_sum", "num_running_requests",
                "num_waiting_requests", "kv_pages_used"):
        assert m[key] == 0, key
    assert all(v == 0 for v in m["last_finished_request"].values() if isinstance(v, (int, float)))
    assert not engine.has_work and engine.kv_pool.num_used_pages == 0
    assert engine.tracer.event_count >= events_before  # the trace is kept unless asked (aborts add "finish")
    engine.reset(clear_trace=True)
    assert engine.tracer.event_count == 0
    # The engine still serves after a reset.
    assert run_all(engine, [request("after", prompts(demo, 1)[0], max_tokens=3)])["after"].usage


def test_metrics_after_run(make_engine, demo):
    engine = make_engine()
    res = run_all(engine, [request(f"r{i}", p, max_tokens=5, ignore_eos=True)
                           for i, p in enumerate(prompts(demo, 4, length=10))])
    m = engine.metrics.as_dict()
    assert m["prompt_tokens_sum"] == 40
    assert m["completion_tokens_sum"] == 20
    assert m["prefill_tokens_sum"] == 40
    assert m["engine_prefill_time_sum"] > 0 and m["engine_decode_time_sum"] > 0
    assert m["token_gap_s"]["count"] == 4 * 4  # one gap per token after each request's first
    assert m["decode_tokens_per_s"] > 0
    extra = res["r0"].usage["extra"]
    for key in ("ttft_s", "end_to_end_latency_s", "inter_token_latency_s", "prefill_tokens_per_s"):
        assert extra[key] > 0, key
    assert json.loads(json.dumps(m, allow_nan=False)) == m


def test_trace_of_a_run_is_well_formed(make_engine, demo):
    engine = make_engine(tracing=True, num_pages=8)
    reqs = [request(f"r{i}", p, max_tokens=10, ignore_eos=True)
            for i, p in enumerate(prompts(demo, 4, length=30))]
    run_all(engine, reqs)
    trace = json.loads(engine.tracer.dump_json())
    events = trace["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(lanes) >= {"engine", "r0", "r1", "r2", "r3"}
    for rid in ("r0", "r1", "r2", "r3"):
        lane = [e for e in events if e["tid"] == lanes[rid] and e["ph"] != "M"]
        names = [e["name"] for e in lane]
        # The queue span opens at the request's arrival (here: when the engine took it), an
        # instant before the engine's own event saying so.
        assert names[:2] == ["queue (0)", "request added to engine"] and names[-1] == "finish"
        assert lane[0]["ph"] == "B" and lane[0]["ts"] <= lane[1]["ts"]
        assert any(n.startswith("prefill (") for n in names) and any(n.startswith("decode (") for n in names)
        stack = []
        for e in lane:  # valid nesting: every E closes the innermost open B of the same name
            if e["ph"] == "B":
                stack.append(e["name"])
            elif e["ph"] == "E":
                assert stack and stack.pop() == e["name"], (rid, e)
        assert not stack
        assert not any(e.get("args", {}).get("unclosed") for e in lane)
        finish = lane[-1]["args"]
        assert finish["finish_reason"] == "length" and finish["completion_tokens"] == 10
    assert any(e["name"] == "preempt" for e in events)


def test_pinned_pages_never_strand_a_request(make_engine, demo):
    """Pins shrink the pool for everyone else: a request that no longer fits ends, it never spins.

    Before, a sequence alone in the pool that needed a pinned page preempted itself
    and then waited for room that only a reset could make: the engine stepped forever.
    """
    engine = make_engine(num_pages=4)  # 64 token slots
    system, other, queued = prompts(demo, 3, length=40, seed=21)
    # Queued behind the pinned request: it fitted when it arrived, not after the pin.
    res = run_all(engine, [request("p", system, max_tokens=1, pin_system_prompt=True, system_prompt_tokens=32),
                           request("q", queued + queued[:12], max_tokens=4)], max_steps=200)
    assert engine.kv_pool.num_pinned_pages == 2
    assert res["q"].finish_reason == "length" and res["q"].usage["completion_tokens"] == 0
    # Runs to the context limit: fits at first, then needs a pinned page.
    res = run_all(engine, [request("a", other[:20], max_tokens=None, ignore_eos=True)],
                  max_steps=200)["a"]
    assert res.finish_reason == "length" and len(res.tokens) == 2 * 16 - 20 + 1
    assert engine.kv_pool.num_used_pages == engine.kv_pool.num_pinned_pages
    # A prompt that cannot fit beside the pins is refused at once, with the way out.
    with pytest.raises(EngineRequestError, match="pinned"):
        engine.add_request(request("long", other + other[:10]))
    assert not engine.has_work
    # One that shares the pinned prefix uses those pages and fits.
    assert run_all(engine, [request("s", system + [300] * 10, max_tokens=2)])["s"].usage["completion_tokens"] == 2
    engine.reset()
    assert run_all(engine, [request("long", other + other[:10], max_tokens=2)])["long"].usage["completion_tokens"] == 2


@pytest.mark.parametrize("mode", ["constraint", "jump_forward"])
def test_grammar_completed_on_the_last_allowed_token_finishes_with_stop(make_engine, demo, mode):
    """Complete output is "stop" whatever max_tokens was: "length" would tell the client it was cut."""
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "color": {"enum": ["red", "green", "blue"]}},
              "required": ["age", "color"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    p = prompts(demo, 1)[0]
    free = run_all(make_engine(), [request("a", p, max_tokens=100, response_format=fmt, grammar_mode=mode)])["a"]
    assert free.finish_reason == "stop"
    exact = run_all(make_engine(), [request("a", p, max_tokens=len(free.tokens), response_format=fmt,
                                            grammar_mode=mode)])["a"]
    assert exact.tokens == free.tokens and exact.text == free.text
    assert exact.finish_reason == "stop"
    cut = run_all(make_engine(), [request("a", p, max_tokens=len(free.tokens) - 1, response_format=fmt,
                                          grammar_mode=mode)])["a"]
    assert cut.finish_reason == "length"


def test_jump_forward_counts_only_the_tokens_it_output(make_engine, demo):
    """A stop string inside a forced run drops the rest of the run: those tokens are not counted."""
    engine = make_engine()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    res = run_all(engine, [request("a", prompts(demo, 1)[0], max_tokens=100, stop=["age"],
                                   response_format=fmt)])["a"]
    assert res.finish_reason == "stop"
    m = engine.metrics.as_dict()
    assert m["jump_forward_tokens_sum"] == res.usage["extra"]["jump_forward_tokens"] > 0
    assert m["jump_forward_tokens_processed"] == m["jump_forward_tokens_sum"]


def test_abort_before_scheduling_closes_the_queue_span(make_engine, demo):
    """Requests aborted (or reset) while still waiting end their trace lane cleanly, with usage."""
    engine = make_engine(tracing=True, max_num_seqs=1)
    for i, p in enumerate(prompts(demo, 3)):
        engine.add_request(request(f"r{i}", p, max_tokens=20))
    engine.step()
    out = engine.abort_request("r2")
    assert out.choices[0].finish_reason == "abort" and out.usage["completion_tokens"] == 0
    outputs = {o.request_id: o for o in engine.reset()}
    assert set(outputs) == {"r0", "r1"}
    assert outputs["r1"].choices[0].finish_reason == "abort" and outputs["r1"].usage["prompt_tokens"] == 20
    events = json.loads(engine.tracer.dump_json())["traceEvents"]
    assert not [e["name"] for e in events if e.get("args", {}).get("unclosed")]
    assert engine.kv_pool.num_used_pages == 0 and not engine.has_work


def _fail_after(calls: int, real, error: Exception):
    """A stand-in for ``real`` that raises ``error`` from its ``calls + 1``-th call on."""
    count = 0

    def fake(*args, **kwargs):
        nonlocal count
        count += 1
        if count > calls:
            raise error
        return real(*args, **kwargs)
    return fake


def _allow_nothing_after(calls: int, fill_mask):
    """A stand-in for ``GrammarMatcher.fill_mask`` that forbids every token from its ``calls + 1``-th call on."""
    count = 0

    def fake(out):
        nonlocal count
        count += 1
        fill_mask(out)
        if count > calls:
            out[:] = False
    return fake


@pytest.mark.parametrize("where", ["grammar consume", "grammar mask", "empty mask", "detokenizer"])
def test_a_request_failing_mid_stream_finishes_alone(make_engine, demo, where):
    """A per-request error (grammar, tokenizer) aborts that request; its batch mates are untouched."""
    p_good, p_bad = prompts(demo, 2, seed=9)
    expected = run_all(make_engine(), [request("good", p_good, max_tokens=12, n=2, temperature=1.0, seed=4,
                                               ignore_eos=True)])["good"]
    engine = make_engine()
    engine.add_request(request("good", p_good, max_tokens=12, n=2, temperature=1.0, seed=4, ignore_eos=True))
    engine.add_request(request("bad", p_bad, max_tokens=40, response_format={"type": "json_object"},
                               grammar_mode=GrammarMode.CONSTRAINT))
    seq = engine.requests["bad"].sequences[0]
    if where == "grammar consume":
        seq.grammar.consume = _fail_after(3, seq.grammar.consume, GrammarError("grammar rejected token(s)"))
    elif where == "grammar mask":
        seq.grammar.fill_mask = _fail_after(3, seq.grammar.fill_mask, GrammarError("grammar error"))
    elif where == "empty mask":  # a grammar that allows nothing: the sampler has no token to draw
        seq.grammar.fill_mask = _allow_nothing_after(3, seq.grammar.fill_mask)
    else:
        seq.detokenizer.add = _fail_after(3, seq.detokenizer.add, UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))
    res = run_all(engine, [])
    assert res["bad"].finish_reason == "abort" and res["bad"].usage is not None
    assert res["good"].token_ids == expected.token_ids
    assert res["good"].finish_reasons == {0: "length", 1: "length"}
    assert engine.kv_pool.num_used_pages == 0 and not engine.requests
    # The engine keeps serving.
    assert run_all(engine, [request("next", p_bad, max_tokens=3)])["next"].usage["completion_tokens"] == 3


def _byte_fallback_tokenizer():
    """A Llama 2-style tokenizer (``<0xNN>`` byte fallback) whose ids fit the demo model's vocabulary.

    "</s>" is id 1, one of the demo checkpoint's EOS ids.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from engines.runtime.model.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "▁": 259, "o": 260, "k": 261, "▁o": 262, "▁ok": 263}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "o"), ("▁o", "k")], byte_fallback=True,
                                unk_token="<unk>", fuse_unk=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    hf.decoder = decoders.Sequence([decoders.ByteFallback(),
                                    decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)])
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "</s>", "<s>")])
    return Tokenizer.from_json(hf.to_str(), {"eos_token": "</s>", "bos_token": "<s>"})


@pytest.mark.parametrize("ending", ["eos", "stop token", "length"])
def test_a_last_character_spelled_in_bytes_is_not_lost(make_engine, demo, monkeypatch, ending):
    """The detokenizer holds a byte-fallback run until it is known to be complete; the end of the
    choice completes it. Before, a reply ending in such a character (CJK, emoji) lost it."""
    tok = _byte_fallback_tokenizer()
    engine = make_engine()
    engine.tokenizer = tok
    text_ids = tok.encode("ok 日", add_special_tokens=False)
    assert set(text_ids[-3:]) <= tok.byte_fallback_ids
    end = {"eos": [1], "stop token": [tok.token_to_id("o")], "length": []}[ending]
    script = iter(text_ids + end)
    monkeypatch.setattr(engine.model, "forward_greedy", lambda batch, kv: np.array([next(script)], np.int32))
    res = run_all(engine, [request("a", [300, 301], max_tokens=len(text_ids + end),
                                   stop_token_ids=[tok.token_to_id("o")] if ending == "stop token" else [])])["a"]
    assert res.tokens == text_ids + end
    assert res.text == "ok 日"
    assert res.finish_reason == ("length" if ending == "length" else "stop")


def test_mixed_workload_under_kv_pressure_keeps_every_page_accounted_for(make_engine, demo):
    """Shared prefixes, n > 1, stop strings, grammars, logprobs, pins, aborts and preemptions at once:
    every request ends with usage, and once idle only the pinned pages are in use."""
    engine = make_engine(tracing=True, num_pages=10, prefill_chunk_size=16, max_num_seqs=4)
    shared = prompts(demo, 1, length=32, seed=30)[0]
    tails = prompts(demo, 8, length=12, seed=31)
    reqs = [
        request("pin", shared + tails[0], max_tokens=4, pin_system_prompt=True,
                system_prompt_tokens=32),
        request("n3", shared + tails[1], max_tokens=20, n=3, temperature=1.0, seed=1, stop=["e"]),
        request("json", shared + tails[2], max_tokens=40, response_format={"type": "json_object"}),
        request("lp", shared + tails[3], max_tokens=16, n=2, logprobs=True, top_logprobs=2, ignore_eos=True),
        request("long", tails[4] * 3, max_tokens=None, ignore_eos=True),
        request("abort-running", shared + tails[5], max_tokens=40, ignore_eos=True),
        request("abort-waiting", shared + tails[6], max_tokens=40, ignore_eos=True),
        request("last", tails[7], max_tokens=24, n=2, temperature=0.7, seed=2),
    ]
    results: dict = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        collect(results, engine.step())
    assert engine.requests["abort-waiting"].first_scheduled_time is None
    collect(results, [engine.abort_request("abort-running"), engine.abort_request("abort-waiting")])
    for _ in range(2000):
        if not engine.has_work:
            break
        collect(results, engine.step())
    assert not engine.has_work and not engine.requests
    assert engine.scheduler.num_preemptions > 0
    for r in reqs:
        res = results[r.request_id]
        assert res.usage is not None, r.request_id
        assert sorted(res.finish_reasons) == list(range(r.sampling.n)), r.request_id
        assert res.usage["completion_tokens"] == sum(len(t) for t in res.token_ids.values()), r.request_id
    assert results["abort-waiting"].finish_reason == "abort"
    assert results["long"].finish_reason == "length"
    pool = engine.kv_pool
    assert pool.num_pinned_pages == 2 and pool.num_used_pages == pool.num_pinned_pages
    m = engine.metrics.as_dict()
    assert json.loads(json.dumps(m, allow_nan=False)) == m
    assert all(v >= 0 for v in m.values() if isinstance(v, (int, float)))
    events = json.loads(engine.tracer.dump_json())["traceEvents"]
    assert not [e["name"] for e in events if e.get("args", {}).get("unclosed")]


def test_gauges_count_requests_not_choices(make_engine, demo):
    engine = make_engine(max_num_seqs=4)
    engine.add_request(request("n3", prompts(demo, 1)[0], max_tokens=10, n=3,
                               ignore_eos=True))
    engine.add_request(request("n2", prompts(demo, 1, seed=1)[0], max_tokens=10, n=2))
    engine.step()  # four choices run: n3's three and one of n2's; n2's second waits
    m = engine.metrics.as_dict()
    assert (m["num_running_requests"], m["num_waiting_requests"]) == (2, 1)


def test_warm_up_leaves_no_trace_in_results_or_metrics(make_engine, demo):
    p = prompts(demo, 1)[0]
    cold = run_all(make_engine(), [request("a", p, max_tokens=6)])["a"]
    engine = make_engine(tracing=True)
    warm_up(engine)
    warm = run_all(engine, [request("a", p, max_tokens=6)])["a"]
    assert warm.tokens == cold.tokens
    m = engine.metrics.as_dict()
    assert m["prompt_tokens_sum"] == len(p) and m["num_prefill_steps"] == 1
    assert engine.tracer.request_ids() == ["a"]
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        engine.kv_pool.admit(999, [1, 2, 3], 3)
        warm_up(engine)


def test_max_tokens_beyond_the_context_is_refused(make_engine, demo):
    engine = make_engine(num_pages=8)  # 128 tokens of context
    with pytest.raises(EngineRequestError, match="Lower max_tokens to at most 108"):
        engine.add_request(request("a", prompts(demo, 1)[0], max_tokens=200))
    # Unset max_tokens runs until the context is full.
    res = run_all(engine, [request("b", prompts(demo, 1)[0], max_tokens=None,
                                   ignore_eos=True)])["b"]
    assert len(res.tokens) == 108 and res.finish_reason == "length"


def test_ended_requests_are_remembered_newest_first_aborts_included(make_engine, demo):
    from engines.runtime.telemetry.metrics import RECENT_REQUESTS

    engine = make_engine()
    run_all(engine, [request("first", prompts(demo, 1)[0], max_tokens=3)])
    engine.add_request(request("gone", prompts(demo, 1, seed=1)[0], max_tokens=50))
    engine.step()
    engine.abort_request("gone")
    recent = engine.metrics.recent_requests()
    assert [r["request_id"] for r in recent] == ["gone", "first"]
    first = recent[1]
    assert (first["finish_reason"], first["prompt_tokens"], first["completion_tokens"]) == ("length", 20, 3)
    assert first["ttft_s"] > 0 and first["queue_s"] >= 0 and first["end_to_end_s"] >= first["ttft_s"]
    assert recent[0]["finish_reason"] == "abort"
    # Each keeps where its time went, for its request page (docs/metrics.md, "Anatomy of a request").
    assert sum(first["time_breakdown"].values()) == pytest.approx(first["end_to_end_s"], abs=1e-3)
    assert isinstance(first["diagnosis"], tuple)
    run_all(engine, [request(f"r{i}", prompts(demo, 1)[0], max_tokens=1) for i in range(RECENT_REQUESTS + 3)])
    recent = engine.metrics.recent_requests()
    assert len(recent) == RECENT_REQUESTS and recent[0]["request_id"] == f"r{RECENT_REQUESTS + 2}"
    engine.reset()
    assert engine.metrics.recent_requests() == []


def test_ttft_counts_when_the_first_token_comes_not_when_the_request_ends(make_engine, demo):
    engine = make_engine()
    for i, p in enumerate(prompts(demo, 3)):
        engine.add_request(request(f"t{i}", p, max_tokens=20, ignore_eos=True))
    while engine.metrics.as_dict()["ttft_s"]["count"] < 3:
        engine.step()
    m = engine.metrics.as_dict()
    assert m["num_finished_requests"] == 0 and m["num_running_requests"] == 3  # all still streaming
    assert m["ttft_s"]["last_60s"]["count"] == 3 and m["ttft_s"]["last_60s"]["p99"] > 0


def test_a_decode_in_a_step_that_prefills_another_request_is_a_decode_on_its_lane(make_engine, demo):
    """A step carries one request's prefill chunk and another's decode: each lane shows its own
    phase (the engine lane the step's), so the decoding request is not charged the prefill."""
    from tests.runtime.demo_engine import lane_events

    engine = make_engine(tracing=True, prefill_chunk_size=64)
    engine.add_request(request("early", prompts(demo, 1)[0], max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()  # its prefill, then decodes
    engine.add_request(request("late", prompts(demo, 1, length=150, seed=1)[0], max_tokens=2, ignore_eos=True))
    while engine.has_work:
        engine.step()
    trace = engine.tracer.dump()
    early = [e["name"] for e in lane_events(trace, "early") if e["ph"] in ("B", "X")]
    late = [e["name"] for e in lane_events(trace, "late") if e["ph"] in ("B", "X")]
    assert sum(name.startswith("prefill") for name in early) == 1  # its own, once
    assert sum(name.startswith("prefill") for name in late) == 3   # 150 tokens in chunks of at most 64
    engine_lane = [e for e in trace["traceEvents"] if e.get("tid") == 0 and e["ph"] in ("B", "X")]
    assert sum(e["name"].startswith("prefill") for e in engine_lane) == 4  # every step with a prefill in it


def test_a_request_s_life_counts_from_its_arrival_not_from_the_engine_taking_it(make_engine, demo):
    """A server stamps the arrival (engines.request_arrival) and hands the request over between
    two steps: its queue time, TTFT and end-to-end latency include the wait before the engine."""
    import time

    engine = make_engine(tracing=True)
    arrived = time.perf_counter() - 2.0  # two seconds ago, behind a long step
    stamped = request("late", prompts(demo, 1)[0], max_tokens=3, ignore_eos=True)
    stamped.arrival_time = arrived
    res = run_all(engine, [stamped, request("now", prompts(demo, 1)[0], max_tokens=3, ignore_eos=True)])
    late, now = res["late"].usage["extra"], res["now"].usage["extra"]
    assert late["queue_time_s"] >= 2.0 and late["ttft_s"] >= 2.0 and late["end_to_end_latency_s"] >= 2.0
    # Both were scheduled in the first step: they differ by the two seconds, whatever it cost.
    assert late["queue_time_s"] - now["queue_time_s"] == pytest.approx(2.0, abs=0.05)
    m = engine.metrics.as_dict()
    assert m["queue_time_s"]["max"] >= 2.0 and m["ttft_s"]["max"] >= 2.0
    assert m["end_to_end_latency_s"]["max"] >= 2.0
    # The trace's queue span is the queue time: it opens at the arrival.
    from engines.runtime.telemetry.trace_recorder import epoch_anchor_ns
    from tests.runtime.demo_engine import lane_events

    queue = [e for e in lane_events(engine.tracer.dump(), "late") if e["name"] == "queue (0)"]
    opened_us = (arrived * 1e9 + epoch_anchor_ns()) / 1000
    assert queue[0]["ph"] == "B" and queue[0]["ts"] == pytest.approx(opened_us, abs=1.0)
    assert (queue[1]["ts"] - queue[0]["ts"]) / 1e6 == pytest.approx(late["queue_time_s"], abs=1e-3)


def test_token_counters_move_as_tokens_come_aborted_requests_included(make_engine, demo):
    """vLLM's prompt_tokens_total and generation_tokens_total: a prompt counts once it is in the
    KV cache, each output token as it is appended; an aborted request's tokens count too, and a
    prompt recomputed after a preemption does not count again."""
    engine = make_engine(prefill_chunk_size=16)
    p = prompts(demo, 2, length=40)
    engine.add_request(request("kept", p[0], max_tokens=30, ignore_eos=True))
    engine.add_request(request("cut", p[1], max_tokens=30, ignore_eos=True))
    produced: dict[str, int] = {}
    seen_prompt = 0
    for _ in range(12):
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + sum(len(c.token_ids) for c in out.choices)
        m = engine.metrics.as_dict()
        assert m["num_generation_tokens"] == sum(produced.values())  # as they come, not at the end
        prefilled = sum(len(s.request.prompt) for s in engine.requests.values() if s.prompt_counted)
        assert m["num_prompt_tokens"] == prefilled and m["num_prompt_tokens"] >= seen_prompt
        seen_prompt = m["num_prompt_tokens"]
    assert seen_prompt == 80 and engine.metrics.as_dict()["num_finished_requests"] == 0
    engine.abort_request("cut")
    while engine.has_work:
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + sum(len(c.token_ids) for c in out.choices)
    m = engine.metrics.as_dict()
    assert m["num_generation_tokens"] == sum(produced.values()) > 30
    assert m["num_prompt_tokens"] == 80
    assert m["completion_tokens_sum"] == 30 and m["prompt_tokens_sum"] == 40  # MLC's: the finished request only


def test_a_prompt_recomputed_after_a_preemption_counts_once(make_engine, demo):
    tight = make_engine(num_pages=12, enable_prefix_cache=False)
    reqs = [request(f"r{i}", p, max_tokens=24, ignore_eos=True)
            for i, p in enumerate(prompts(demo, 6, length=30, seed=3))]
    run_all(tight, reqs)
    m = tight.metrics.as_dict()
    assert tight.scheduler.num_preemptions > 0
    assert m["num_prompt_tokens"] == 6 * 30 and m["num_generation_tokens"] == 6 * 24


def test_now_rates_and_batch_size_are_what_the_steps_ran(make_engine, demo):
    """The "now" figures come from the steps themselves: the decode batch size is the number of
    sequences a step decoded, never more than were running."""
    engine = make_engine()
    for i, p in enumerate(prompts(demo, 3)):
        engine.add_request(request(f"n{i}", p, max_tokens=8, ignore_eos=True))
    decoded = 0
    while engine.has_work:
        engine.step()
        now = engine.metrics.as_dict()["now"]
        if now["decode_batch_size_max"] is not None:
            assert now["decode_batch_size_max"] <= 3
    m = engine.metrics.as_dict()
    now = m["now"]
    decoded = m["decode_tokens_processed"]
    assert now["steps"] == m["num_prefill_steps"] + m["num_decode_steps"]
    assert now["decode_batch_size_max"] == 3 and 1 <= now["decode_batch_size"] <= 3
    # Every step ended within the window: its tokens over the window, the engine's whole life here.
    assert now["decode_tokens_per_s"] * now["window_s"] == pytest.approx(decoded, rel=0.02)


def test_a_routed_request_s_metrics_count_from_the_router_its_trace_from_here(make_engine, demo):
    import time

    engine = make_engine(tracing=True)
    routed = request("routed", prompts(demo, 1)[0], max_tokens=2, ignore_eos=True)
    routed.arrival_time, routed.age_at_arrival_s = time.perf_counter(), 3.0
    extra = run_all(engine, [routed])["routed"].usage["extra"]
    assert extra["queue_time_s"] >= 3.0 and extra["ttft_s"] >= 3.0
    from tests.runtime.demo_engine import lane_events

    queue = [e for e in lane_events(engine.tracer.dump(), "routed") if e["name"] == "queue (0)"]
    assert (queue[1]["ts"] - queue[0]["ts"]) / 1e6 < 3.0  # its span: the wait on this engine


def test_the_last_output_carries_the_moments_its_usage_counts_between(make_engine, demo):
    """``RequestOutput.times``: the stamps ``usage.extra``'s figures are differences of, on the
    last output only, so that a consumer (the OpenTelemetry spans) places them exactly."""
    import time

    engine = make_engine(max_num_seqs=1)
    arrived = time.perf_counter() - 0.5
    timed = request("timed", prompts(demo, 1)[0], max_tokens=4, ignore_eos=True)
    timed.arrival_time, timed.age_at_arrival_s = arrived, 0.25
    engine.add_request(timed)
    engine.add_request(request("waiting", prompts(demo, 1, seed=1)[0], max_tokens=4))
    engine.step()
    cut = engine.abort_request("waiting")  # still queued behind max_num_seqs=1
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert [o.times is None for o in outputs] == [True] * (len(outputs) - 1) + [False]
    t, extra = outputs[-1].times, outputs[-1].usage["extra"]
    assert t.arrival == arrived - 0.25  # what the metrics count from: a router's age included
    assert t.arrival < arrived < t.added <= t.first_scheduled <= t.first_token <= t.finish
    # Exactly the figures' ends: they are differences of these very stamps.
    assert extra["queue_time_s"] == t.first_scheduled - t.arrival
    assert extra["ttft_s"] == t.first_token - t.arrival
    assert extra["end_to_end_latency_s"] == t.finish - t.arrival
    assert cut.times is not None and cut.times.first_scheduled is None and cut.times.first_token is None
    assert cut.times.added <= cut.times.finish and cut.usage["extra"]["end_to_end_latency_s"] == \
        cut.times.finish - cut.times.arrival

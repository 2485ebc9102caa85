"""Prompt logprobs: the engine's block form against the row-by-row reference, and what the engine
returns against a plain reference computed from the model's full-sequence forward (every
position's float32 logits, log-softmax in NumPy float64): chunked prefill, a prompt whose prefix
the cache holds, a preempted prefill, several choices, ``max_tokens`` 0."""
from __future__ import annotations

import numpy as np
import pytest

from engines.runtime.core.prompt_logprobs import BLOCK_ROWS, prompt_logprobs, prompt_logprobs_reference
from engines.runtime.core.request import EngineRequestError, GenerationRequest
from engines.runtime.core.sampler import SamplingParams
from engines.runtime.core.disagg.transfer import KVSend
from tests.runtime.demo_engine import full_forward_logprobs, prompts, request, run_all

# Float32 logits of one prompt computed in different batches and chunkings differ in their last
# bits; log-softmax over the demo's 4,096 tokens keeps that at about 1e-5.
TOLERANCE = 1e-4


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_block_form_matches_the_row_by_row_reference(top: int) -> None:
    rng = np.random.default_rng(top)
    rows = BLOCK_ROWS * 2 + 7  # more than one block, the last one short
    logits = (rng.standard_normal((rows, 300)) * 4).astype(np.float32)
    logits[3, :10] = logits[3].max() + 1  # ties at the top: ordered by id
    logits[5, 7] = -np.inf  # a masked entry never shows as an alternative
    targets = rng.integers(0, 300, rows)
    targets[3] = 4
    fast = prompt_logprobs(logits, targets, top)
    plain = prompt_logprobs_reference(logits, targets, top)
    assert len(fast) == len(plain) == rows
    for got, want in zip(fast, plain, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-9)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        np.testing.assert_allclose([v for _, v in got.top_logprobs], [v for _, v in want.top_logprobs], atol=1e-9)
    if top:
        assert [t for t, _ in fast[3].top_logprobs[:min(top, 10)]] == list(range(min(top, 10)))
        # A token tied with the most likely has exactly the top logprob (lm-eval's greedy test).
        assert fast[3].logprob == fast[3].top_logprobs[0][1]


def test_top_past_the_vocabulary_lists_every_token() -> None:
    logits = np.array([[0.0, 2.0, 1.0]], np.float32)
    (got,) = prompt_logprobs(logits, np.array([2]), 20)
    assert [t for t, _ in got.top_logprobs] == [1, 2, 0]
    with pytest.raises(ValueError, match="target tokens"):
        prompt_logprobs(logits, np.array([1, 2]), 1)


def assert_matches_reference(got: list, model, prompt: list[int], top: int) -> None:
    """``got`` (a request's prompt_logprobs) is the reference's, position for position."""
    want = full_forward_logprobs(model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row = got[pos], want[pos - 1]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(row[prompt[pos]], abs=TOLERANCE), pos
        assert len(entry.top_logprobs) == top
        best = np.argsort(-row, kind="stable")[:top]
        assert [t for t, _ in entry.top_logprobs] == best.tolist(), pos
        np.testing.assert_allclose([v for _, v in entry.top_logprobs], row[best], atol=TOLERANCE)


def scoring(rid: str, prompt: list[int], top: int = 2, **sampling) -> GenerationRequest:
    return request(rid, prompt, **{"max_tokens": 3, "logprobs": True, "prompt_logprobs": top, **sampling})


def collected(engine, requests: list[GenerationRequest]) -> dict:
    """Each request's prompt_logprobs as its outputs carried them (checking they come once, and
    no earlier than its first choice delta)."""
    found: dict = {}
    for req in requests:
        engine.add_request(req)
    while engine.has_work:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in found, "prompt logprobs sent twice"
                found[out.request_id] = out.prompt_logprobs
            elif out.choices:
                assert out.request_id in found or not engine_wants(requests, out.request_id), \
                    "a choice delta went out before the prompt logprobs"
    return found


def engine_wants(requests: list[GenerationRequest], rid: str) -> bool:
    return any(r.request_id == rid and r.sampling.prompt_logprobs is not None for r in requests)


def test_short_prompt_scores_every_token_and_generates_as_without(make_engine, demo, demo_model) -> None:
    prompt = prompts(demo, 1, 20)[0]
    engine = make_engine()
    reqs = [scoring("s", prompt, top=3)]
    got = collected(engine, reqs)
    assert_matches_reference(got["s"], demo_model, prompt, 3)
    # The completion is what the same request without prompt logprobs gives.
    plain = run_all(make_engine(), [request("p", prompt, max_tokens=3, logprobs=True)])["p"]
    again = run_all(make_engine(), [scoring("s", prompt, top=3)])["s"]
    assert again.tokens == plain.tokens
    assert [lp.logprob for lp in again.logprobs[0]] == pytest.approx([lp.logprob for lp in plain.logprobs[0]],
                                                                      abs=TOLERANCE)


def test_chunked_prefill_and_a_batch_neighbour(make_engine, demo, demo_model) -> None:
    """A prompt of several prefill chunks (the engine's budget is 64 tokens), beside a request
    that asks for none: both as alone."""
    long_prompt, other = prompts(demo, 2, 150, seed=5)
    engine = make_engine()
    reqs = [scoring("long", long_prompt, top=1), request("other", other[:40], max_tokens=5, ignore_eos=True)]
    got = collected(engine, reqs)
    assert "other" not in got
    assert_matches_reference(got["long"], demo_model, long_prompt, 1)
    alone = run_all(make_engine(), [request("other", other[:40], max_tokens=5, ignore_eos=True)])["other"]
    mixed = run_all(make_engine(), [scoring("long", long_prompt, top=1),
                                    request("other", other[:40], max_tokens=5, ignore_eos=True)])["other"]
    assert mixed.tokens == alone.tokens


def test_a_cached_prefix_is_recomputed_for_the_scoring_choice(make_engine, demo, demo_model) -> None:
    """The prefix cache holds the prompt's first pages (an earlier request): the scoring choice
    takes none of them, so every position is scored; a second choice takes them as usual."""
    shared = prompts(demo, 1, 70, seed=6)[0]
    prompt = shared + prompts(demo, 1, 20, seed=7)[0]
    engine = make_engine()
    run_all(engine, [request("warm", shared + [5], max_tokens=1)])
    assert engine.kv_pool.match_prefix(prompt) >= 64
    admissions = []
    admit = engine.kv_pool.admit

    def spy(seq_id, token_ids, budget, max_cached_tokens=None):
        result = admit(seq_id, token_ids, budget, max_cached_tokens)
        admissions.append((max_cached_tokens, result.cached_tokens if result else None))
        return result

    engine.kv_pool.admit = spy
    got = collected(engine, [scoring("s", prompt, top=2, n=2, temperature=1.0, seed=3)])
    assert_matches_reference(got["s"], demo_model, prompt, 2)
    # Choice 0 took nothing from the cache; choice 1 the cached pages, as any request would.
    assert admissions[0] == (0, 0)
    assert admissions[1][0] is None and admissions[1][1] >= 64


def test_a_preempted_prefill_resumes_its_prompt_logprobs(make_engine, demo, demo_model) -> None:
    """Out of pages mid-prompt, the scoring request (the newest) is preempted and computed again
    later: its logprobs are each computed once and still the reference's."""
    first, second = prompts(demo, 2, 150, seed=8)
    engine = make_engine(num_pages=13)
    reqs = [request("old", first[:100], max_tokens=60, ignore_eos=True), scoring("new", second, top=1)]
    got = collected(engine, reqs)
    assert engine.scheduler.num_preemptions >= 1
    assert_matches_reference(got["new"], demo_model, second, 1)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(make_engine, demo, demo_model) -> None:
    prompt = prompts(demo, 1, 90, seed=9)[0]
    engine = make_engine()
    reqs = [scoring("s", prompt, top=1, max_tokens=0, n=2)]
    engine.add_request(reqs[0])
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    (last,) = [o for o in outputs if o.request_id == "s"]  # one output: the prompt's, the end
    assert_matches_reference(last.prompt_logprobs, demo_model, prompt, 1)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in last.choices] == \
        [(0, "", [], "length"), (1, "", [], "length")]
    assert last.usage["completion_tokens"] == 0 and last.usage["prompt_tokens"] == len(prompt)
    # Without prompt logprobs, max_tokens 0 only computes the prompt.
    plain = run_all(make_engine(), [request("p", prompt, max_tokens=0)])["p"]
    assert plain.tokens == [] and plain.finish_reason == "length"


def test_an_abort_mid_prefill_sends_the_logprobs_computed_so_far(make_engine, demo) -> None:
    prompt = prompts(demo, 1, 150, seed=10)[0]
    engine = make_engine()  # 64-token chunks
    engine.add_request(scoring("s", prompt, top=1))
    assert engine.step() == []  # mid-prompt: nothing to report yet
    final = engine.abort_request("s")
    assert final is not None and final.usage is not None
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == 65  # positions 0..63 scored
    assert [c.finish_reason for c in final.choices] == ["abort"]


def test_a_one_token_prompt_has_only_the_null_entry(make_engine, demo) -> None:
    got = collected(make_engine(), [scoring("one", [5], top=2)])
    assert got["one"] == [None]


def test_prompt_logprobs_are_refused_with_disaggregation(make_engine, demo) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with pytest.raises(EngineRequestError, match="disaggregated"):
        engine.add_request(GenerationRequest("d", [1, 2, 3], params, kv_send=KVSend(0, 3, "t")))
    with pytest.raises(EngineRequestError, match="disaggregated"):
        engine.add_request(GenerationRequest("d", [1, 2, 3], params, kv_window_begin=2))


def test_merged_outputs_keep_the_prompt_logprobs() -> None:
    """A consumer that fell behind gets its outputs merged (AsyncEngine): the prompt logprobs,
    on the first of them, survive."""
    from engines.runtime.core.request import ChoiceDelta, RequestOutput
    from engines.runtime.core.sampler import TokenLogprob
    from engines.runtime.frontend.output_streams import merge_outputs

    scores = [None, TokenLogprob(7, -1.5)]
    first = RequestOutput("r", [ChoiceDelta(0, "a", [1], None, None)], prompt_logprobs=scores)
    second = RequestOutput("r", [ChoiceDelta(0, "b", [2], None, "length")], usage={"prompt_tokens": 2})
    merged = merge_outputs([first, second])
    assert merged.prompt_logprobs == scores and merged.choices[0].text == "ab" and merged.usage is not None
    assert merge_outputs([second, RequestOutput("r", [])]).prompt_logprobs is None

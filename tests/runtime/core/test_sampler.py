"""SamplingParams validation and the batch Sampler: greedy, seeds, top-k/p, penalties, logprobs."""
import math

import numpy as np
import pytest

from engines.runtime.core.limits import REQUEST_LIMITS
from engines.runtime.core.sampler import (
    InvalidSamplingParams,
    Sampler,
    SamplingParams,
    SamplingState,
    TokenLogprob,
)

V = 8


def state(vocab: int = V, prompt=(), choice: int = 0, **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), vocab, prompt_token_ids=prompt, choice_index=choice)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": 1.0}, "seed"),
    ({"seed": True}, "seed"),
    ({"frequency_penalty": 2.1}, "frequency_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),  # JSON's string keys are the protocol's to parse
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": [None]}, "stop"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs=True
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidSamplingParams) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field
    assert str(exc.value).startswith(field)
    assert isinstance(exc.value, ValueError)


def test_valid_params_are_normalised():
    p = SamplingParams(temperature=0, top_k=0, seed=-7, stop="###", logit_bias={5: 10, 6: -100},
                       stop_token_ids=[2, 3], max_tokens=1, logprobs=True, top_logprobs=20, n=4,
                       frequency_penalty=-2, presence_penalty=2, repetition_penalty=1.3)
    assert p.stop == ("###",)
    assert p.logit_bias == {5: 10.0, 6: -100.0}
    assert p.stop_token_ids == (2, 3)
    assert p.is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("edge, past, message", [
    ({"temperature": REQUEST_LIMITS.temperature_max}, {"temperature": 2.01},
     "temperature must be at least 0 and at most 2, got 2.01"),
    ({"top_p": REQUEST_LIMITS.top_p_max}, {"top_p": REQUEST_LIMITS.top_p_min_exclusive},
     "top_p must be greater than 0 and at most 1, got 0.0"),
    ({"frequency_penalty": REQUEST_LIMITS.penalty_min}, {"frequency_penalty": -2.01},
     "frequency_penalty must be at least -2 and at most 2, got -2.01"),
    ({"presence_penalty": REQUEST_LIMITS.penalty_max}, {"presence_penalty": 2.01},
     "presence_penalty must be at least -2 and at most 2, got 2.01"),
    ({"stop": ["a"] * REQUEST_LIMITS.max_stop_sequences}, {"stop": ["a"] * 5},
     "stop allows at most 4 sequences, got 5"),
    ({"logprobs": True, "top_logprobs": REQUEST_LIMITS.max_top_logprobs}, {"logprobs": True, "top_logprobs": 21},
     "top_logprobs must be an integer from 0 to 20, got 21"),
    ({"logit_bias": {1: REQUEST_LIMITS.logit_bias_min}}, {"logit_bias": {1: -100.5}},
     "logit_bias values must be numbers from -100 to 100, got -100.5 for token 1"),
    ({"n": REQUEST_LIMITS.max_n}, {"n": 17},
     "n must be an integer from 1 to 16 (choices per request on this server; send several requests for more), got 17"),
])
def test_ranges_are_the_request_limits_and_messages_say_them(edge, past, message):
    """The server's limits (engines.runtime.REQUEST_LIMITS), checked here and only here:
    the edge is accepted, a step past it refused with a message stating the limit."""
    SamplingParams(**edge)
    with pytest.raises(InvalidSamplingParams) as exc:
        SamplingParams(**past)
    assert str(exc.value) == message


def test_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias={7: 1.0}, stop_token_ids=(7,)).check_vocab(8)
    with pytest.raises(InvalidSamplingParams, match="logit_bias.*out of the vocabulary"):
        SamplingParams(logit_bias={8: 1.0}).check_vocab(8)
    with pytest.raises(InvalidSamplingParams, match="stop_token_ids"):
        SamplingState(SamplingParams(stop_token_ids=(100,)), vocab_size=8)


# -------------------------------------------------------------------- greedy

def test_greedy_rows_take_the_argmax_on_the_fast_path_and_the_slow_path():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    sampler = Sampler(50)
    out = sampler.sample(logits, [state(50, temperature=0) for _ in range(5)])
    assert out.token_ids.dtype == np.int32
    assert out.token_ids.tolist() == logits.argmax(axis=1).tolist()
    assert out.logprobs == [None] * 5
    # mixed batch: greedy rows among sampled ones, some greedy rows asking for logprobs
    states = [state(50, temperature=0), state(50, seed=1), state(50, top_k=1, logprobs=True),
              state(50, temperature=0, logprobs=True), state(50, seed=2)]
    out = sampler.sample(logits, states)
    for i in (0, 2, 3):
        assert out.token_ids[i] == logits[i].argmax()
    assert out.logprobs[2].token_id == logits[2].argmax()


def test_logits_are_not_modified():
    logits = np.zeros((2, V), dtype=np.float32)
    logits[:, 3] = 1
    before = logits.copy()
    Sampler(V).sample(logits, [state(logit_bias={1: 50}, temperature=0),
                               state(frequency_penalty=1, seed=0)])
    np.testing.assert_array_equal(logits, before)


def test_logit_bias_can_force_and_ban_tokens():
    logits = np.zeros((1, V), dtype=np.float32)
    logits[0, 2] = 5.0
    sampler = Sampler(V)
    assert sampler.sample(logits, [state(temperature=0, logit_bias={6: 10})]).token_ids[0] == 6
    s = state(seed=0, logit_bias={2: -100})
    picks = {int(sampler.sample(logits, [s]).token_ids[0]) for _ in range(200)}
    assert 2 not in picks and len(picks) > 3


# --------------------------------------------------------------------- seeds

def _run(states_factory, steps, logits_rows, batch_with=None):
    """Sample `steps` tokens for one request, optionally batched with other rows."""
    sampler = Sampler(logits_rows.shape[1])
    target = states_factory()
    others = batch_with() if batch_with else []
    out = []
    for step in range(steps):
        row = logits_rows[step % len(logits_rows)]
        batch = [target] + others
        logits = np.stack([row] + [np.roll(row, k + 1) for k in range(len(others))])
        out.append(int(sampler.sample(logits, batch).token_ids[0]))
    return out


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 20, "top_p": 0.95, "frequency_penalty": 0.5},
])
def test_same_seed_same_tokens_regardless_of_batching(kw):
    rows = np.random.default_rng(1).normal(size=(7, 300)).astype(np.float32)
    alone = _run(lambda: state(300, seed=1234, **kw), 40, rows)
    again = _run(lambda: state(300, seed=1234, **kw), 40, rows)
    batched = _run(lambda: state(300, seed=1234, **kw), 40, rows,
                   batch_with=lambda: [state(300, seed=9), state(300, temperature=0),
                                       state(300, top_k=5, seed=3, logprobs=True, top_logprobs=2)])
    assert alone == again == batched
    other_seed = _run(lambda: state(300, seed=1235, **kw), 40, rows)
    assert other_seed != alone


def test_choices_of_one_seeded_request_differ_but_each_is_reproducible():
    rows = np.random.default_rng(2).normal(size=(3, 300)).astype(np.float32)
    c0 = _run(lambda: state(300, seed=5, choice=0), 30, rows)
    c1 = _run(lambda: state(300, seed=5, choice=1), 30, rows)
    assert c0 != c1
    assert c1 == _run(lambda: state(300, seed=5, choice=1), 30, rows)


def test_unseeded_requests_differ():
    rows = np.random.default_rng(3).normal(size=(3, 300)).astype(np.float32)
    assert _run(lambda: state(300), 30, rows) != _run(lambda: state(300), 30, rows)


# -------------------------------------------------------------- distribution

def _frequencies(logits_row, n_draws, **kw):
    s = state(len(logits_row), seed=42, **kw)
    sampler = Sampler(len(logits_row))
    logits = logits_row[None, :].astype(np.float32)
    counts = np.zeros(len(logits_row))
    for _ in range(n_draws):
        counts[sampler.sample(logits, [s]).token_ids[0]] += 1
    return counts / n_draws


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_samples_follow_the_tempered_softmax(temperature):
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    freq = _frequencies(x, 6000, temperature=temperature)
    expected = np.exp(log_softmax(x / temperature))
    # 6000 draws: standard error at most ~0.0065 per entry
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_top_k_keeps_only_the_k_most_likely():
    x = np.array([0.0, 3.0, 1.0, 2.5, -1.0, 2.9, 0.5, 0.1])
    freq = _frequencies(x, 3000, top_k=3)
    assert set(np.nonzero(freq)[0]) == {1, 3, 5}
    kept = np.exp(log_softmax(x[[1, 3, 5]]))
    np.testing.assert_allclose(freq[[1, 3, 5]], kept, atol=0.04)


@pytest.mark.parametrize("top_p, kept", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    probs = np.array([0.5, 0.3, 0.1, 0.1])  # 2 and 3 tie: the lower id wins
    freq = _frequencies(np.log(probs), 2000, top_p=top_p)
    assert set(np.nonzero(freq)[0]) == kept


def test_top_k_then_top_p_renormalises_within_the_top_k():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # top_k=2 leaves {0: 4/7, 1: 3/7}; top_p=0.5 of that keeps only 0
    assert set(np.nonzero(_frequencies(np.log(probs), 500, top_k=2, top_p=0.5))[0]) == {0}


@pytest.mark.parametrize("scale, size_range", [(3.0, (1, 256)), (2.0, (256, 2048)), (0.3, (2048, 5000))])
def test_large_vocab_nucleus_matches_a_brute_force_nucleus(scale, size_range):
    """Every candidate-set size the nucleus search tries (256, 2048, all) gives the exact set."""
    rng = np.random.default_rng(7)
    vocab = 5000
    x = rng.normal(size=vocab) * scale
    p = np.exp(log_softmax(x))
    order = np.argsort(-p, kind="stable")
    nucleus = set(order[:np.searchsorted(np.cumsum(p[order]), 0.9) + 1].tolist())
    got = set(Sampler._nucleus(p.astype(np.float32), None, 0.9).tolist())
    assert got == nucleus
    assert size_range[0] <= len(nucleus) < size_range[1]  # the intended path is exercised
    freq = _frequencies(x, 300, top_p=0.9)
    assert set(np.nonzero(freq)[0]) <= nucleus


def test_tiny_temperature_is_stable_and_near_greedy():
    x = np.array([1.0, 1.001, 0.2, -5.0], dtype=np.float32)
    freq = _frequencies(x, 200, temperature=1e-6)
    assert freq[1] == 1.0


def test_mask_is_respected_and_an_empty_mask_is_an_error():
    x = np.zeros((1, V), dtype=np.float32)
    x[0, 0] = 10.0
    mask = np.zeros(V, dtype=bool)
    mask[[3, 5]] = True
    sampler = Sampler(V)
    s = state(seed=0, logit_bias={3: 100})
    picks = {int(sampler.sample(x, [s], [mask]).token_ids[0]) for _ in range(50)}
    assert picks <= {3, 5}
    assert sampler.sample(x, [state(temperature=0)], [mask]).token_ids[0] in (3, 5)
    with pytest.raises(ValueError, match="no token is allowed"):
        sampler.sample(x, [state(temperature=0)], [np.zeros(V, dtype=bool)])


def test_shape_mismatches_are_rejected():
    sampler = Sampler(V)
    with pytest.raises(ValueError, match="sampling states"):
        sampler.sample(np.zeros((2, V), np.float32), [state()])
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.sample(np.zeros((1, V + 1), np.float32), [state()])


# ----------------------------------------------------------------- penalties

def test_presence_penalty_counts_sampled_tokens():
    logits = np.array([[1.0, 0.9, 0, 0, 0, 0, 0, 0]], dtype=np.float32)
    s = state(temperature=0, presence_penalty=0.5)
    sampler = Sampler(V)
    # 0 wins, then 0 is penalised (0.5 < 0.9), then both are (0.5 > 0.4)
    assert [int(sampler.sample(logits, [s]).token_ids[0]) for _ in range(3)] == [0, 1, 0]


def test_frequency_and_presence_penalties_are_applied_per_occurrence():
    s = state(frequency_penalty=0.25, presence_penalty=0.5)
    s.record_output([3, 3, 3, 5])  # e.g. jump-forward tokens
    row = np.zeros(V, dtype=np.float32)
    s.apply(row)
    expected = np.zeros(V)
    expected[3] = -(3 * 0.25 + 0.5)
    expected[5] = -(0.25 + 0.5)
    np.testing.assert_allclose(row, expected)


def test_negative_penalties_encourage_repetition():
    s = state(temperature=0, frequency_penalty=-1.0)
    logits = np.array([[1.0, 1.5, 0, 0, 0, 0, 0, 0]], dtype=np.float32)
    sampler = Sampler(V)
    s.record_output([0])
    assert sampler.sample(logits, [s]).token_ids[0] == 0  # 2.0 > 1.5


def test_repetition_penalty_covers_prompt_and_output_and_both_signs():
    sampler = Sampler(V)
    pos = np.array([[2.0, 1.5, 0, 0, 0, 0, 0, 0]], dtype=np.float32)
    assert sampler.sample(pos, [state(temperature=0, repetition_penalty=2.0, prompt=[0])]).token_ids[0] == 1
    neg = np.array([[-1.0, -1.5, -9, -9, -9, -9, -9, -9]], dtype=np.float32)
    assert sampler.sample(neg, [state(temperature=0, repetition_penalty=2.0, prompt=[0])]).token_ids[0] == 1
    s = state(temperature=0, repetition_penalty=2.0)
    assert sampler.sample(pos, [s]).token_ids[0] == 0
    assert sampler.sample(pos, [s]).token_ids[0] == 1  # its own output now counts


# ------------------------------------------------------------------ logprobs

def test_logprobs_are_the_processed_log_softmax_before_temperature():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 40)).astype(np.float32)
    bias = {7: 3.0}
    mask = np.ones(40, dtype=bool)
    mask[:5] = False
    results = []
    for temperature in (0.0, 0.5, 1.8):
        s = state(40, seed=11, temperature=temperature, logprobs=True, top_logprobs=5, logit_bias=bias)
        out = Sampler(40).sample(x, [s], [mask])
        lp = out.logprobs[0]
        assert isinstance(lp, TokenLogprob)
        processed = x[0].astype(np.float64).copy()
        processed[7] += 3.0
        processed[:5] = -np.inf
        ref = log_softmax(processed)
        assert lp.token_id == out.token_ids[0]
        assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-5)
        top_ids = [t for t, _ in lp.top_logprobs]
        assert top_ids == list(np.argsort(-ref, kind="stable")[:5])
        assert [v for _, v in lp.top_logprobs] == pytest.approx(sorted(ref, reverse=True)[:5], abs=1e-5)
        assert top_ids[0] == 7
        results.append(lp.top_logprobs)
    # temperature changes the draw, not the reported distribution
    assert results[0] == results[1] == results[2]


def test_top_logprobs_leave_out_forbidden_tokens_and_values_are_finite():
    x = np.zeros((1, V), dtype=np.float32)
    mask = np.zeros(V, dtype=bool)
    mask[[1, 4]] = True
    lp = Sampler(V).sample(x, [state(seed=0, logprobs=True, top_logprobs=5)], [mask]).logprobs[0]
    assert [t for t, _ in lp.top_logprobs] == [1, 4]
    assert all(math.isfinite(v) for _, v in lp.top_logprobs)
    assert lp.logprob == pytest.approx(math.log(0.5))


def test_logprobs_without_top_logprobs():
    x = np.log(np.array([[0.7, 0.1, 0.1, 0.1, 0, 0, 0, 0]], dtype=np.float32) + 1e-30)
    lp = Sampler(V).sample(x, [state(temperature=0, logprobs=True)]).logprobs[0]
    assert lp == TokenLogprob(token_id=0, logprob=pytest.approx(math.log(0.7), abs=1e-5), top_logprobs=())

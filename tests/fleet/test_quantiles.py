"""Percentiles from buckets: one server's as Prometheus computes them, and a fleet's whose servers
use different bucket sets, checked against the exact percentiles of known observations."""
from __future__ import annotations

import math
import random

import pytest

from engines.fleet.quantiles import bucket_quantile, buckets_from_samples, fleet_quantile, window_delta
from tests.fleet.foreign_expositions import SGLANG_TTFT, VLLM_TTFT


def histogram(observations, bounds):
    bounds = tuple(bounds) + (math.inf,)
    return tuple((b, float(sum(1 for o in observations if o <= b))) for b in bounds)


def exact(observations, q):
    ordered = sorted(observations)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def test_one_server_interpolates_inside_its_bucket():
    buckets = ((0.1, 10.0), (0.2, 30.0), (math.inf, 30.0))
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * 5 / 20)
    assert bucket_quantile(0.2, buckets) == pytest.approx(0.06)  # the first bucket starts at 0
    assert bucket_quantile(0.5, ((1.0, 0.0), (math.inf, 0.0))) is None
    assert bucket_quantile(0.99, ((1.0, 1.0), (math.inf, 10.0))) == 1.0  # past the last finite bound


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_a_fleet_of_differently_bucketed_servers_brackets_the_true_percentile(seed, q):
    rng = random.Random(seed)
    fast = [rng.lognormvariate(math.log(0.03), 0.5) for _ in range(rng.randint(200, 2000))]  # a vLLM server
    slow = [rng.lognormvariate(math.log(0.6), 0.4) for _ in range(rng.randint(50, 500))]  # an SGLang server
    got = fleet_quantile(q, [histogram(fast, VLLM_TTFT), histogram(slow, SGLANG_TTFT)])
    truth = exact(fast + slow, q)
    assert got.count == len(fast) + len(slow)
    assert got.low <= truth <= got.high, (got, truth)
    assert got.low <= got.value <= got.high


def test_summing_buckets_by_le_across_the_two_sets_is_what_this_avoids():
    """Prometheus' ``sum by (le)`` keeps only bounds both servers have: the result lands on a bound
    far from the truth, where the mixture stays inside its bracket."""
    fast = [0.004] * 900
    slow = [0.5] * 100
    shared = sorted(set(VLLM_TTFT) & set(SGLANG_TTFT))
    vllm_h, sglang_h = histogram(fast, VLLM_TTFT), histogram(slow, SGLANG_TTFT)
    summed = tuple((b, dict(vllm_h)[b] + dict(sglang_h)[b]) for b in shared) + (
        (math.inf, vllm_h[-1][1] + sglang_h[-1][1]),)
    truth = exact(fast + slow, 0.5)
    assert abs(bucket_quantile(0.5, summed) - truth) > 0.03
    assert fleet_quantile(0.5, [vllm_h, sglang_h]).value == pytest.approx(truth, abs=0.002)


def test_window_deltas_and_restarts():
    older = ((0.1, 2.0), (math.inf, 3.0))
    newer = ((0.1, 5.0), (math.inf, 9.0))
    assert window_delta(newer, older) == ((0.1, 3.0), (math.inf, 6.0))
    assert window_delta(older, newer) is None  # counts went back: a restart
    assert window_delta(newer, ((0.2, 1.0), (math.inf, 1.0))) is None  # other bounds
    assert buckets_from_samples([(0.1, 1), (0.1, 2), (math.inf, 4)]) == ((0.1, 3.0), (math.inf, 4.0))
    assert fleet_quantile(0.5, []) is None


def test_a_counter_rate_and_a_sliding_histogram_window():
    from engines.fleet.windows import CounterRate, HistogramWindow

    rate = CounterRate()
    assert rate.add(0.0, 10.0) is None
    assert rate.add(2.0, 30.0) == 10.0
    assert rate.add(3.0, 5.0) is None  # went back: a restart
    assert rate.add(4.0, 9.0) == 4.0
    # Over the readings of its window: since the newest at least window_s old.
    windowed = CounterRate(window_s=5.0)
    assert [windowed.add(t, v) for t, v in ((0.0, 0.0), (2.0, 10.0), (6.0, 20.0), (7.0, 21.0))] == \
        [None, 5.0, 20.0 / 6.0, 11.0 / 5.0]  # at t=7 since t=2 (the newest at or before 7 - 5)
    window = HistogramWindow(window_s=60.0)
    reading = lambda n: ((0.1, float(n)), (math.inf, float(n)))  # noqa: E731
    assert window.add(0.0, reading(5)) == reading(5)  # the first: everything it holds
    assert window.add(30.0, reading(8)) == reading(3)
    # Since the newest reading at or before the window's start (t=10: the one at t=0).
    assert window.add(70.0, reading(20)) == reading(15)
    assert window.add(100.0, reading(21)) == reading(13)  # start t=40: since the reading at t=30
    assert window.add(101.0, ((0.2, 1.0), (math.inf, 1.0))) == ((0.2, 1.0), (math.inf, 1.0))  # new bounds: anew

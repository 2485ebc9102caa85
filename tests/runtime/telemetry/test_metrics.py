"""EngineMetrics and RequestMetrics: MLC's names and arithmetic, our gauges and distributions."""
from __future__ import annotations

import json
import math
import threading

import numpy as np
import orjson
import pytest

from engines.runtime.telemetry.latency_distribution import LatencyDistribution
from engines.runtime.telemetry.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineMetrics, RequestMetrics, TimeCost,
)

MLC_REQUEST_KEYS = ["prompt_tokens", "completion_tokens", "prefill_tokens", "decode_tokens",
                    "jump_forward_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
                    "end_to_end_latency_s", "ttft_s", "inter_token_latency_s"]


def request(prompt=10, completion=5, prefill=8, decode=4, jump=1, add=100.0, scheduled=100.5,
            first=101.0, finish=103.0) -> RequestMetrics:
    return RequestMetrics(prompt_tokens=prompt, completion_tokens=completion, prefill_tokens=prefill,
                          decode_tokens=decode, jump_forward_tokens=jump, add_time=add,
                          first_scheduled_time=scheduled, first_token_time=first, finish_time=finish)


def strict_json(value) -> str:
    """The standard library refuses inf/nan here, as a strict client would."""
    return json.dumps(value, allow_nan=False)


# ---------------------------------------------------------------------- RequestMetrics


def test_request_usage_extra_arithmetic():
    extra = request().as_usage_extra()
    assert list(extra) == MLC_REQUEST_KEYS + ["inter_token_latency_standard_s", "queue_time_s"]
    assert extra["prompt_tokens"] == 10 and extra["completion_tokens"] == 5
    assert extra["prefill_tokens"] == 8 and extra["decode_tokens"] == 4 and extra["jump_forward_tokens"] == 1
    assert extra["ttft_s"] == pytest.approx(1.0)
    assert extra["end_to_end_latency_s"] == pytest.approx(3.0)
    assert extra["prefill_tokens_per_s"] == pytest.approx(8 / 1.0)    # over (first token - add)
    assert extra["decode_tokens_per_s"] == pytest.approx(4 / 2.0)     # over (finish - first token)
    assert extra["inter_token_latency_s"] == pytest.approx(3.0 / 5)   # MLC: total / completion
    assert extra["inter_token_latency_standard_s"] == pytest.approx((3.0 - 1.0) / (5 - 1))
    assert extra["queue_time_s"] == pytest.approx(0.5)


def test_request_zero_denominators_omit_ratios_and_stay_finite():
    # Never started: no times at all.
    extra = RequestMetrics(prompt_tokens=3).as_usage_extra()
    assert "prefill_tokens_per_s" not in extra and "decode_tokens_per_s" not in extra
    assert extra["ttft_s"] == extra["end_to_end_latency_s"] == extra["inter_token_latency_s"] == 0.0
    assert extra["inter_token_latency_standard_s"] == 0.0
    # Tokens but zero-length intervals (a clock that did not move).
    same = request(add=5.0, scheduled=5.0, first=5.0, finish=5.0).as_usage_extra()
    assert "prefill_tokens_per_s" not in same and "decode_tokens_per_s" not in same
    # One completion token: the standard ITL is undefined, reported 0.0.
    one = request(completion=1).as_usage_extra()
    assert one["inter_token_latency_standard_s"] == 0.0
    assert one["inter_token_latency_s"] == pytest.approx(3.0)
    # Aborted before the first token.
    aborted = request(first=None, completion=0, decode=0).as_usage_extra()
    assert aborted["ttft_s"] == 0.0 and aborted["end_to_end_latency_s"] == pytest.approx(3.0)
    for e in (extra, same, one, aborted):
        strict_json(e)


# ---------------------------------------------------------------------- TimeCost


def test_time_cost_discards_first_update():
    cost = TimeCost()
    assert cost.as_dict() == {"count": 0}
    cost.update(9.0)
    assert cost.as_dict() == {"count": 0}
    cost.update(1.0)
    cost.update(2.0)
    assert cost.as_dict() == {"count": 2, "mean": 1.5}


# ---------------------------------------------------------------------- EngineMetrics


def test_engine_sums_and_ratios_exact():
    m = EngineMetrics()
    m.on_prefill_step(0.5, tokens=8)
    m.on_prefill_step(0.25, tokens=20)
    m.on_decode_step(0.125, batch_size=2)
    m.on_decode_step(0.375, batch_size=2)
    m.on_jump_forward(0.0625, tokens=3)
    m.on_request_finished(request(prompt=10, completion=5, prefill=8, decode=4, jump=1))
    m.on_request_finished(request(prompt=30, completion=7, prefill=20, decode=6, jump=2))
    d = m.as_dict()
    assert d["engine_prefill_time_sum"] == 0.75
    assert d["engine_decode_time_sum"] == 0.5
    assert d["engine_jump_forward_time_sum"] == 0.0625
    assert (d["prompt_tokens_sum"], d["completion_tokens_sum"], d["prefill_tokens_sum"],
            d["decode_tokens_sum"], d["jump_forward_tokens_sum"]) == (40, 12, 28, 10, 3)
    assert d["prefill_tokens_per_s"] == 28 / 0.75
    assert d["decode_tokens_per_s"] == 10 / 0.5
    assert list(d)[:11] == [
        "engine_prefill_time_sum", "engine_decode_time_sum", "engine_jump_forward_time_sum",
        "prompt_tokens_sum", "completion_tokens_sum", "prefill_tokens_sum", "decode_tokens_sum",
        "jump_forward_tokens_sum", "prefill_tokens_per_s", "decode_tokens_per_s",
        "last_finished_request"]
    assert d["last_finished_request"] == request(prompt=30, completion=7, prefill=20, decode=6,
                                                 jump=2).as_usage_extra()
    assert d["num_finished_requests"] == 2
    assert (d["num_prefill_steps"], d["num_decode_steps"]) == (2, 2)
    assert (d["prefill_tokens_processed"], d["decode_tokens_processed"],
            d["jump_forward_tokens_processed"]) == (28, 4, 3)


def test_token_sums_move_only_at_request_finish():
    m = EngineMetrics()
    m.on_step(0.5, prefill_tokens=100, decode_seqs=3)
    m.on_step(0.25, prefill_tokens=0, decode_seqs=4)
    d = m.as_dict()
    assert d["prefill_tokens_sum"] == d["decode_tokens_sum"] == d["prompt_tokens_sum"] == 0
    assert "prefill_tokens_per_s" not in d          # MLC: no finished prefill tokens yet
    assert d["decode_tokens_per_s"] == 0.0          # MLC: guarded on decode time only
    assert d["engine_prefill_time_sum"] == 0.5 and d["engine_decode_time_sum"] == 0.25
    # the live view moves every step
    assert d["prefill_tokens_processed"] == 100 and d["decode_tokens_processed"] == 3 + 4
    # a hybrid step is a prefill step and does not feed the per-batch-size decode timers
    assert (d["num_prefill_steps"], d["num_decode_steps"]) == (1, 1)


def test_decode_time_by_batch_size_warm_up_per_size():
    m = EngineMetrics()
    for seconds in (5.0, 0.1, 0.3):      # first is warm-up
        m.on_decode_step(seconds, batch_size=4)
    m.on_decode_step(7.0, batch_size=8)  # only the warm-up so far: not reported
    for seconds in (9.0, 0.5):
        m.on_step(seconds, prefill_tokens=0, decode_seqs=1)
    m.on_decode_step(1.0, batch_size=65)  # beyond MLC's tracked range: ignored
    m.on_decode_step(1.0, batch_size=65)
    m.on_decode_step(1.0, batch_size=0)
    by_size = m.as_dict()["decode_time_by_batch_size"]
    assert by_size == {"mean{batch_size=1}": 0.5, "count{batch_size=1}": 1,
                       "mean{batch_size=4}": pytest.approx(0.2), "count{batch_size=4}": 2}
    # The time sum counts every decode step, warm-ups included (as MLC).
    assert m.as_dict()["engine_decode_time_sum"] == pytest.approx(5.0 + 0.1 + 0.3 + 7.0 + 9.0 + 0.5 + 3.0)
    wide = EngineMetrics(max_tracked_batch_size=128)
    wide.on_decode_step(1.0, batch_size=100)
    wide.on_decode_step(2.0, batch_size=100)
    assert wide.as_dict()["decode_time_by_batch_size"] == {"mean{batch_size=100}": 2.0,
                                                           "count{batch_size=100}": 1}


def test_reset_zeroes_everything():
    m = EngineMetrics()
    fresh = m.as_dict()
    m.on_step(0.5, prefill_tokens=10, decode_seqs=0)
    m.on_decode_step(0.1, batch_size=2)
    m.on_decode_step(0.2, batch_size=2)
    m.on_jump_forward(0.01, tokens=2)
    m.on_preemption()
    m.on_request_finished(request())
    m.set_gauges(num_running_requests=3, num_waiting_requests=2, kv_pages_used=40,
                 kv_pages_total=100, prefix_cache_hit_rate=0.25)
    assert m.as_dict() != fresh
    m.reset()
    after = m.as_dict()
    assert after["last_finished_request"] == RequestMetrics().as_usage_extra()
    assert all(v == 0 for v in after["last_finished_request"].values())
    # capacity is configuration, not a measurement: it survives the reset
    assert after["kv_pages_total"] == 100
    # "now" is over the steps since the reset: none yet (its window is the moments since).
    assert after["now"]["steps"] == 0 and after["now"]["decode_tokens_per_s"] == 0.0
    assert {**after, "kv_pages_total": 0, "now": None} == {**fresh, "now": None}
    # the warm-up is re-armed (MLC): the next update per batch size is discarded again
    m.on_decode_step(0.3, batch_size=2)
    assert m.as_dict()["decode_time_by_batch_size"] == {}


def test_gauges_and_preemptions():
    m = EngineMetrics()
    m.set_gauges(num_running_requests=3, num_waiting_requests=5, kv_pages_used=25, kv_pages_total=100,
                 prefix_cache_hit_rate=0.5)
    m.set_gauges(num_waiting_requests=4)  # only the given ones change
    m.on_preemption()
    m.on_preemption(2)
    d = m.as_dict()
    assert (d["num_running_requests"], d["num_waiting_requests"], d["kv_pages_used"],
            d["kv_pages_total"], d["prefix_cache_hit_rate"], d["num_preemptions"]) == (3, 4, 25, 100, 0.5, 3)
    assert d["kv_cache_usage"] == 0.25


def test_latency_distributions_from_finished_requests():
    m = EngineMetrics()
    # Queue time counts when a request is first scheduled, TTFT when its first token comes, the
    # rest when it finishes.
    m.on_scheduled(0.25)
    m.on_first_token(1.0)
    m.on_request_finished(request(add=0.0, scheduled=0.25, first=1.0, finish=3.0, completion=5))
    m.on_scheduled(0.75)
    assert m.as_dict()["queue_time_s"]["count"] == 2
    m.on_first_token(2.0)
    assert m.as_dict()["ttft_s"]["count"] == 2 and m.as_dict()["end_to_end_latency_s"]["count"] == 1
    m.on_request_finished(request(add=10.0, scheduled=10.75, first=12.0, finish=13.0, completion=3))
    # aborted before it was scheduled: only its end-to-end time is known
    m.on_request_finished(request(add=20.0, scheduled=None, first=None, finish=21.0, completion=0))
    d = m.as_dict()
    assert d["ttft_s"]["count"] == 2 and d["ttft_s"]["mean"] == pytest.approx(1.5)
    assert d["end_to_end_latency_s"]["count"] == 3
    assert d["end_to_end_latency_s"]["mean"] == pytest.approx((3.0 + 3.0 + 1.0) / 3)
    assert d["queue_time_s"]["count"] == 2 and d["queue_time_s"]["max"] == 0.75
    # standard ITL per request: (e2e - ttft) / (n - 1)
    assert d["inter_token_latency_s"]["count"] == 2
    assert d["inter_token_latency_s"]["min"] == pytest.approx(0.5)   # (3 - 1) / 4
    assert d["inter_token_latency_s"]["max"] == pytest.approx(0.5)   # (3 - 2) / 2
    for key in ("ttft_s", "inter_token_latency_s", "end_to_end_latency_s", "queue_time_s"):
        assert set(d[key]) == {"count", "sum", "mean", "min", "max", "p50", "p90", "p99", "last_60s", "last_300s"}


def test_recent_windows_hold_only_the_last_minute_and_five_minutes():
    dist = LatencyDistribution(TTFT_BUCKETS, window=1000)
    now = 10_000.0
    dist.observe(24.0, at=now - 600)          # the stall of a first load, ten minutes ago
    for i in range(10):
        dist.observe(0.2 + i / 100, at=now - 200)  # four minutes ago
    for _ in range(5):
        dist.observe(0.1, at=now - 10)        # just now
    s = dist.summary(now=now)
    assert s["p99"] > 20  # the whole recent window still holds the stall
    assert s["last_60s"] == {"count": 5, "p50": pytest.approx(0.1), "p99": pytest.approx(0.1)}
    assert s["last_300s"]["count"] == 15 and s["last_300s"]["p99"] < 0.3
    assert dist.summary(now=now + 1000)["last_300s"] == {"count": 0, "p50": 0.0, "p99": 0.0}


def test_percentiles_on_known_data():
    dist = LatencyDistribution(TTFT_BUCKETS, window=1000)
    for v in np.random.default_rng(0).permutation(np.arange(1, 101)):
        dist.observe(float(v))
    s = dist.summary()
    # numpy's linear interpolation over 1..100
    assert (s["count"], s["min"], s["max"]) == (100, 1.0, 100.0)
    assert s["mean"] == 50.5 and s["sum"] == 5050.0
    assert (s["p50"], s["p90"], s["p99"]) == pytest.approx((50.5, 90.1, 99.01))


def test_percentiles_cover_the_recent_window_only():
    dist = LatencyDistribution(REQUEST_LATENCY_BUCKETS, window=10)
    for v in range(1, 101):
        dist.observe(float(v))
    s = dist.summary()
    assert (s["count"], s["min"], s["max"], s["mean"]) == (100, 1.0, 100.0, 50.5)   # exact, all-time
    assert s["p50"] == pytest.approx(95.5) and s["p99"] == pytest.approx(99.91)     # last 10 only
    assert dist.snapshot()[4].size == 10  # memory stays bounded


def test_histogram_buckets_use_prometheus_le_semantics():
    dist = LatencyDistribution(INTER_TOKEN_LATENCY_BUCKETS)
    for v in (0.005, 0.01, 0.0100001, 0.5, 80.0, 81.0, 1000.0):
        dist.observe(v)
    dist.observe(math.inf)   # ignored: it would poison the sum
    dist.observe(math.nan)
    h = dist.histogram()
    assert h.bounds == INTER_TOKEN_LATENCY_BUCKETS and h.count == 7
    cumulative = dict(h.cumulative())
    assert cumulative[0.01] == 2          # 0.005 and 0.01 (le is inclusive)
    assert cumulative[0.025] == 3
    assert cumulative[0.5] == 4
    assert cumulative[80.0] == 5
    assert cumulative[math.inf] == 7
    assert list(cumulative.values()) == sorted(cumulative.values())
    as_json = h.as_dict()
    assert as_json["buckets"][-1] == ["+Inf", 7] and as_json["count"] == 7
    strict_json(as_json)


def test_engine_histograms_have_vllm_families():
    m = EngineMetrics()
    m.on_first_token(1.0)
    m.on_request_finished(request())
    hists = m.histograms()
    assert set(hists) == {"time_to_first_token_seconds", "request_time_per_output_token_seconds",
                          "e2e_request_latency_seconds", "request_queue_time_seconds",
                          "inter_token_latency_seconds"}
    assert hists["time_to_first_token_seconds"].bounds == TTFT_BUCKETS
    assert hists["e2e_request_latency_seconds"].bounds == REQUEST_LATENCY_BUCKETS
    assert hists["time_to_first_token_seconds"].cumulative()[-1] == (math.inf, 1)
    assert hists["time_to_first_token_seconds"].sum == pytest.approx(1.0)
    assert dict(hists["e2e_request_latency_seconds"].cumulative())[5.0] == 1   # 3 s


def test_as_dict_never_inf_or_nan_and_round_trips():
    m = EngineMetrics()
    strict_json(m.as_dict())          # all denominators zero
    assert "prefill_tokens_per_s" not in m.as_dict() and "decode_tokens_per_s" not in m.as_dict()
    m.on_request_finished(request(add=1.0, scheduled=1.0, first=1.0, finish=1.0))
    m.on_prefill_step(0.0, tokens=5)  # tokens but no time: no ratio
    m.set_gauges(prefix_cache_hit_rate=math.nan, kv_pages_total=0)
    m.on_jump_forward(math.inf, tokens=1)
    d = m.as_dict()
    strict_json(d)
    assert "prefill_tokens_per_s" not in d
    assert d["prefix_cache_hit_rate"] == 0.0 and d["engine_jump_forward_time_sum"] == 0.0
    m2 = EngineMetrics()
    m2.on_step(0.5, prefill_tokens=10, decode_seqs=0)
    m2.on_request_finished(request())
    d2 = m2.as_dict()
    assert orjson.loads(orjson.dumps(d2)) == d2
    assert json.loads(strict_json(d2)) == d2


def test_last_finished_request_is_a_snapshot():
    m = EngineMetrics()
    rm = request()
    m.on_request_finished(rm)
    rm.completion_tokens = 999
    assert m.as_dict()["last_finished_request"]["completion_tokens"] == 5


def test_concurrent_updates_and_reads():
    m = EngineMetrics()
    n = 3000
    errors: list[BaseException] = []

    def engine_thread() -> None:
        try:
            for i in range(n):
                m.on_step(0.001, prefill_tokens=0, decode_seqs=1 + i % 4)
                m.on_first_token(0.2)
                m.on_request_finished(request(add=float(i), scheduled=i + 0.1, first=i + 0.2, finish=i + 1.0))
                m.set_gauges(num_running_requests=i % 7)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=engine_thread)
    t.start()
    while t.is_alive():
        strict_json(m.as_dict())
    t.join()
    assert not errors
    d = m.as_dict()
    assert d["num_finished_requests"] == n and d["num_decode_steps"] == n
    assert d["ttft_s"]["count"] == n and d["ttft_s"]["p50"] == pytest.approx(0.2)


def test_token_gaps_feed_the_inter_token_latency_histogram():
    m = EngineMetrics()
    m.on_token_gaps([0.02, 0.02, 0.3])
    m.on_token_gaps([])
    hist = m.histograms()["inter_token_latency_seconds"]
    assert hist.count == 3 and hist.sum == pytest.approx(0.34)
    assert m.as_dict()["token_gap_s"]["max"] == pytest.approx(0.3)
    m.reset()
    assert m.histograms()["inter_token_latency_seconds"].count == 0


# ---------------------------------------------------------------------- "now"


def test_now_rates_count_the_steps_in_the_window_pro_rata():
    from engines.runtime.telemetry.metrics import StepRecord, now_rates

    # Steps of 0.25 s decoding 4 sequences, back to back up to t = 100: 16 tokens/s whatever the
    # moment of the read, where a rate between two 0.5 s samples read one or two steps (0, 16, 32).
    steps = [StepRecord(ended_at=90.0 + 0.25 * i, seconds=0.25, prefill_tokens=0, decode_seqs=4) for i in range(1, 41)]
    for now in (100.0, 100.0 + 1e-9):
        rates = now_rates(steps, now, window_s=5.0)
        assert rates["decode_tokens_per_s"] == pytest.approx(16.0)
        assert rates["busy"] == pytest.approx(1.0) and rates["decode_batch_size"] == 4
    # Half a step inside the window's start counts half.
    cut = now_rates(steps, 99.875 + 0.125, window_s=4.875)
    assert cut["decode_tokens_per_s"] == pytest.approx(16.0)
    # Idle since: the rate falls as the window leaves the steps behind, and is 0 once past them.
    assert now_rates(steps, 102.5, window_s=5.0)["decode_tokens_per_s"] == pytest.approx(8.0)
    idle = now_rates(steps, 106.0, window_s=5.0)
    assert idle["decode_tokens_per_s"] == 0.0 and idle["decode_batch_size"] is None and idle["steps"] == 0
    # Counting began 1 s ago (a reset): the window is that second, not five.
    fresh = now_rates(steps, 100.0, window_s=5.0, since=99.0)
    assert fresh["window_s"] == pytest.approx(1.0) and fresh["decode_tokens_per_s"] == pytest.approx(16.0)


def test_now_rates_split_prefill_and_decode_and_take_the_batch_sizes_run():
    from engines.runtime.telemetry.metrics import StepRecord, now_rates

    steps = [StepRecord(1.0, 1.0, prefill_tokens=500, decode_seqs=2),   # a prefill with 2 decodes riding
             StepRecord(1.5, 0.5, prefill_tokens=0, decode_seqs=3),
             StepRecord(2.0, 0.5, prefill_tokens=0, decode_seqs=1)]
    rates = now_rates(steps, 2.0, window_s=2.0)
    assert rates["prefill_tokens_per_s"] == pytest.approx(250.0)
    assert rates["decode_tokens_per_s"] == pytest.approx(3.0)
    assert rates["decode_batch_size"] == pytest.approx(2.0) and rates["decode_batch_size_max"] == 3


def test_engine_metrics_now_holds_the_last_steps_only():
    import time

    m = EngineMetrics()
    t = time.perf_counter()
    m.on_step(0.5, prefill_tokens=0, decode_seqs=8, ended_at=t - 20.0)  # long gone
    m.on_step(0.5, prefill_tokens=0, decode_seqs=2, ended_at=t)
    now = m.as_dict()["now"]
    assert now["steps"] == 1 and now["decode_batch_size_max"] == 2
    assert len(m._steps) == 1  # the old step was let go when the new one came

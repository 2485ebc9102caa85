"""``bench/replay.py``'s shaping of its traffic and of its runs (the bench itself needs llama.cpp, which CI
never builds): the bursts' plan, the part of a dumped workload it keeps, the rounds pooled."""
from __future__ import annotations

import pytest

from bench.replay import (BURST_SIZE, OUTPUT_TOKENS, PROMPT_TOKENS, RECORD_PREFIX, ended_short, parse_args,
                          plan_bursts, pooled, recorded_part)
from engines.workloads.run_compare import compare_runs


def test_the_bursts_are_sent_at_once_a_gap_apart_within_the_bounds() -> None:
    plan = plan_bursts(3, 5.0, seed=1)
    offsets = sorted({p.offset_s for p in plan})
    assert offsets == [0.0, 5.0, 10.0]
    for offset in offsets:
        assert BURST_SIZE[0] <= sum(p.offset_s == offset for p in plan) <= BURST_SIZE[1]
    assert all(PROMPT_TOKENS[0] <= p.prompt_tokens <= PROMPT_TOKENS[1] for p in plan)
    assert all(OUTPUT_TOKENS[0] <= p.max_tokens <= OUTPUT_TOKENS[1] for p in plan)
    assert plan == plan_bursts(3, 5.0, seed=1)
    assert plan != plan_bursts(3, 5.0, seed=2)


def _request(request_id: str, offset_s: float) -> dict:
    return {"request_id": request_id, "offset_s": offset_s, "prompt_tokens": 80, "completion_tokens": 70}


def test_the_kept_workload_is_the_bench_s_requests_from_the_first_of_them() -> None:
    workload = {"format": "llm-debugsite.workload", "version": 1, "engine": "smollm2",
                "requests": [_request("bench-replay-warm", 0.0), _request(f"{RECORD_PREFIX}0", 2.5),
                             _request(f"{RECORD_PREFIX}1", 2.5), _request(f"{RECORD_PREFIX}2", 7.5)]}
    kept = recorded_part(workload)
    assert [r["request_id"] for r in kept["requests"]] == [f"{RECORD_PREFIX}{i}" for i in range(3)]
    assert [r["offset_s"] for r in kept["requests"]] == [0.0, 0.0, 5.0]
    assert kept["engine"] == "smollm2" and workload["requests"][1]["offset_s"] == 2.5
    with pytest.raises(ValueError, match="no request named"):
        recorded_part({"requests": [_request("other", 0.0)]})


def _run(target: str, tag: str, ttfts: list[float], duration_s: float) -> dict:
    requests = [{"request_id": f"r{i}", "ttft_s": t, "itl_s": [0.01, 0.02], "e2e_s": t + 0.03, "completion_tokens": 3,
                 "text": f"out {i}", "error": None} for i, t in enumerate(ttfts)]
    return {"format": "llm-debugsite.run", "version": 1, "target": target, "model": "m", "tag": tag,
            "duration_s": duration_s, "requests": requests, "summary": {"requests": len(requests)}}


def test_rounds_pool_into_one_run_whose_requests_pair_round_by_round() -> None:
    one = _run("ours", "t0", [0.1, 0.2], 2.0)
    assert pooled([one]) is one
    ours = pooled([one, _run("ours", "t1", [0.3, 0.4], 3.0)])
    assert [r["request_id"] for r in ours["requests"]] == ["r0#0", "r1#0", "r0#1", "r1#1"]
    assert ours["duration_s"] == 5.0 and ours["tag"] == "t0,t1" and "summary" not in ours
    theirs = pooled([_run("llama.cpp", "t2", [0.5, 0.6], 4.0), _run("llama.cpp", "t3", [0.7, 0.8], 4.0)])
    report = compare_runs(ours, theirs)
    assert report["outputs_compared"] == 4 and report["outputs_identical"] == 4
    assert report["throughput_tokens_per_s"] == {"a": 12 / 5.0, "b": 12 / 8.0}


def test_a_request_that_stopped_before_its_recorded_length_is_counted() -> None:
    workload = {"requests": [{"request_id": "r0", "completion_tokens": 3},
                             {"request_id": "r1", "completion_tokens": 5}]}
    run = _run("llama.cpp", "t", [0.1, 0.2], 1.0)  # 3 tokens each (its server's count)
    assert ended_short(run, workload) == 1
    run["requests"][1].update(completion_tokens=None, itl_s=[0.01] * 4)  # no count: its 5 text chunks
    assert ended_short(run, workload) == 0
    run["requests"][1]["error"] = "HTTP 500"
    assert ended_short(run, workload) == 0


def test_the_options_refuse_what_cannot_run() -> None:
    assert parse_args([]).threads == 2
    for bad in (["--rounds", "0"], ["--speed", "0"], ["--threads", "0"], ["--burst-gap", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)

"""A trace's request summaries as a workload: arrivals as offsets from the first, lengths kept,
requests without an arrival dropped and counted, from a list or any iterable."""
from __future__ import annotations

import pytest

from engines.history.trace_workload import workload_from_summaries
from engines.workloads.replay import check_workload


def rows():
    yield {"request_id": "b", "added_ts": 3_500_000, "prompt_tokens": 9, "completion_tokens": 4, "e2e_us": 800_000}
    yield {"request_id": "a", "added_ts": 1_000_000, "prompt_tokens": 5, "completion_tokens": 2, "ttft_us": 50_000}
    yield {"request_id": "c", "added_ts": None, "prompt_tokens": 7, "completion_tokens": 1}


def test_a_generator_of_summaries_is_a_workload_with_the_untimed_dropped() -> None:
    workload = workload_from_summaries("demo", rows())
    requests = check_workload(workload)
    assert [(r["request_id"], r["offset_s"], r["prompt_tokens"]) for r in requests] == [("a", 0.0, 5), ("b", 2.5, 9)]
    assert workload["dropped"] == 1
    assert requests[0]["ttft_s"] == pytest.approx(0.05) and requests[1]["e2e_s"] == pytest.approx(0.8)
    assert workload["first_arrival_unix"] == 1.0

"""The regression report of two saved runs (``models.ReplayRunRecord``): ``run_compare``'s figures,
and for runs on our servers the phases' and kernels' deltas from the traces and profiles the
replay job took (``engines.workloads.run_job``)."""
from __future__ import annotations

from typing import Any

from engines.history.workloads import read_json_payload
from engines.models import ReplayRunRecord, RequestSummary
from engines.workloads.run_compare import compare_runs, kernel_deltas, phase_deltas

__all__ = ["RunNotReadyError", "run_breakdowns", "run_records_report"]


class RunNotReadyError(ValueError):
    """A run that cannot be compared yet (or ever); the message says which and why."""


def run_breakdowns(record: ReplayRunRecord, tag: str) -> list[dict[str, float]]:
    """The anatomy (seconds by phase) of the run's requests, as its target's trace recorded them."""
    if record.trace_id is None or not tag:
        return []
    rows = RequestSummary.objects.filter(trace_id=record.trace_id, request_id__startswith=f"replay-{tag}-")
    return [row for row in rows.values_list("time_breakdown", flat=True) if isinstance(row, dict)]


def run_records_report(a: ReplayRunRecord, b: ReplayRunRecord) -> dict[str, Any]:
    """Run ``b`` against run ``a``: ``compare_runs``' report, with ``phases`` and ``kernels``
    (empty where a run has no trace or profile), and the records' ids."""
    for name, record in (("A", a), ("B", b)):
        if record.state != ReplayRunRecord.State.DONE:
            raise RunNotReadyError(f"run {name} (#{record.pk}) is {record.state}: only finished runs compare")
    run_a, run_b = read_json_payload(a), read_json_payload(b)
    report = compare_runs(run_a, run_b)
    report["a"]["id"], report["b"]["id"] = a.pk, b.pk
    report["phases"] = phase_deltas(run_breakdowns(a, run_a.get("tag", "")), run_breakdowns(b, run_b.get("tag", "")))
    kernels_a, kernels_b = run_a.get("profile_kernels") or [], run_b.get("profile_kernels") or []
    report["kernels"] = kernel_deltas(kernels_a, kernels_b) if kernels_a and kernels_b else []
    return report

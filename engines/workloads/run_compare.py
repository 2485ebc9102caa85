"""The regression report: two runs (``engines.workloads.replay``) compared, each difference said beyond noise or not.

For TTFT, ITL and E2E, the p50, p90 and p99 of run A and run B, and a bootstrap confidence interval
of B's minus A's (both runs resampled with replacement, :data:`RESAMPLES` times, a fixed seed: the
same report for the same runs): beyond noise when the interval leaves zero out. Throughput (output
tokens a second of the run), and the outputs of the requests both ran compared, with the first that
differs (meaningful for greedy runs, where a change of output is a change of numerics).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engines.workloads.replay import RUN_FORMAT, RUN_VERSION

__all__ = ["CONFIDENCE", "FIGURES", "RESAMPLES", "Comparison", "RunError", "compare_runs", "markdown"]

#: The resamples of each bootstrap, and the interval's confidence.
RESAMPLES = 2000
CONFIDENCE = 0.95
#: The figures compared: a request's field -> how the report names it.
FIGURES = {"ttft_s": "TTFT", "itl_s": "ITL", "e2e_s": "E2E"}
PERCENTILES = (50, 90, 99)


class RunError(ValueError):
    """The value is not a run this version compares; the message says why."""


@dataclass(frozen=True)
class Comparison:
    """One figure's percentile in A and B (seconds), B - A with its interval, and the verdict."""

    figure: str
    stat: str
    a: float | None
    b: float | None
    delta: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str


def _values(run: dict[str, Any], field: str) -> np.ndarray:
    out: list[float] = []
    for r in run["requests"]:
        if r.get("error") is not None:
            continue
        value = r.get(field)
        if isinstance(value, list):
            out.extend(float(v) for v in value)
        elif isinstance(value, (int, float)):
            out.append(float(value))
    return np.asarray(out, dtype=np.float64)


def _check(run: Any, name: str) -> dict[str, Any]:
    if not isinstance(run, dict) or run.get("format") != RUN_FORMAT or run.get("version") != RUN_VERSION:
        raise RunError(f"{name} is not a run of version {RUN_VERSION} (format {RUN_FORMAT!r})")
    if not isinstance(run.get("requests"), list):
        raise RunError(f"{name}: its \"requests\" must be a list")
    return run


def _bootstrap(a: np.ndarray, b: np.ndarray, q: float, rng: np.random.Generator) -> tuple[float, float]:
    ia = rng.integers(0, a.size, (RESAMPLES, a.size))
    ib = rng.integers(0, b.size, (RESAMPLES, b.size))
    deltas = np.percentile(b[ib], q, axis=1) - np.percentile(a[ia], q, axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(deltas, (tail, 100 - tail))
    return float(low), float(high)


def _verdict(low: float, high: float) -> str:
    if low > 0:
        return "slower beyond noise"
    if high < 0:
        return "faster beyond noise"
    return "no change"


def _throughput(run: dict[str, Any]) -> float | None:
    tokens = sum(r.get("completion_tokens") or len(r.get("itl_s") or ()) + 1 for r in run["requests"]
                 if r.get("error") is None)
    duration = run.get("duration_s") or 0
    return tokens / duration if duration > 0 else None


def _outputs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    by_id = {r["request_id"]: r for r in b["requests"] if r.get("error") is None}
    compared = identical = 0
    first: dict[str, Any] | None = None
    for r in a["requests"]:
        other = by_id.get(r["request_id"])
        if r.get("error") is not None or other is None:
            continue
        compared += 1
        if r.get("text") == other.get("text"):
            identical += 1
        elif first is None:
            ta, tb = r.get("text") or "", other.get("text") or ""
            at = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
            first = {"request_id": r["request_id"], "at_char": at, "a": ta[max(0, at - 20):at + 40],
                     "b": tb[max(0, at - 20):at + 40]}
    return {"outputs_compared": compared, "outputs_identical": identical, "first_divergence": first}


def compare_runs(a: Any, b: Any) -> dict[str, Any]:
    """The report of run ``b`` against run ``a`` (JSON-ready)."""
    a, b = _check(a, "run A"), _check(b, "run B")
    rng = np.random.default_rng(0)
    rows: list[Comparison] = []
    for field, name in FIGURES.items():
        va, vb = _values(a, field), _values(b, field)
        for q in PERCENTILES:
            stat = f"p{q}"
            if va.size < 2 or vb.size < 2:
                rows.append(Comparison(name, stat, None, None, None, None, None, "too few values"))
                continue
            pa, pb = float(np.percentile(va, q)), float(np.percentile(vb, q))
            low, high = _bootstrap(va, vb, q, rng)
            rows.append(Comparison(name, stat, pa, pb, pb - pa, low, high, _verdict(low, high)))
    return {
        "a": {"target": a.get("target"), "model": a.get("model"), "requests": len(a["requests"])},
        "b": {"target": b.get("target"), "model": b.get("model"), "requests": len(b["requests"])},
        "figures": [asdict(r) for r in rows],
        "throughput_tokens_per_s": {"a": _throughput(a), "b": _throughput(b)},
        **_outputs(a, b),
        "confidence": CONFIDENCE, "resamples": RESAMPLES,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table, for a pull request."""
    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v * 1000:,.1f}"

    lines = [f"Run B ({report['b']['target']}, {report['b']['requests']} requests) against run A "
             f"({report['a']['target']}, {report['a']['requests']} requests); "
             f"{report['confidence']:.0%} bootstrap intervals of B - A.", "",
             "| figure | A (ms) | B (ms) | B - A (ms) | interval (ms) | verdict |", "|---|---:|---:|---:|---:|---|"]
    for r in report["figures"]:
        interval = "—" if r["ci_low"] is None else f"{ms(r['ci_low'])} to {ms(r['ci_high'])}"
        lines.append(f"| {r['figure']} {r['stat']} | {ms(r['a'])} | {ms(r['b'])} | {ms(r['delta'])} | {interval} "
                     f"| {r['verdict']} |")
    t = report["throughput_tokens_per_s"]
    lines += ["", f"Throughput: A {t['a'] or 0:,.1f}, B {t['b'] or 0:,.1f} output tokens/s. Outputs identical: "
                  f"{report['outputs_identical']} of {report['outputs_compared']}."]
    return "\n".join(lines) + "\n"


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

from engines.workloads.replay import RUN_FORMAT, RUN_VERSION, output_tokens

__all__ = ["CDF_POINTS", "CONFIDENCE", "FIGURES", "RESAMPLES", "Comparison", "RunError", "cdf_points", "compare_runs",
           "config_diff", "flatten", "kernel_deltas", "markdown", "phase_deltas"]

#: The resamples of each bootstrap, and the interval's confidence.
RESAMPLES = 2000
CONFIDENCE = 0.95
#: The figures compared: a request's field -> how the report names it.
FIGURES = {"ttft_s": "TTFT", "itl_s": "ITL", "e2e_s": "E2E"}
PERCENTILES = (50, 90, 99)
#: Points of each distribution drawn (its quantiles, evenly spaced): a page's chart, not the data.
CDF_POINTS = 101


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
    tokens = sum(output_tokens(r.get("completion_tokens"), r.get("itl_s") or []) for r in run["requests"]
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


def cdf_points(values: np.ndarray, points: int = CDF_POINTS) -> list[list[float]]:
    """``values``' distribution as ``[value, fraction at or below]`` pairs, at evenly spaced quantiles."""
    if values.size == 0:
        return []
    fractions = np.linspace(0.0, 1.0, points)
    return [[float(v), float(f)] for v, f in zip(np.quantile(values, fractions), fractions, strict=True)]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level of dotted keys."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def config_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The settings in which two targets' configurations differ (dotted keys, sorted; ``None``
    where one does not say): flags, model, weights format, commit, server kind and version."""
    fa, fb = flatten(a or {}), flatten(b or {})
    return [{"key": key, "a": fa.get(key), "b": fb.get(key)} for key in sorted(set(fa) | set(fb))
            if key != "url" and fa.get(key) != fb.get(key)]


def phase_deltas(a: list[dict[str, float]], b: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Where the requests' time went in each run (their anatomy, ``time_breakdown``: seconds by
    phase), as the mean seconds a request per phase, A, B and B - A; largest change first."""
    def means(rows: list[dict[str, float]]) -> dict[str, float]:
        phases = {key for row in rows for key in row}
        return {key: sum(row.get(key, 0.0) for row in rows) / len(rows) for key in phases} if rows else {}

    ma, mb = means(a), means(b)
    out = [{"phase": key, "a": ma.get(key), "b": mb.get(key), "delta": mb.get(key, 0.0) - ma.get(key, 0.0)}
           for key in set(ma) | set(mb)]
    return sorted(out, key=lambda row: -abs(row["delta"]))


def kernel_deltas(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two profiles' kernels side by side (``ProfileRecord.kernels``): calls and mean µs a call in
    each, and the change of total µs; largest change first."""
    ka, kb = {k["name"]: k for k in a}, {k["name"]: k for k in b}
    out = []
    for name in set(ka) | set(kb):
        x, y = ka.get(name, {}), kb.get(name, {})
        out.append({"kernel": name, "calls_a": x.get("calls"), "calls_b": y.get("calls"),
                    "mean_us_a": x.get("mean_us"), "mean_us_b": y.get("mean_us"),
                    "total_us_delta": (y.get("total_us") or 0.0) - (x.get("total_us") or 0.0)})
    return sorted(out, key=lambda row: -abs(row["total_us_delta"]))


def compare_runs(a: Any, b: Any) -> dict[str, Any]:
    """The report of run ``b`` against run ``a`` (JSON-ready)."""
    a, b = _check(a, "run A"), _check(b, "run B")
    rng = np.random.default_rng(0)
    rows: list[Comparison] = []
    cdfs: dict[str, dict[str, list[list[float]]]] = {}
    for field, name in FIGURES.items():
        va, vb = _values(a, field), _values(b, field)
        cdfs[name] = {"a": cdf_points(va), "b": cdf_points(vb)}
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
        "cdfs": cdfs,
        "throughput_tokens_per_s": {"a": _throughput(a), "b": _throughput(b)},
        **_outputs(a, b),
        "config_diff": config_diff(a.get("target_config"), b.get("target_config")),
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
    first = report.get("first_divergence")
    if first:
        lines += ["", f"First divergence: request {first['request_id']} at character {first['at_char']}: "
                      f"A `{first['a']}`, B `{first['b']}`."]
    if report.get("config_diff"):
        lines += ["", "| setting | A | B |", "|---|---|---|"]
        lines += [f"| {row['key']} | {row['a']} | {row['b']} |" for row in report["config_diff"]]
    if report.get("phases"):
        lines += ["", "| phase (mean s a request) | A | B | B - A |", "|---|---:|---:|---:|"]
        lines += [f"| {row['phase']} | {row['a'] or 0:.4f} | {row['b'] or 0:.4f} | {row['delta']:+.4f} |"
                  for row in report["phases"]]
    if report.get("kernels"):
        lines += ["", "| kernel | calls A | calls B | mean µs A | mean µs B | total µs B - A |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {row['kernel']} | {row['calls_a'] or 0} | {row['calls_b'] or 0} | {row['mean_us_a'] or 0:,.1f} "
                  f"| {row['mean_us_b'] or 0:,.1f} | {row['total_us_delta']:+,.0f} |" for row in report["kernels"][:15]]
    return "\n".join(lines) + "\n"


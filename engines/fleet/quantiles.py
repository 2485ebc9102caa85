"""Percentiles from Prometheus histogram buckets: one server's, and a fleet's whose servers use
different bucket sets.

One server: :func:`bucket_quantile` interpolates linearly inside the bucket the rank falls in,
as Prometheus' ``histogram_quantile`` does (the first bucket starts at 0; a rank in the ``+Inf``
bucket answers the largest finite bound).

A fleet: summing bucket counts by ``le`` across servers is wrong when their bounds differ (vLLM's
TTFT buckets start at 1 ms, SGLang's at 100 ms: every SGLang request under 100 ms would sit in
vLLM's 100 ms bucket). :func:`fleet_quantile` instead takes each server's distribution as its own
buckets describe it (the piecewise-linear CDF ``bucket_quantile`` inverts) and finds where their
sum reaches the rank: the exact quantile of the mixture, with no re-binning. Since only the
counts at each server's own bounds are known, it also gives the interval the true quantile must
lie in (:class:`FleetQuantile` ``low``/``high``): a percentile drawn with its error bar.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Buckets", "FleetQuantile", "bucket_quantile", "buckets_from_samples", "fleet_quantile",
           "window_delta"]

#: ``(upper bound, cumulative count)`` pairs in increasing bound order, ending at ``+Inf``.
Buckets = tuple[tuple[float, float], ...]


def buckets_from_samples(pairs: Sequence[tuple[float, float]]) -> Buckets:
    """Sorted, merged (equal bounds summed: several label sets of one server), ending at +Inf."""
    merged: dict[float, float] = {}
    for bound, count in pairs:
        merged[bound] = merged.get(bound, 0.0) + count
    if math.inf not in merged and merged:
        merged[math.inf] = max(merged.values())
    return tuple(sorted(merged.items()))


def window_delta(newer: Buckets, older: Buckets | None) -> Buckets | None:
    """The observations between two readings of one histogram (the counts' differences); None
    when the bounds changed or a count went down (the server restarted: its counters reset)."""
    if older is None:
        return newer
    if [b for b, _ in newer] != [b for b, _ in older]:
        return None
    delta = tuple((b, n - o) for (b, n), (_, o) in zip(newer, older, strict=True))
    return None if any(c < 0 for _, c in delta) else delta


def bucket_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile (0..1) of one histogram; None when it holds no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bound: that bound is all that is known
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _cdf(buckets: Buckets, x: float) -> float:
    """The count at or below ``x`` on the piecewise-linear CDF through the bucket corners."""
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if x <= bound:
            if math.isinf(bound):
                return lower_count  # the +Inf bucket's mass is placed beyond every finite x
            return lower_count + (count - lower_count) * (x - lower_bound) / (bound - lower_bound)
        lower_bound, lower_count = bound, count
    return lower_count


def _count_at_or_below(buckets: Buckets, x: float, *, upper: bool) -> float:
    """A bound on the true count at or below ``x`` from the known counts: the count at the
    largest bound <= x (``upper`` False, a lower bound) or at the smallest bound >= x (an upper one)."""
    bounds = [b for b, _ in buckets]
    i = bisect_left(bounds, x)
    if upper:
        return buckets[i][1] if i < len(buckets) else buckets[-1][1]
    if i < len(buckets) and bounds[i] == x:
        return buckets[i][1]
    return buckets[i - 1][1] if i > 0 else 0.0


@dataclass(frozen=True)
class FleetQuantile:
    """A fleet percentile: ``value`` on the mixture of the servers' interpolated distributions;
    the true value lies in ``[low, high]`` (``high`` is ``inf`` when the rank reaches some
    server's ``+Inf`` bucket); ``count`` observations in all."""

    value: float
    low: float
    high: float
    count: float


def fleet_quantile(q: float, histograms: Sequence[Buckets]) -> FleetQuantile | None:
    """The ``q`` quantile of every observation in ``histograms`` together, whatever their bounds;
    None when they hold none."""
    parts = [h for h in histograms if h and h[-1][1] > 0]
    if not parts:
        return None
    total = sum(h[-1][1] for h in parts)
    rank = q * total
    edges = sorted({b for h in parts for b, _ in h if not math.isinf(b)} | {0.0})

    def mixture(x: float) -> float:
        return sum(_cdf(h, x) for h in parts)

    value = edges[-1]
    previous = 0.0
    for edge in edges:  # the mixture is linear between consecutive edges: solve inside the first that reaches
        at_edge = mixture(edge)
        if at_edge >= rank and edge > 0:
            below = mixture(previous)
            value = previous + (edge - previous) * (rank - below) / (at_edge - below) if at_edge > below else edge
            break
        previous = edge
    # The true count at or below x is at most the counts at each server's next bound up, and at
    # least those at its last bound down: both are steps between consecutive edges, so the true
    # quantile lies after the edge before the first that can reach the rank, and at or before the
    # first edge that must.
    first_possible = next((i for i, e in enumerate(edges)
                           if sum(_count_at_or_below(h, e, upper=True) for h in parts) >= rank), len(edges))
    low = edges[max(first_possible - 1, 0)]
    high = next((e for e in edges if sum(_count_at_or_below(h, e, upper=False) for h in parts) >= rank), math.inf)
    return FleetQuantile(value=value, low=min(low, value), high=max(high, value), count=total)

"""A request's time breakdown as a waterfall: each phase a bar that starts where the one before
it ended, so the bars end together at the request's end-to-end latency.

Plain data for the one template that draws it (``admin/engines/includes/anatomy.html``), used by
the history's request page and the dashboard's request page alike. The phases and what each
means: docs/metrics.md, "Anatomy of a request".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["PHASE_LABELS", "WaterfallBar", "waterfall"]

#: How a phase reads on a page, in the engine's order (``engines.runtime.PHASES``).
PHASE_LABELS: dict[str, str] = {
    "server": "server (before the engine took it)",
    "queued": "queued (no slot, no KV)",
    "prefill": "its prefill",
    "behind_prefill": "behind others' prefill",
    "decode": "decode",
    "decode_stretched": "decode stretched by others' prefill",
    "preemption": "preempted and recomputing",
    "kv_transfer": "K/V transfer",
    "grammar": "grammar masks",
    "engine_overhead": "engine overhead",
}


@dataclass(frozen=True, slots=True)
class WaterfallBar:
    """One phase: ``offset`` and ``share`` are fractions of the total (where its bar starts, how
    long it is); percentages of them place the bar."""

    phase: str
    label: str
    seconds: float
    offset: float
    share: float

    @property
    def offset_pct(self) -> str:
        return f"{100 * self.offset:.3f}"

    @property
    def share_pct(self) -> str:
        return f"{100 * self.share:.3f}"

    @property
    def share_text(self) -> str:
        """The share as read: "41 %", "<1 %" for a sliver that is not nothing."""
        pct = 100 * self.share
        return "<1 %" if 0 < pct < 1 else f"{pct:.0f} %"


def waterfall(breakdown: Mapping[str, float]) -> list[WaterfallBar]:
    """The bars of the phases that took any time, in the engine's order; [] when none did."""
    total = sum(breakdown.values())
    if total <= 0:
        return []
    bars = []
    start = 0.0
    for phase, label in PHASE_LABELS.items():
        seconds = float(breakdown.get(phase, 0.0))
        if seconds > 0:
            bars.append(WaterfallBar(phase, label, seconds, start / total, seconds / total))
            start += seconds
    return bars

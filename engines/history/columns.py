"""The request-summary columns, declared once.

One request of a saved trace (``RequestStats`` in the analysis, a ``RequestSummary`` row in
the database) is shown in three places, all built from :data:`REQUEST_COLUMNS`: the trace
detail page's request table, the admin's request list across all history (and a summary's own
page), and the request statistics of the detail and compare pages (the columns with a
``statistic``, whose distributions the analysis computes and ``TraceRecord.stats`` keeps).
Plain data, no Django, so the analysis can use it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["REQUEST_COLUMNS", "STATISTIC_COLUMNS", "RequestColumn"]


@dataclass(frozen=True, slots=True)
class RequestColumn:
    """One figure of a request summary.

    ``field`` is the attribute of ``RequestStats`` and ``RequestSummary``; ``label`` names the
    figure in a table header. ``unit`` is ``"ms"`` for durations (stored in microseconds, shown
    in milliseconds), ``"tokens"`` for token counts, else empty. ``statistic`` names the
    figure's row in the request statistics; ``None`` for figures whose distribution means
    nothing (ids, finish reasons) or is not kept (preemptions).
    """

    field: str
    label: str
    unit: Literal["", "ms", "tokens"] = ""
    statistic: str | None = None

    @property
    def is_duration(self) -> bool:
        return self.unit == "ms"

    @property
    def header(self) -> str:
        """The table header: the label, and the unit a duration is shown in."""
        return f"{self.label} (ms)" if self.is_duration else self.label


#: In table order.
REQUEST_COLUMNS: tuple[RequestColumn, ...] = (
    RequestColumn("request_id", "request id"),
    RequestColumn("finish_reason", "finish reason"),
    RequestColumn("prompt_tokens", "prompt tokens", "tokens", "Prompt tokens"),
    RequestColumn("completion_tokens", "completion tokens", "tokens", "Completion tokens"),
    RequestColumn("queue_us", "queue", "ms", "Queue wait"),
    RequestColumn("ttft_us", "TTFT", "ms", "Time to first token"),
    RequestColumn("prefill_us", "prefill", "ms", "Prefill time"),
    RequestColumn("decode_us", "decode", "ms", "Decode time"),
    RequestColumn("e2e_us", "e2e", "ms", "End-to-end latency"),
    RequestColumn("preemptions", "preemptions"),
)

#: The columns whose distribution over a trace's requests is computed and shown.
STATISTIC_COLUMNS: tuple[RequestColumn, ...] = tuple(c for c in REQUEST_COLUMNS if c.statistic is not None)

"""The flight recorder: the engine's last requests as a workload another server can be sent.

Always on and bounded (:data:`CAPACITY` requests an engine, about 300 bytes each: a few hundred
kB, stated in docs/interfaces.md, "Workload"): each request that ends is kept with what a replay
needs (when it came relative to the others, its sampling parameters, its prompt's and output's
token counts) and what it measured (outcome, queue, TTFT, E2E).

Its prompt's and first choice's token ids are held too, as 4-byte arrays within
:data:`TOKEN_BUDGET_BYTES` (the oldest requests' ids go first), but leave the process only in a dump
``with_text`` (``serve --capture-text``): the prefix cache holds the same ids already, and without
the flag a workload has no text and no ids, and a replay sends prompts of the same token lengths.
:meth:`FlightRecorder.dump` is the versioned :class:`Workload` that ``POST /debug/dump_workload`` answers.
"""
from __future__ import annotations

import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CAPACITY", "TOKEN_BUDGET_BYTES", "WORKLOAD_FORMAT", "WORKLOAD_VERSION", "FlightRecorder", "Workload",
           "WorkloadRequest"]

#: Requests kept an engine (the newest).
CAPACITY = 2000
#: Bytes of token ids kept an engine (4 a token: 4M tokens), for dumps with text.
TOKEN_BUDGET_BYTES = 16 << 20
#: What a workload's JSON names itself, and its format's version (docs/interfaces.md, "Workload").
WORKLOAD_FORMAT = "llm-debugsite.workload"
WORKLOAD_VERSION = 1


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request as recorded. ``arrival`` is ``perf_counter`` seconds (a dump turns it into
    ``offset_s``, from the workload's first arrival); times are seconds, None where the moment never came."""

    request_id: str
    arrival: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    seed: int | None
    ignore_eos: bool
    finish_reason: str
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float


@dataclass(frozen=True)
class Workload:
    """The recorder's requests, oldest arrival first: the JSON of ``/debug/dump_workload``."""

    engine: str
    first_arrival_unix: float | None
    capacity: int
    #: Requests that ended since the start or reset but fell out of the window.
    dropped: int
    requests: list[dict[str, Any]] = field(default_factory=list)
    #: Whether requests carry ``prompt_token_ids``, ``output_token_ids`` and ``output_text`` (each
    #: where its ids were still held): only in a dump with text (``serve --capture-text``).
    text_captured: bool = False
    format: str = WORKLOAD_FORMAT
    version: int = WORKLOAD_VERSION

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Entry:
    """A recorded request and its token ids, until the budget takes them back."""

    __slots__ = ("request", "prompt", "output")

    def __init__(self, request: WorkloadRequest, prompt: array | None, output: array | None) -> None:
        self.request, self.prompt, self.output = request, prompt, output

    @property
    def token_bytes(self) -> int:
        return 0 if self.prompt is None or self.output is None else (len(self.prompt) + len(self.output)) * 4


class FlightRecorder:
    """The last :data:`CAPACITY` requests of one engine, and the token ids of the newest of them
    within ``token_budget`` bytes (engine thread writes, any thread reads)."""

    def __init__(self, capacity: int = CAPACITY, token_budget: int = TOKEN_BUDGET_BYTES) -> None:
        self.capacity = capacity
        self.token_budget = token_budget
        self._entries: deque[_Entry] = deque()
        # The entries that still hold ids, oldest first (some may have given theirs back since).
        self._with_tokens: deque[_Entry] = deque()
        self._token_bytes = 0
        self._recorded = 0
        self._lock = threading.Lock()

    def record(self, request: WorkloadRequest, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()) -> None:
        """Keep ``request``, with its prompt's and first choice's token ids while the budget lasts."""
        entry = _Entry(request, array("i", prompt_ids), array("i", output_ids))
        with self._lock:
            if entry.token_bytes > self.token_budget:
                entry.prompt = entry.output = None
            self._entries.append(entry)
            self._recorded += 1
            if len(self._entries) > self.capacity:
                self._forget_tokens(self._entries.popleft())
            if entry.prompt is not None:
                self._with_tokens.append(entry)
                self._token_bytes += entry.token_bytes
            while self._token_bytes > self.token_budget:
                self._forget_tokens(self._with_tokens.popleft())

    def _forget_tokens(self, entry: _Entry) -> None:
        self._token_bytes -= entry.token_bytes
        entry.prompt = entry.output = None

    @property
    def token_bytes(self) -> int:
        """Bytes of token ids held now."""
        return self._token_bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._with_tokens.clear()
            self._token_bytes = 0
            self._recorded = 0

    def dump(self, engine: str, decode: Callable[[list[int]], str] | None = None) -> Workload:
        """The window as a :class:`Workload`: arrivals as offsets from the first, the first on the
        wall clock. With ``decode`` (``serve --capture-text``), each request whose ids are still held
        carries them and its output as text."""
        with self._lock:
            held = sorted(((e.request, e.prompt, e.output) for e in self._entries), key=lambda e: e[0].arrival)
            dropped = self._recorded - len(held)
        if not held:
            return Workload(engine, None, self.capacity, dropped, text_captured=decode is not None)
        first = held[0][0].arrival
        first_unix = time.time() - (time.perf_counter() - first)
        rows = []
        for r, prompt, output in held:
            row = asdict(r)
            row["offset_s"] = row.pop("arrival") - first
            if decode is not None and prompt is not None and output is not None:
                row["prompt_token_ids"] = prompt.tolist()
                row["output_token_ids"] = output.tolist()
                row["output_text"] = decode(row["output_token_ids"])
            rows.append(row)
        return Workload(engine, first_unix, self.capacity, dropped, rows, text_captured=decode is not None)

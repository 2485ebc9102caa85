"""What a debugger sees of an engine while it runs: every request in it (:class:`LiveRequest`)
and what its KV cache holds (:class:`KVCacheDump`), as plain frozen dataclasses that cross the
engine-process boundary pickled (``docs/interfaces.md``).

Both are read from any thread, mid-step included: a reader of plain fields that copies each
container in one C-level call under the GIL (``list(d.items())``), so a step changing them
meanwhile never breaks the read; the figures may then be one step apart. Nothing here holds
prompt or output text: ids, counts and times only.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engines.runtime.core.disagg.sender import describe_half

if TYPE_CHECKING:
    from engines.runtime.core.disagg.receiver import KVReceiver
    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.core.request import RequestState
    from engines.runtime.core.scheduler import Scheduler

__all__ = ["KVCacheDump", "LiveRequest", "LiveRequests", "LiveState", "PrefixCacheEntry", "RequestPages",
           "dump_kv_cache", "live_requests", "page_ranges"]

#: Where a request stands: not admitted yet; computing its prompt; generating; sent back to the
#: queue to free pages (it recomputes when readmitted); its K/V crossing between engines
#: (a receive side's reservation waiting for the K/V another engine sends).
LiveState = Literal["waiting", "prefilling", "decoding", "preempted", "kv_transfer"]

#: Rows a live read returns unless told otherwise: the running ones are bounded by
#: ``max_num_seqs``, the waiting queue is not, and the page's socket sends it 4 times a second.
DEFAULT_LIVE_LIMIT = 256
#: Prefix-cache entries a dump lists unless told otherwise (the most recently used).
DEFAULT_KV_ENTRIES = 32


@dataclass(frozen=True)
class LiveRequest:
    """One request in the engine now. Times in seconds; None where it has not happened yet."""

    request_id: str
    #: The client's own ids: OpenAI's ``user``, and ``X-Request-Id`` (None until the server reads it).
    user: str | None
    client_request_id: str | None
    state: LiveState
    #: Since it reached the server (or the router in front, ``X-Request-Age``).
    age_s: float
    #: Waiting for its first step, so far (all of its age while it still waits).
    queued_s: float
    prompt_tokens: int
    #: Of the prompt: taken from the prefix cache at its last admission, with K/V now (cached
    #: included), and still to compute: the prefill's progress.
    cached_tokens: int
    computed_tokens: int
    left_tokens: int
    output_tokens: int
    #: The most output tokens it may make (``max_tokens``, else what the context leaves), per choice.
    max_output_tokens: int
    #: Output tokens per second since its first token (None before its second).
    tokens_per_s: float | None
    ttft_s: float | None
    kv_pages: int
    #: The ``response_format`` type that constrains it (``json_object``, ``json_schema``, ...), or None.
    grammar: str | None
    temperature: float
    top_p: float
    #: Choices (``n``).
    n: int
    preemptions: int
    #: Which half of a disaggregated request it is (``describe_half``), or None.
    disagg: str | None
    #: Text, only when the server captures it (``serve --capture-text``): the prompt's first
    #: :data:`TEXT_TOKENS` tokens and choice 0's last as many, detokenized. None otherwise.
    prompt_text: str | None = None
    output_text: str | None = None


@dataclass(frozen=True)
class LiveRequests:
    """A bounded read of the requests in the engine: ``requests`` oldest first, at most the
    limit asked for, of ``total`` there are."""

    requests: list[LiveRequest]
    total: int

    @property
    def truncated(self) -> bool:
        """Whether requests were left out (the newest ones)."""
        return len(self.requests) < self.total


@dataclass(frozen=True)
class RequestPages:
    """The KV pages one request holds now: how many, and their ids as ranges (``"0-15, 40"``)."""

    request_id: str
    pages: int
    page_ids: str


@dataclass(frozen=True)
class PrefixCacheEntry:
    """One cached prefix: a chain of full pages from a prompt's start to a page no longer cached
    prefix extends (a leaf). Chains that share a beginning share its pages."""

    tokens: int
    pages: int
    #: Admissions that reused the whole entry, and any part of it (its first page).
    hits: int
    prefix_hits: int
    #: Seconds since a sequence last matched, filled or released its last page.
    last_use_s: float
    #: Live sequences holding its last page now (0: evictable, unless pinned).
    held_by: int
    pinned: bool
    #: Its first page's tokens as text, only when the server captures text (``serve --capture-text``).
    first_words: str | None = None


@dataclass(frozen=True)
class KVCacheDump:
    """The KV cache opened: page counts (every page is used, cached or free; pinned ones are
    used), the pages each request holds, the prefix cache's most recently used entries (of
    ``num_entries``), and the cache's counters since the engine started or was reset."""

    page_size: int
    total_pages: int
    used_pages: int
    cached_pages: int
    free_pages: int
    pinned_pages: int
    #: Prompt tokens looked up at admission, and those the cache served.
    query_tokens: int
    hit_tokens: int
    hit_rate: float
    #: Cached pages dropped to make room, and sequences preempted for want of pages.
    evictions: int
    preemptions: int
    requests: list[RequestPages]
    entries: list[PrefixCacheEntry]
    num_entries: int


def page_ranges(pages: list[int]) -> str:
    """Page ids as runs: ``[0, 1, 2, 7]`` -> ``"0-2, 7"`` (a fresh pool hands out runs)."""
    runs: list[str] = []
    start = prev = None
    for page in pages:
        if prev is not None and page == prev + 1:
            prev = page
            continue
        if start is not None:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = page
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(runs)


def _first_words(kv_pool: "KVCachePool", page: int, text: Callable[[list[int]], str] | None) -> str | None:
    if text is None:
        return None
    tokens = kv_pool.prefix_tokens(page)
    return text(list(tokens)) if tokens is not None else None


def _grammar(state: "RequestState") -> str | None:
    fmt = state.request.response_format
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    return None if kind in (None, "text") else str(kind)


#: Tokens of text a live row keeps of its prompt (the start) and its output (the end), with text capture on.
TEXT_TOKENS = 32


def live_requests(requests: dict[str, "RequestState"], scheduler: "Scheduler", kv_pool: "KVCachePool",
                  receiver: "KVReceiver", max_seq_len: int, limit: int = DEFAULT_LIVE_LIMIT,
                  text: Callable[[list[int]], str] | None = None) -> LiveRequests:
    """The requests in the engine now, oldest first, then the K/V reservations waiting for their
    transfer; at most ``limit`` of them. ``text`` (a detokenizer): rows carry text too."""
    now = time.perf_counter()
    states = list(requests.values())  # one C-level copy each: a step may change them meanwhile
    reservations = list(receiver.reservations.items())
    running = {seq.seq_id for seq in list(scheduler.running)}
    total = len(states) + len(reservations)
    rows: list[LiveRequest] = []
    for state in states[:limit]:
        seqs = list(state.sequences)
        live = [s for s in seqs if not s.finished] or seqs
        prompt = len(state.request.prompt)
        if any(s.seq_id in running for s in live):
            state_name: LiveState = ("prefilling" if any(s.seq_id in running and s.num_computed < s.num_prompt_tokens
                                                        for s in live) else "decoding")
        else:
            state_name = "preempted" if any(s.preempted for s in live) else "waiting"
        computed = max((min(s.num_computed, s.num_prompt_tokens) for s in live), default=0)
        output = sum(s.num_output_tokens for s in seqs)
        first, scheduled = state.first_token_time, state.first_scheduled_time
        max_tokens = state.params.max_tokens
        span = now - first if first is not None else 0.0
        rows.append(LiveRequest(
            request_id=state.request_id, user=state.request.user, client_request_id=state.request.client_request_id,
            state=state_name, age_s=now - state.arrival_time,
            queued_s=(scheduled if scheduled is not None else now) - state.arrival_time,
            prompt_tokens=prompt, cached_tokens=max((s.num_cached_prefix_tokens for s in live), default=0),
            computed_tokens=computed, left_tokens=max(0, (live[0].num_prompt_tokens if live else prompt) - computed),
            output_tokens=output,
            max_output_tokens=max_tokens if max_tokens is not None else max(0, max_seq_len - prompt),
            tokens_per_s=(output - len(seqs)) / span if output > len(seqs) and span > 0 else None,
            ttft_s=None if first is None else first - state.arrival_time,
            kv_pages=sum(kv_pool.num_pages_held(s.seq_id) for s in seqs), grammar=_grammar(state),
            temperature=state.params.temperature, top_p=state.params.top_p, n=len(seqs),
            preemptions=sum(s.num_preemptions for s in seqs), disagg=describe_half(state.request),
            prompt_text=text(list(state.request.prompt[:TEXT_TOKENS])) if text is not None else None,
            output_text=text(seqs[0].token_ids[max(seqs[0].num_prompt_tokens, len(seqs[0].token_ids) - TEXT_TOKENS):])
            if text is not None and seqs else None))
    for request_id, res in reservations[:max(0, limit - len(rows))]:
        age = now - res.reserved_at if res.reserved_at is not None else 0.0
        computed = res.receipt.prefix_matched_length if not res.received else res.receipt.end
        rows.append(LiveRequest(
            request_id=request_id, user=None, client_request_id=None, state="kv_transfer", age_s=age, queued_s=age,
            prompt_tokens=len(res.prompt), cached_tokens=res.receipt.prefix_matched_length, computed_tokens=computed,
            left_tokens=len(res.prompt) - computed, output_tokens=0, max_output_tokens=0, tokens_per_s=None,
            ttft_s=None, kv_pages=kv_pool.num_pages_held(res.pool_id), grammar=None, temperature=0.0, top_p=0.0,
            n=0, preemptions=0, disagg=f"receiving KV [0:{res.receipt.end}]"))
    return LiveRequests(rows, total)


def dump_kv_cache(kv_pool: "KVCachePool", requests: dict[str, "RequestState"], preemptions: int,
                  max_entries: int = DEFAULT_KV_ENTRIES, text: Callable[[list[int]], str] | None = None) -> KVCacheDump:
    """The pool as of now (:class:`KVCacheDump`), its ``max_entries`` most recently used prefix entries;
    ``text`` (a detokenizer): each entry's first words too."""
    usage = kv_pool.usage()
    held = []
    for state in list(requests.values()):
        pages = [p for s in list(state.sequences) for p in kv_pool.pages_held(s.seq_id)]
        held.append(RequestPages(state.request_id, len(pages), page_ranges(sorted(set(pages)))))
    leaves = kv_pool.prefix_leaves()
    now = time.perf_counter()
    newest = heapq.nlargest(max_entries, leaves, key=lambda leaf: leaf.last_use)
    entries = [PrefixCacheEntry(tokens=leaf.depth * kv_pool.page_size, pages=leaf.depth, hits=leaf.hits,
                                prefix_hits=kv_pool.first_page_hits(leaf.page),
                                last_use_s=max(0.0, now - leaf.last_use), held_by=leaf.held_by, pinned=leaf.pinned,
                                first_words=_first_words(kv_pool, leaf.page, text))
               for leaf in newest]
    return KVCacheDump(
        page_size=kv_pool.page_size, total_pages=usage.total_pages, used_pages=usage.used_pages,
        cached_pages=usage.cached_pages, free_pages=usage.free_pages, pinned_pages=kv_pool.num_pinned_pages,
        query_tokens=usage.query_tokens, hit_tokens=usage.hit_tokens, hit_rate=usage.hit_rate,
        evictions=kv_pool.num_evictions, preemptions=preemptions, requests=held, entries=entries,
        num_entries=len(leaves))

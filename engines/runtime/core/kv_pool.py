"""Paged KV cache bookkeeping: a fixed page pool, a prefix cache over full pages, pinning.

The model owns the K/V *storage* (``LlamaModel.new_kv_cache``); this module owns the
*page ids*: which pages are free, which sequence holds which pages, and which full
pages can be shared between sequences because they hold the same token prefix.

How the engine drives it, one sequence (``seq_id``) at a time:

1. ``admit(seq_id, token_ids, max_new_tokens)`` when a waiting sequence is first
   scheduled (or re-scheduled after preemption, with prompt + generated tokens).
   It reuses the longest cached full-page prefix, reserves slots for the first
   chunk to compute, and returns ``Admission(cached_tokens, new_tokens)``, or
   ``None`` (nothing changed) when the pool cannot hold that chunk.
2. ``try_allocate(seq_id, n)`` before each later step that feeds ``n`` more tokens
   (the next prefill chunk, or 1 per decode). ``False`` means "out of pages":
   preempt someone (``free`` their sequence) and try again.
3. ``commit(seq_id, token_ids)`` after the forward pass wrote those tokens' K/V.
   Pages that became full enter the prefix cache here, never earlier, so a page is
   never shared before its contents exist.
4. ``free(seq_id)`` when the sequence finishes, is aborted or is preempted.

``page_table(seq_ids)`` and ``num_computed_tokens(seq_id)`` give
``ForwardBatch.page_table`` and ``ForwardBatch.cached_lens`` directly.

Prefix cache (vLLM-style block hashing): page ``i`` of a sequence is keyed by a
digest of (key of page ``i - 1``, the page's ``page_size`` token ids), so a key
names a whole prefix, not just one page's tokens. Only full pages are cached. A
cached page whose last user left stays resident and is reused on a later match;
it is evicted (least recently released first) only when a fresh page is needed
and no never-used page is left. Pinned pages (``pin``) are never evicted; only
``reset()`` drops them.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from engines.runtime.core.free_pages import FreePages

__all__ = [
    "Admission",
    "KVCachePool",
    "KVCacheUsage",
    "PrefixLeaf",
]

SeqId = Hashable


@dataclass(frozen=True)
class Admission:
    """What ``KVCachePool.admit`` gave a sequence.

    ``cached_tokens``: leading tokens whose K/V came from the prefix cache (a
    multiple of ``page_size``; feed ``token_ids[cached_tokens:]``).
    ``new_tokens``: slots reserved for this step's chunk, starting at
    ``cached_tokens``.
    """

    cached_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class KVCacheUsage:
    """A snapshot of the pool for metrics and the dashboard.

    Every page is exactly one of: ``used`` (held by a live sequence, or pinned),
    ``cached`` (resident prefix-cache page nobody holds: reusable, evictable) or
    ``free`` (no useful contents). ``query_tokens`` / ``hit_tokens`` count prompt tokens looked up at
    admission and those served from the cache (an admission capped by ``max_cached_tokens``, a
    choice scoring its prompt, counts in neither: the rate stays the cache's worth to the others).
    """

    total_pages: int
    used_pages: int
    cached_pages: int
    free_pages: int
    query_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache (0.0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class PrefixLeaf:
    """A cached page that no cached page extends: the end of a cached prefix (``prefix_leaves``)."""

    page: int
    #: Pages from the prompt's start to this one (its prefix's length in pages).
    depth: int
    #: Admissions whose matched prefix reached this page.
    hits: int
    #: ``time.perf_counter()`` of its last match, fill or release.
    last_use: float
    #: Sequences holding it now.
    held_by: int
    pinned: bool


_ROOT_KEY = b""  # parent key of a sequence's first page


def _page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content key of a full page given its parent's key.

    A cryptographic digest rather than Python's ``hash``: a collision would let one
    request attend over another request's K/V, and int-tuple hashes are easy to
    collide on purpose. 128 bits of BLAKE2b costs about a microsecond a page.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class _Sequence:
    """Per-sequence state: its pages in order and what has been computed into them."""

    __slots__ = ("pages", "num_slots", "token_ids", "page_keys", "pin_tokens")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.num_slots = 0             # tokens with a reserved slot (computed + about to be)
        self.token_ids: list[int] = []  # tokens whose K/V is in the cache, in order
        self.page_keys: list[bytes] = []  # prefix keys of its full computed pages
        self.pin_tokens = 0            # full pages within this many leading tokens get pinned


class KVCachePool:
    """Allocator of ``num_pages`` KV pages of ``page_size`` tokens, with a prefix cache.

    Not thread-safe: the engine thread is its only user (read ``usage()`` from
    elsewhere only as an approximate gauge).

    Args:
        num_pages: pool size, fixed for the pool's life.
        page_size: tokens per page (must match the model's KV cache).
        enable_prefix_cache: when ``False`` no page is ever shared or kept after its
            sequence ends, and ``pin`` has no effect.
    """

    def __init__(self, num_pages: int, page_size: int = 16, enable_prefix_cache: bool = True) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.reset()

    # ----------------------------------------------------------------- lifecycle

    def reset(self) -> None:
        """Forget every sequence, every cached and pinned page, and the hit statistics."""
        # Never-used or released pages, handed out in runs per sequence (a fresh pool gives its
        # first sequence 0, 1, 2, ...).
        self._free = FreePages(self.num_pages)
        self._refcount = [0] * self.num_pages
        self._key: list[bytes | None] = [None] * self.num_pages  # prefix key of a cached page
        self._pinned = [False] * self.num_pages
        self._num_pinned = 0
        self._cached: dict[bytes, int] = {}  # prefix key -> page holding it
        # Of a cached page, for the debugger's dump: its parent's key, its depth in pages, the
        # admissions that matched it, and when it was last matched, filled or released.
        self._parent: list[bytes | None] = [None] * self.num_pages
        self._depth = [0] * self.num_pages
        #: A cached prefix's first page -> its tokens: what the debugger names an entry by, with text
        #: capture on (``prefix_tokens``); a page's worth of ints a cached prefix.
        self._first_tokens: dict[int, tuple[int, ...]] = {}
        self._hits = [0] * self.num_pages
        self._last_use = [0.0] * self.num_pages
        self._evictions = 0
        # Cached pages nobody holds and not pinned, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[SeqId, _Sequence] = {}
        self._query_tokens = 0
        self._hit_tokens = 0

    def admit(self, seq_id: SeqId, token_ids: Sequence[int], max_new_tokens: int,
              max_cached_tokens: int | None = None) -> Admission | None:
        """Register a sequence, reuse its cached prefix and reserve its first chunk.

        ``token_ids`` is everything the sequence must have in its KV cache before it
        samples: the prompt, or prompt + generated tokens when it comes back after a
        preemption. The reused prefix always leaves at least one token to compute,
        because the model needs the last token's logits. ``max_new_tokens`` (>= 1) is
        the step's token budget for this sequence; the chunk is
        ``min(len(token_ids) - cached_tokens, max_new_tokens)`` tokens.
        ``max_cached_tokens`` caps the reused prefix (None: no cap), for a sequence that
        must compute the logits of positions the cache holds (prompt logprobs); such an
        admission is left out of the hit statistics.

        Returns ``None`` and changes nothing (statistics included) when the chunk does
        not fit; otherwise counts the lookup in the hit statistics.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the KV cache; free it first")
        if not token_ids:
            raise ValueError("cannot admit a sequence with no tokens")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return self._register(seq_id, token_ids, lambda cached: min(len(token_ids) - cached, max_new_tokens),
                              max_cached_tokens)

    def reserve(self, seq_id: SeqId, token_ids: Sequence[int], end: int) -> Admission | None:
        """Register a sequence whose K/V for ``token_ids[:end]`` will arrive from another engine
        (disaggregated serving's receive side).

        Reuses the longest cached full-page prefix of ``token_ids`` (the whole prompt: the
        match may reach past ``end``) and reserves slots up to ``end`` for the rest. The
        caller writes the arriving K/V into ``pages(seq_id)`` and ``commit``s those tokens.
        Returns ``None`` (nothing changed) when the pool cannot hold the window.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the KV cache; free it first")
        if not 0 < end <= len(token_ids):
            raise ValueError(f"end must be in 1..{len(token_ids)}, got {end}")
        return self._register(seq_id, token_ids, lambda cached: max(0, end - cached))

    def rename(self, seq_id: SeqId, new_id: SeqId) -> None:
        """Hand a sequence's pages and contents to ``new_id`` (a received KV window becomes the
        sequence that generates on it)."""
        if new_id in self._seqs:
            raise ValueError(f"sequence {new_id!r} is already in the KV cache")
        self._seqs[new_id] = self._seqs.pop(seq_id)

    def try_allocate(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Reserve slots for ``num_tokens`` more tokens; ``False`` (nothing changed) if out of pages."""
        seq = self._seqs[seq_id]
        needed = self.pages_needed(seq_id, num_tokens)
        if needed > self.num_available_pages:
            return False
        self._extend(seq, needed)
        seq.num_slots += num_tokens
        return True

    def pages_needed(self, seq_id: SeqId, num_tokens: int) -> int:
        """Fresh pages ``try_allocate(seq_id, num_tokens)`` would take."""
        seq = self._seqs[seq_id]
        if num_tokens < 0:
            raise ValueError(f"num_tokens must not be negative, got {num_tokens}")
        return max(0, -(-(seq.num_slots + num_tokens) // self.page_size) - len(seq.pages))

    def commit(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """Record that the forward pass wrote the K/V of ``token_ids`` (next in order).

        Every page this fills becomes shareable through the prefix cache (and is
        pinned if it lies within the sequence's ``pin`` range).
        """
        seq = self._seqs[seq_id]
        if len(seq.token_ids) + len(token_ids) > seq.num_slots:
            raise ValueError(
                f"sequence {seq_id!r}: committing {len(token_ids)} tokens but only "
                f"{seq.num_slots - len(seq.token_ids)} slots are reserved; allocate first"
            )
        seq.token_ids.extend(int(t) for t in token_ids)
        if not self.enable_prefix_cache:
            return
        ps = self.page_size
        while (len(seq.page_keys) + 1) * ps <= len(seq.token_ids):
            i = len(seq.page_keys)
            parent = seq.page_keys[-1] if seq.page_keys else _ROOT_KEY
            key = _page_key(parent, seq.token_ids[i * ps:(i + 1) * ps])
            seq.page_keys.append(key)
            page = seq.pages[i]
            # If another sequence computed the same prefix first, that page stays the
            # cached one and ours remains private (released to the free list later).
            if key not in self._cached:
                self._cached[key] = page
                self._key[page] = key
                self._parent[page], self._depth[page] = parent, i + 1
                self._hits[page], self._last_use[page] = 0, time.perf_counter()
                if i == 0:
                    self._first_tokens[page] = tuple(seq.token_ids[:ps])
            if (i + 1) * ps <= seq.pin_tokens:
                self._pin(key, page)

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence's pages (finish, abort or preemption).

        Cached pages stay resident for later matches; the others return to the free
        list. Unknown ids are ignored, so an abort need not know whether the request
        ever got pages.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        now = time.perf_counter()
        for page in seq.pages:
            self._last_use[page] = now
        # Tail first, so a prefix's later pages are older in the LRU order than its
        # first ones: eviction then trims chains from the end, keeping the shared
        # beginnings that most matches need.
        for page in reversed(seq.pages):
            self._release(page)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix but the pinned ones (vLLM's ``reset_prefix_cache``); returns
        how many cached pages were dropped.

        Cached pages nobody holds go back to the free list; pages live sequences hold stay
        theirs, but no later admission matches them, and they are freed, not cached, when released.
        Pinned pages stay: a pin lasts until ``reset()``. The hit statistics are cumulative and
        stay too. Sequences go on committing as before: their next full pages enter the cache.
        """
        dropped = 0
        for key, page in list(self._cached.items()):
            if self._pinned[page]:
                continue
            del self._cached[key]
            self._key[page] = None
            self._first_tokens.pop(page, None)
            dropped += 1
            if self._refcount[page] == 0:
                del self._evictable[page]
                self._free.give(page)
        return dropped

    def pin(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep the full pages of the sequence's first ``num_tokens`` tokens until ``reset()``.

        For ``pinned_system_prompt``: call it right after ``admit`` with the prompt
        length. Pages already computed are pinned now, the rest as ``commit`` fills
        them. The prompt's last partial page cannot be shared, so it is not pinned.
        """
        seq = self._seqs[seq_id]
        if not self.enable_prefix_cache:
            return
        seq.pin_tokens = max(seq.pin_tokens, num_tokens)
        for i, key in enumerate(seq.page_keys[:num_tokens // self.page_size]):
            self._pin(key, seq.pages[i])

    # -------------------------------------------------------------------- queries

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens ``admit`` would take from the cache right now (no side effects)."""
        return len(self._match(token_ids)[0]) * self.page_size

    def capacity(self, token_ids: Sequence[int]) -> int:
        """Most tokens a sequence starting with ``token_ids`` can ever hold (no side effects).

        The whole pool but the pinned pages it does not share: pins stay until ``reset()``.
        """
        shared = sum(1 for page in self._match(token_ids)[0] if self._pinned[page])
        return (self.num_pages - self._num_pinned + shared) * self.page_size

    def pages(self, seq_id: SeqId) -> tuple[int, ...]:
        """The sequence's page ids in token order."""
        return tuple(self._seqs[seq_id].pages)

    def pages_held(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's page ids ([] when it holds none); safe from any thread."""
        seq = self._seqs.get(seq_id)
        return list(seq.pages) if seq is not None else []

    def num_pages_held(self, seq_id: SeqId) -> int:
        """How many pages the sequence holds (0 when none); safe from any thread."""
        seq = self._seqs.get(seq_id)
        return len(seq.pages) if seq is not None else 0

    @property
    def num_evictions(self) -> int:
        """Cached pages evicted to make room since the pool was made or reset."""
        return self._evictions

    def prefix_leaves(self) -> list[PrefixLeaf]:
        """The ends of the cached prefixes (safe from any thread: one copy of the cache's map)."""
        cached = list(self._cached.items())
        parents = {self._parent[page] for _, page in cached}
        return [PrefixLeaf(page, self._depth[page], self._hits[page], self._last_use[page], self._refcount[page],
                           self._pinned[page]) for key, page in cached if key not in parents]

    def first_page_hits(self, page: int) -> int:
        """Admissions that matched the first page of the cached prefix ending at ``page``."""
        return self._hits[self._first_page(page)]

    def prefix_tokens(self, page: int) -> tuple[int, ...] | None:
        """The first page's tokens of the cached prefix ending at ``page`` (None: not known)."""
        return self._first_tokens.get(self._first_page(page))

    def _first_page(self, page: int) -> int:
        parent = self._parent[page]
        while parent:
            above = self._cached.get(parent)
            if above is None:
                break
            page, parent = above, self._parent[above]
        return page

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        """Tokens whose K/V is in the cache (``ForwardBatch.cached_lens``)."""
        return len(self._seqs[seq_id].token_ids)

    def page_table(self, seq_ids: Sequence[SeqId], width: int | None = None) -> np.ndarray:
        """``ForwardBatch.page_table``: int32 ``[len(seq_ids), width]``, ``-1`` padded.

        ``width`` defaults to the longest page list among ``seq_ids``.
        """
        lists = [self._seqs[s].pages for s in seq_ids]
        if width is None:
            width = max((len(p) for p in lists), default=0)
        for row, pages in enumerate(lists):
            if len(pages) > width:
                raise ValueError(f"sequence {seq_ids[row]!r} has {len(pages)} pages, more than width {width}")
        # Padded as lists, then one array: one NumPy call, where filling rows of a new array was
        # one a row, each slow right after a step has flushed the caches
        # (docs/perf-log/cpu-anchors.md#2026-11-26-one-numba-call-a-step).
        return np.array([pages + [-1] * (width - len(pages)) for pages in lists], np.int32).reshape(len(lists), width)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    @property
    def num_free_pages(self) -> int:
        """Pages with no useful contents."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        """Resident cached pages nobody holds (reusable on a match, evictable)."""
        return len(self._evictable)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages held by live sequences or pinned."""
        return self.num_pages - self.num_available_pages

    @property
    def num_pinned_pages(self) -> int:
        """Pinned pages, held or not (a subset of ``num_used_pages``)."""
        return self._num_pinned

    def usage(self) -> KVCacheUsage:
        """A consistent snapshot of page counts and prefix-cache hit statistics."""
        return KVCacheUsage(
            total_pages=self.num_pages,
            used_pages=self.num_used_pages,
            cached_pages=self.num_cached_pages,
            free_pages=self.num_free_pages,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
        )

    # ------------------------------------------------------------------ internals

    def _register(self, seq_id: SeqId, token_ids: Sequence[int], chunk: Callable[[int], int],
                  max_cached_tokens: int | None = None) -> Admission | None:
        """Reuse the longest cached prefix of ``token_ids`` (at most ``max_cached_tokens``) and
        reserve ``chunk(cached_tokens)`` more slots after it; ``None`` (nothing changed, statistics
        included) if they do not fit."""
        hits, keys = self._match(token_ids)
        if max_cached_tokens is not None:
            keep = max(max_cached_tokens, 0) // self.page_size
            hits, keys = hits[:keep], keys[:keep]
        cached_tokens = len(hits) * self.page_size
        new_tokens = chunk(cached_tokens)
        needed = -(-new_tokens // self.page_size)  # the cached prefix is whole pages
        # Matched pages sitting in the evictable list stop being evictable once shared.
        reclaimed = sum(1 for p in hits if p in self._evictable)
        if needed > self.num_available_pages - reclaimed:
            return None
        seq = _Sequence()
        now = time.perf_counter()
        for page in hits:
            self._acquire(page)
            self._hits[page] += 1
            self._last_use[page] = now
        seq.pages = hits
        seq.page_keys = keys
        seq.token_ids = list(token_ids[:cached_tokens])
        seq.num_slots = cached_tokens + new_tokens
        self._extend(seq, needed)
        self._seqs[seq_id] = seq
        if max_cached_tokens is None:  # a capped admission is no lookup: it may not take what it finds
            self._query_tokens += len(token_ids)
            self._hit_tokens += cached_tokens
        return Admission(cached_tokens=cached_tokens, new_tokens=new_tokens)

    def _match(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Pages (and their keys) holding the longest cached full-page prefix of ``token_ids``."""
        if not self.enable_prefix_cache:
            return [], []
        ps = self.page_size
        pages: list[int] = []
        keys: list[bytes] = []
        parent = _ROOT_KEY
        # (len - 1) // ps: never match the whole input, one token must be computed.
        for i in range((len(token_ids) - 1) // ps):
            key = _page_key(parent, token_ids[i * ps:(i + 1) * ps])
            page = self._cached.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def _acquire(self, page: int) -> None:
        if self._refcount[page] == 0:
            self._evictable.pop(page, None)
        self._refcount[page] += 1

    def _release(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] > 0:
            return
        if self._key[page] is None:
            self._free.give(page)
        elif not self._pinned[page]:
            self._evictable[page] = None  # most recently released: evicted last

    def _extend(self, seq: _Sequence, count: int) -> None:
        """Give ``seq`` ``count`` fresh pages, each after its last where that page is free."""
        for _ in range(count):
            seq.pages.append(self._take_fresh_page(seq.pages[-1] if seq.pages else None))

    def _take_fresh_page(self, after: int | None) -> int:
        """A page with refcount 1 for new contents (a free one, ``after + 1`` preferred: see
        ``FreePages``); evicts the LRU cached page only if none is free."""
        if self._free:
            page = self._free.take(after)
        else:
            page, _ = self._evictable.popitem(last=False)
            key = self._key[page]
            assert key is not None, "an evictable page is a cached one"
            del self._cached[key]
            self._key[page] = None
            self._parent[page] = None
            self._first_tokens.pop(page, None)
            self._evictions += 1
        self._refcount[page] = 1
        return page

    def _pin(self, key: bytes, own_page: int) -> None:
        """Pin the page the cache maps ``key`` to, caching ``own_page`` under it if none.

        When the sequence computed a private duplicate of an already cached page, the
        cached one is what later requests match, so that is the one to keep.
        """
        page = self._cached.get(key)
        if page is None:
            page = own_page
            self._cached[key] = page
            self._key[page] = key
        if not self._pinned[page]:
            self._pinned[page] = True
            self._num_pinned += 1
            self._evictable.pop(page, None)

"""The free pages of a KV page pool, handed out so that each sequence's pages lie in runs.

Attention reads a sequence's pages in order, several side by side; on the CPU the hardware
prefetcher streams a page only as far as the memory it lies in continues. A pool that hands out
its free pages first come, first served gives a batch that grows in step pages interleaved
between its sequences (each step, every sequence takes the next free page), and a batch's
attention then reads short runs, slower than over pages contiguous per sequence
(docs/perf-log/cpu-anchors.md#2026-11-26-engine-pages). So a sequence's next
page is, in order of preference:

1. the page right after its last one, when that page is free;
2. the first page of a wholly free *extent* (``run`` aligned pages), whose other pages are then
   left for it to grow into, since the other sequences prefer extents of their own;
3. the free page released last (still warm in the caches);

nothing is reserved: when no extent is wholly free, any free page serves any sequence, so runs
cost no capacity. Taking and releasing a page are O(1) amortised.
"""
from __future__ import annotations

__all__ = ["FreePages"]


class FreePages:
    """The free page ids of a pool of ``num_pages``, handed out in runs of up to ``run`` pages
    (see the module's docstring). All pages start free."""

    def __init__(self, num_pages: int, run: int = 16) -> None:
        if num_pages < 1 or run < 1:
            raise ValueError(f"need num_pages >= 1 and run >= 1, got {num_pages} and {run}")
        self.num_pages = num_pages
        self.run = run
        self._is_free = [True] * num_pages
        self._count = num_pages
        # Released pages, last on top. Taking a page another way leaves its entry here; entries
        # of pages no longer free are skipped when popped (and dropped when the stack is rebuilt).
        self._stack: list[int] = list(range(num_pages - 1, -1, -1))
        num_extents = -(-num_pages // run)
        self._extent_free = [self._extent_size(e) for e in range(num_extents)]
        # Extents that were wholly free when pushed (checked again when popped), first extent on
        # top; each at most once (``_listed``), though one taken from by ``after + 1`` stays listed.
        self._whole: list[int] = list(range(num_extents - 1, -1, -1))
        self._listed = [True] * num_extents

    def __len__(self) -> int:
        return self._count

    def __contains__(self, page: int) -> bool:
        return 0 <= page < self.num_pages and self._is_free[page]

    def take(self, after: int | None = None) -> int:
        """A free page, now taken: ``after + 1`` if free, else the start of a wholly free extent,
        else the page released last. ``after`` is the sequence's last page (None: it has none).
        Raises ``IndexError`` when no page is free."""
        if not self._count:
            raise IndexError("no free page")
        page = -1
        if after is not None and after + 1 in self:
            page = after + 1
        while page < 0 and self._whole:
            extent = self._whole.pop()
            self._listed[extent] = False
            if self._extent_free[extent] == self._extent_size(extent):
                page = extent * self.run
        while page < 0:
            candidate = self._stack.pop()
            if self._is_free[candidate]:
                page = candidate
        self._is_free[page] = False
        self._count -= 1
        self._extent_free[page // self.run] -= 1
        return page

    def give(self, page: int) -> None:
        """Return ``page`` (taken before) to the free pages."""
        if not 0 <= page < self.num_pages or self._is_free[page]:
            raise ValueError(f"page {page} is not a taken page of this pool")
        self._is_free[page] = True
        self._count += 1
        extent = page // self.run
        self._extent_free[extent] += 1
        if self._extent_free[extent] == self._extent_size(extent) and not self._listed[extent]:
            self._whole.append(extent)
            self._listed[extent] = True
        if len(self._stack) >= 2 * self.num_pages:
            self._compact_stack()
        self._stack.append(page)

    def _compact_stack(self) -> None:
        """Drop the stack's stale entries and repeats (a page released, taken from its extent
        and released again is on it twice), keeping each free page's topmost entry in order."""
        seen: set[int] = set()
        live: list[int] = []
        for page in reversed(self._stack):
            if self._is_free[page] and page not in seen:
                seen.add(page)
                live.append(page)
        live.reverse()
        self._stack = live

    def _extent_size(self, extent: int) -> int:
        return min(self.run, self.num_pages - extent * self.run)

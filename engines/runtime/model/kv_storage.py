"""K/V storage of the paged KV cache (the page *ids* are managed by ``kv_cache.KVCachePool``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engines.runtime.model.config import ModelConfig

if TYPE_CHECKING:
    from engines.runtime.model.backend import Array, Backend

__all__ = ["PagedKVCache"]


@dataclass
class PagedKVCache:
    """Keys and values of every layer in fixed-size pages, on the model's backend.

    ``k`` and ``v`` are ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]`` in the
    model's storage dtype: token ``p`` of a sequence lives in page ``page_table[p // page_size]``,
    slot ``p % page_size``, and within a page one head's keys are contiguous, which is the
    order attention reads them in.
    """

    k: "Array"
    v: "Array"
    num_layers: int
    num_pages: int
    page_size: int
    dtype: str
    backend_name: str

    @classmethod
    def allocate(cls, backend: "Backend", config: ModelConfig, num_pages: int, page_size: int,
                 dtype: str) -> "PagedKVCache":
        """Uninitialised storage: a slot is always written (by the step that appends its
        token) before any attention reads it."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        shape = (config.num_hidden_layers, num_pages, config.num_key_value_heads, page_size, config.head_dim)
        return cls(
            k=backend.empty(shape, np.dtype(dtype)),
            v=backend.empty(shape, np.dtype(dtype)),
            num_layers=config.num_hidden_layers,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            backend_name=backend.name,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage together."""
        return 2 * int(np.prod(self.k.shape)) * np.dtype(self.dtype).itemsize

    # ------------------------------------------------------------- token windows (disaggregation)

    def read_tokens(self, pages: tuple[int, ...], begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the K and V of positions ``[begin:end]`` of a sequence holding ``pages``,
        each ``[num_layers, num_kv_heads, end - begin, head_dim]``."""
        page_ids, slots, used = self._window(pages, begin, end)
        out = []
        for store in (self.k, self.v):
            if isinstance(store, np.ndarray):  # one gather (advanced indices first: [n, L, H, D])
                window = store[:, used[page_ids], :, slots, :]
            else:
                window = _host_pages(store, used)[:, page_ids, :, slots, :]
            out.append(np.ascontiguousarray(window.transpose(1, 2, 0, 3)))
        return out[0], out[1]

    def write_tokens(self, pages: tuple[int, ...], begin: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k`` and ``v`` (``[num_layers, num_kv_heads, n, head_dim]``) as positions
        ``[begin:begin + n]`` of a sequence holding ``pages``."""
        end = begin + k.shape[2]
        page_ids, slots, used = self._window(pages, begin, end)
        for store, src in ((self.k, k), (self.v, v)):
            tokens_first = src.astype(self.dtype, copy=False).transpose(2, 0, 1, 3)
            if isinstance(store, np.ndarray):  # one scatter
                store[:, used[page_ids], :, slots, :] = tokens_first
                continue
            # A device array: the touched pages round-trip through the host (a partly written page
            # keeps its other slots), one contiguous [heads, page_size, head_dim] copy per layer and page.
            host = _host_pages(store, used)
            host[:, page_ids, :, slots, :] = tokens_first
            for layer in range(self.num_layers):
                for j, page in enumerate(used):
                    store[layer, int(page)].copy_to_device(np.ascontiguousarray(host[layer, j]))

    def _window(self, pages: tuple[int, ...], begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For positions ``[begin:end]``: each one's index into ``used`` (the distinct pages the
        window touches, in order) and its slot."""
        if not 0 <= begin <= end <= len(pages) * self.page_size:
            raise ValueError(f"positions [{begin}:{end}] are outside {len(pages)} pages of {self.page_size}")
        positions = np.arange(begin, end)
        first = begin // self.page_size
        used = np.asarray(pages[first:-(-end // self.page_size)], dtype=np.int64)
        return positions // self.page_size - first, positions % self.page_size, used


def _host_pages(store: "Array", pages: np.ndarray) -> np.ndarray:
    """``store[:, pages]`` of a device array on the host, ``[num_layers, len(pages), heads,
    page_size, head_dim]``."""
    out = np.empty((store.shape[0], len(pages), *store.shape[2:]), dtype=np.dtype(store.dtype))
    for layer in range(store.shape[0]):
        for j, page in enumerate(pages):
            out[layer, j] = store[layer, int(page)].copy_to_host()
    return out

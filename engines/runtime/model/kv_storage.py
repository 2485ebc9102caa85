"""K/V storage of the paged KV cache (the page *ids* are managed by ``kv_cache.KVCachePool``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engines.runtime.model.config import ModelConfig
from engines.runtime.model.kernels.kv_window import (
    kv_window_gather_cpu,
    kv_window_gather_cuda,
    kv_window_scatter_cpu,
    kv_window_scatter_cuda,
    launch_shape,
)

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

    def read_tokens(self, pages: tuple[int, ...], begin: int, end: int,
                    on_device: bool = False) -> tuple["Array", "Array"]:
        """The K and V of positions ``[begin:end]`` of a sequence holding ``pages``, each
        ``[num_layers, num_kv_heads, end - begin, head_dim]`` in the storage dtype: host arrays,
        or with ``on_device`` (a CUDA cache) device arrays, for an engine on the same GPU."""
        token_pages, token_slots = self._token_index(pages, begin, end)
        shape = (self.num_layers, self.k.shape[2], end - begin, self.k.shape[4])
        if isinstance(self.k, np.ndarray):
            host = [np.empty(shape, self.k.dtype), np.empty(shape, self.v.dtype)]
            for store, window in zip((self.k, self.v), host, strict=True):
                kv_window_gather_cpu(store, token_pages, token_slots, window)
            return host[0], host[1]
        from numba import cuda

        out = [cuda.device_array(shape, dtype=np.dtype(self.dtype)) for _ in range(2)]
        if end > begin:
            index = cuda.to_device(token_pages), cuda.to_device(token_slots)
            grid, block = launch_shape(*shape)
            for store, window in zip((self.k, self.v), out, strict=True):
                kv_window_gather_cuda[grid, block](store, *index, window)
        if on_device:
            return out[0], out[1]
        return out[0].copy_to_host(), out[1].copy_to_host()

    def write_tokens(self, pages: tuple[int, ...], begin: int, k: "Array", v: "Array") -> None:
        """Store ``k`` and ``v`` (``[num_layers, num_kv_heads, n, head_dim]``: host arrays, or on a
        CUDA cache device arrays too) as positions ``[begin:begin + n]`` of a sequence holding
        ``pages``; the other slots of a partly written page are kept."""
        token_pages, token_slots = self._token_index(pages, begin, begin + k.shape[2])
        if isinstance(self.k, np.ndarray):
            for store, src in ((self.k, k), (self.v, v)):
                kv_window_scatter_cpu(src.astype(store.dtype, copy=False), token_pages, token_slots, store)
            return
        if k.shape[2] == 0:
            return
        from numba import cuda

        index = cuda.to_device(token_pages), cuda.to_device(token_slots)
        grid, block = launch_shape(*k.shape)
        for store, src in ((self.k, k), (self.v, v)):
            if isinstance(src, np.ndarray):  # from the host (another server): one contiguous copy
                src = cuda.to_device(np.ascontiguousarray(src, dtype=np.dtype(self.dtype)))
            kv_window_scatter_cuda[grid, block](src, *index, store)

    def _token_index(self, pages: tuple[int, ...], begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Each position of ``[begin:end]``'s page and slot, for a sequence holding ``pages``."""
        if not 0 <= begin <= end <= len(pages) * self.page_size:
            raise ValueError(f"positions [{begin}:{end}] are outside {len(pages)} pages of {self.page_size}")
        positions = np.arange(begin, end)
        return (np.asarray(pages, dtype=np.int32)[positions // self.page_size],
                (positions % self.page_size).astype(np.int32))

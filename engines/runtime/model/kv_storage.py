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

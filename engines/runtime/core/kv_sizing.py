"""How large an engine's KV cache is: what the user asked for, or a size that fits the model.

A KV page holds ``page_size`` tokens of every layer's keys and values. The user may fix the pool
by pages (``--num-pages``), tokens (``--max-total-tokens``) or bytes (``--kv-cache-bytes``); left
unset, it is sized for the model (:func:`resolve_kv_cache_size`): **as many bytes as the weights
take**, so a 135M-parameter model gets a pool of about half a gigabyte where a fixed 65,536
tokens would have taken 2.8 GiB, and a 7B model several gigabytes; never less than one full context
(a request as long as the model allows must fit), never more than every sequence slot filled to
the model's context (more could never be used), and never more than a quarter of the memory that
is free when the engine starts (the machine keeps room for everything else). The token count
does not depend on the dtype: halving the weights' bytes halves each token's.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVCacheSize", "resolve_kv_cache_size"]

#: The share of free memory the automatic size may take at most.
AUTO_MEMORY_SHARE = 4


@dataclass(frozen=True)
class KVCacheSize:
    """A resolved KV pool: its pages, their size, its bytes, and which rule chose it."""

    num_pages: int
    page_size: int
    bytes: int   # keys and values of every layer
    rule: str    # "num_pages", "max_total_tokens", "kv_cache_bytes" or "auto"
    reason: str  # in words, for the dashboard and /stats

    @property
    def tokens(self) -> int:
        """Tokens the pool holds."""
        return self.num_pages * self.page_size

    def describe(self) -> str:
        """In words: tokens, pages, bytes and why this size."""
        return (f"{self.tokens:,} tokens ({self.num_pages:,} pages of {self.page_size}), "
                f"{self.bytes / 2**20:,.0f} MiB; {self.reason}")

    def as_dict(self) -> dict[str, int | str]:
        """For JSON replies (``/stats``)."""
        return {"num_pages": self.num_pages, "page_size": self.page_size, "tokens": self.tokens,
                "bytes": self.bytes, "rule": self.rule, "reason": self.reason}


def resolve_kv_cache_size(*, page_size: int, bytes_per_token: int, num_pages: int | None = None,
                          max_total_tokens: int | None = None, kv_cache_bytes: int | None = None,
                          weight_bytes: int, context_length: int, max_num_seqs: int,
                          free_memory_bytes: int | None) -> KVCacheSize:
    """The pool the engine allocates: at most one of ``num_pages``, ``max_total_tokens`` and
    ``kv_cache_bytes`` may be given; with none, the size fits the model (the module's rule).

    Raises ``ValueError`` for two of them at once, or for a size below one page.
    """
    given = {k: v for k, v in (("num_pages", num_pages), ("max_total_tokens", max_total_tokens),
                                ("kv_cache_bytes", kv_cache_bytes)) if v is not None}
    if len(given) > 1:
        raise ValueError(f"size the KV cache one way, not by {' and '.join(given)} at once")
    if page_size < 1 or bytes_per_token < 1:
        raise ValueError(f"need page_size >= 1 and bytes_per_token >= 1, got {page_size} and {bytes_per_token}")
    page_bytes = page_size * bytes_per_token
    if num_pages is not None:
        pages, rule, reason = num_pages, "num_pages", f"--num-pages {num_pages}"
    elif max_total_tokens is not None:
        pages, rule, reason = -(-max_total_tokens // page_size), "max_total_tokens", \
            f"--max-total-tokens {max_total_tokens}"
    elif kv_cache_bytes is not None:
        pages, rule, reason = kv_cache_bytes // page_bytes, "kv_cache_bytes", f"--kv-cache-bytes {kv_cache_bytes}"
    else:
        pages, reason = _auto_pages(page_size, page_bytes, weight_bytes, context_length, max_num_seqs,
                                    free_memory_bytes)
        rule = "auto"
    if pages < 1:
        raise ValueError(f"the KV cache must hold at least one page ({page_bytes} bytes, {page_size} tokens); "
                         f"{reason} gives none")
    return KVCacheSize(pages, page_size, pages * page_bytes, rule, reason)


def _auto_pages(page_size: int, page_bytes: int, weight_bytes: int, context_length: int, max_num_seqs: int,
                free_memory_bytes: int | None) -> tuple[int, str]:
    context_pages = -(-context_length // page_size)
    pages = max(weight_bytes // page_bytes, context_pages)
    reason = ("auto: as large as the weights" if pages > context_pages
              else f"auto: one full context of {context_length} tokens (more than the weights' size)")
    ceiling = max_num_seqs * context_pages
    if pages > ceiling:
        pages, reason = ceiling, f"auto: every one of the {max_num_seqs} sequence slots at full context"
    if free_memory_bytes is not None and pages * page_bytes > free_memory_bytes // AUTO_MEMORY_SHARE:
        pages = max(1, free_memory_bytes // AUTO_MEMORY_SHARE // page_bytes)
        reason = f"auto: a {AUTO_MEMORY_SHARE}th of the {free_memory_bytes / 2**30:.1f} GiB free at start"
    return pages, reason

"""The KV pool's size: what the user asked for, one way only, or sized for the model."""
from __future__ import annotations

import pytest

from engines.runtime.core.kv_sizing import resolve_kv_cache_size

SMOLLM2 = dict(page_size=16, bytes_per_token=2 * 30 * 3 * 64 * 4, weight_bytes=134_515_008 * 4,
               context_length=8192, max_num_seqs=64, free_memory_bytes=20 << 30)


def test_the_user_may_size_it_by_pages_tokens_or_bytes() -> None:
    per_page = 16 * SMOLLM2["bytes_per_token"]
    assert resolve_kv_cache_size(**SMOLLM2, num_pages=10).num_pages == 10
    by_tokens = resolve_kv_cache_size(**SMOLLM2, max_total_tokens=1000)
    assert (by_tokens.num_pages, by_tokens.tokens, by_tokens.rule) == (63, 1008, "max_total_tokens")
    by_bytes = resolve_kv_cache_size(**SMOLLM2, kv_cache_bytes=100 * per_page + 5)
    assert (by_bytes.num_pages, by_bytes.bytes, by_bytes.rule) == (100, 100 * per_page, "kv_cache_bytes")


def test_one_way_only_and_at_least_a_page() -> None:
    with pytest.raises(ValueError, match="not by num_pages and kv_cache_bytes"):
        resolve_kv_cache_size(**SMOLLM2, num_pages=4, kv_cache_bytes=1 << 30)
    with pytest.raises(ValueError, match="at least one page"):
        resolve_kv_cache_size(**SMOLLM2, kv_cache_bytes=1000)


def test_by_default_it_takes_as_many_bytes_as_the_weights() -> None:
    size = resolve_kv_cache_size(**SMOLLM2)
    assert size.rule == "auto" and "as large as the weights" in size.reason
    per_page = 16 * SMOLLM2["bytes_per_token"]
    assert size.num_pages == SMOLLM2["weight_bytes"] // per_page
    assert 8192 <= size.tokens < 65536 and size.bytes < 600 << 20  # not the 2.8 GiB of a fixed 65,536 tokens
    # float16 halves the weights and each token: the same tokens.
    half = resolve_kv_cache_size(**{**SMOLLM2, "bytes_per_token": SMOLLM2["bytes_per_token"] // 2,
                                    "weight_bytes": SMOLLM2["weight_bytes"] // 2})
    assert half.tokens == size.tokens


def test_the_default_holds_one_full_context_and_no_more_than_the_slots_can_use() -> None:
    tiny_weights = resolve_kv_cache_size(**{**SMOLLM2, "weight_bytes": 1 << 20})
    assert tiny_weights.tokens == 8192 and "one full context" in tiny_weights.reason
    one_slot = resolve_kv_cache_size(**{**SMOLLM2, "max_num_seqs": 1, "context_length": 512})
    assert one_slot.tokens == 512 and "sequence slots" in one_slot.reason


def test_the_default_leaves_three_quarters_of_the_free_memory() -> None:
    size = resolve_kv_cache_size(**{**SMOLLM2, "free_memory_bytes": 400 << 20})
    assert size.bytes <= 100 << 20 and "free at start" in size.reason
    unknown = resolve_kv_cache_size(**{**SMOLLM2, "free_memory_bytes": None})
    assert unknown.num_pages == resolve_kv_cache_size(**SMOLLM2).num_pages


def test_it_describes_itself() -> None:
    size = resolve_kv_cache_size(**SMOLLM2, num_pages=1000)
    assert size.describe() == "16,000 tokens (1,000 pages of 16), 703 MiB; --num-pages 1000"
    assert size.as_dict()["tokens"] == 16000

"""The compiled step metadata (``step_inputs``) against its NumPy reference: the same arrays for
valid batches, the same refusal of invalid ones."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from engines.runtime.model import step_inputs as si
from engines.runtime.model.forward_batch import ForwardBatch

CONFIG = SimpleNamespace(vocab_size=100, max_position_embeddings=512)
KV = SimpleNamespace(page_size=16, num_pages=64)


def random_batch(rng: np.random.Generator, all_logits: bool = False) -> ForwardBatch:
    """A valid ragged batch: 1-6 sequences, prefill chunks and decode tokens mixed, pages shuffled,
    a page table wider or narrower than the power of two the step uses."""
    num_seqs = int(rng.integers(1, 7))
    lens = rng.integers(1, 40, num_seqs) * (rng.random(num_seqs) < 0.6) + 1
    cached = rng.integers(0, 200, num_seqs)
    pages = (cached + lens - 1) // KV.page_size + 1
    width = int(pages.max()) + int(rng.integers(0, 5))
    table = np.full((num_seqs, width), -1, np.int32)
    free = rng.permutation(KV.num_pages)
    for s in range(num_seqs):
        table[s, :pages[s]] = free[:pages[s]]
        free = free[pages[s]:] if len(free) > pages[s] + pages.max() else rng.permutation(KV.num_pages)
    return ForwardBatch(token_ids=rng.integers(0, CONFIG.vocab_size, int(lens.sum())).astype(np.int32),
                        query_starts=np.concatenate(([0], np.cumsum(lens))).astype(np.int32),
                        cached_lens=cached.astype(np.int32), page_table=table, all_logits=all_logits)


def assert_same(a, b) -> None:
    for name in ("token_ids", "positions", "token_seq", "page_table", "rows", "logit_rows"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == np.int32, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("seed", range(40))
def test_compiled_step_inputs_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, all_logits=bool(seed % 3 == 0))
    rows = si.IdentityRows()
    fast = si.step_inputs(batch, KV, CONFIG, rows)
    assert_same(fast, si.step_inputs_reference(batch, KV, CONFIG, rows))
    # The width is the smallest power of two that holds the longest sequence's pages.
    pages = int(((batch.cached_lens + np.diff(batch.query_starts) - 1) // KV.page_size + 1).max())
    assert fast.page_table.shape[1] == 1 << (pages - 1).bit_length()


@pytest.mark.parametrize("seed", range(12))
def test_seq_all_logits_returns_every_row_of_the_flagged_sequences(seed: int) -> None:
    """Both forms: every row of a flagged sequence and the last row of the others, in token order."""
    rng = np.random.default_rng(100 + seed)
    batch = random_batch(rng)
    flags = rng.random(batch.cached_lens.shape[0]) < 0.5
    flagged = replace(batch, seq_all_logits=flags)
    starts = batch.query_starts
    want = [t for s, flag in enumerate(flags) for t in range(starts[s] if flag else starts[s + 1] - 1, starts[s + 1])]
    rows = si.IdentityRows()
    fast = si.step_inputs(flagged, KV, CONFIG, rows)
    assert_same(fast, si.step_inputs_reference(flagged, KV, CONFIG, rows))
    assert fast.logit_rows.tolist() == want
    # all_logits wins; no flag at all is each sequence's last row.
    assert si.step_inputs(replace(flagged, all_logits=True), KV, CONFIG, rows).logit_rows.tolist() == \
        list(range(starts[-1]))
    none = replace(batch, seq_all_logits=np.zeros_like(flags))
    assert si.step_inputs(none, KV, CONFIG, rows).logit_rows.tolist() == (starts[1:] - 1).tolist()


def test_seq_all_logits_of_the_wrong_length_is_refused() -> None:
    batch = random_batch(np.random.default_rng(3))
    flags = np.ones(batch.cached_lens.shape[0] + 1, np.bool_)
    for form in (si.step_inputs, si.step_inputs_reference):
        with pytest.raises(ValueError, match="one flag per sequence"):
            form(replace(batch, seq_all_logits=flags), KV, CONFIG, si.IdentityRows())


def test_the_compiled_form_runs_for_int32_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken (the reference is not called) for the engine's int32 arrays, and
    other dtypes go to the reference with the same result."""
    batch = random_batch(np.random.default_rng(7))
    calls = []
    reference = si.step_inputs_reference
    monkeypatch.setattr(si, "step_inputs_reference", lambda *a: calls.append(a) or reference(*a))
    fast = si.step_inputs(batch, KV, CONFIG, si.IdentityRows())
    assert calls == []
    wide = replace(batch, query_starts=batch.query_starts.astype(np.int64), cached_lens=list(batch.cached_lens))
    assert_same(si.step_inputs(wide, KV, CONFIG, si.IdentityRows()), fast)
    assert len(calls) == 1


def _invalid_batches() -> dict[str, ForwardBatch]:
    def batch(**change) -> ForwardBatch:
        base = ForwardBatch(token_ids=np.array([5, 6, 7, 8], np.int32), query_starts=np.array([0, 3, 4], np.int32),
                            cached_lens=np.array([0, 20], np.int32),
                            page_table=np.array([[0, -1], [1, 2]], np.int32))
        return replace(base, **{k: np.asarray(v, np.int32) for k, v in change.items()})

    return {
        "no sequences": batch(query_starts=[0], cached_lens=np.zeros(0), page_table=np.zeros((0, 2))),
        "starts not from 0": batch(query_starts=[1, 3, 4]),
        "starts short of the tokens": batch(query_starts=[0, 3, 3]),
        "a sequence with no token": batch(query_starts=[0, 0, 4]),
        "starts past the tokens": batch(query_starts=[0, 5, 4]),
        "negative cached": batch(cached_lens=[0, -1]),
        "cached of another length": batch(cached_lens=[0, 20, 3]),
        "table of other rows": batch(page_table=[[0, 1]]),
        "negative token": batch(token_ids=[5, -6, 7, 8]),
        "token past the vocab": batch(token_ids=[5, 6, 7, 100]),
        "position past the model's": batch(cached_lens=[0, 512]),
        "table too narrow": batch(cached_lens=[0, 40]),
        "negative page where a token lives": batch(page_table=[[0, -1], [1, -1]]),
        "page past the cache": batch(page_table=[[64, -1], [1, 2]]),
    }


@pytest.mark.parametrize("case", list(_invalid_batches()))
def test_both_forms_refuse_the_same_invalid_batches(case: str) -> None:
    batch = _invalid_batches()[case]
    with pytest.raises(ValueError):
        si.step_inputs_reference(batch, KV, CONFIG, si.IdentityRows())
    ok = si.derive_int32(batch.token_ids, batch.query_starts, batch.cached_lens, batch.page_table, CONFIG.vocab_size,
                          CONFIG.max_position_embeddings, KV.page_size, KV.num_pages)[0]
    assert not ok  # the compiled pass refuses it too (step_inputs then raises the reference's error)


def test_a_valid_batch_with_unused_negative_table_entries_passes() -> None:
    """Entries past a sequence's last page are padding: neither form reads them."""
    batch = ForwardBatch(token_ids=np.array([3], np.int32), query_starts=np.array([0, 1], np.int32),
                         cached_lens=np.array([15], np.int32), page_table=np.array([[9, -1, -1]], np.int32))
    fast = si.step_inputs(batch, KV, CONFIG, si.IdentityRows())
    np.testing.assert_array_equal(fast.page_table, [[9]])
    np.testing.assert_array_equal(fast.positions, [15])

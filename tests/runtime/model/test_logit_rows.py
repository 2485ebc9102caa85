"""The last layer for the logit rows alone (``LlamaModel._launch`` with the CPU backend's
``compacts_last_layer``) against every row running every layer: the same logits, greedy ids and
KV cache, transformers' logits, and the last layer's projections on as many rows as return logits.
The float32 path (test_model_parity's Hugging Face folders)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.runtime.model.test_model_parity import PAGE_SIZE, PagedSequences, Reference, reference  # noqa: F401


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 90, length).tolist()


# Prefill chunks long and short (the BLAS and the scalar attention), beside decodes; each step
# more tokens than sequences, past the compiled step's 32 (it runs every row: steps that small
# gain little).
STEPS = [
    [prompt(60, 1), prompt(3, 2), prompt(40, 3)],
    [prompt(50, 4), [7], [9]],
    [[11], prompt(35, 5), [13]],
]


def run(model: Any, compact: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[np.ndarray], Any]:
    """Every step of ``STEPS`` as logits, then as greedy ids, on a fresh cache; and the cache."""
    monkeypatch.setattr(model.backend, "compacts_last_layer", compact)
    seqs = PagedSequences([[], [], []], 64, seed=3)
    kv = model.new_kv_cache(64, PAGE_SIZE)
    kv.k[...] = 0  # allocated uninitialised: slots no step writes must compare equal too
    kv.v[...] = 0
    results = []
    for new in STEPS:
        results.append(model.forward(seqs.batch(new), kv))
        results.append(model.forward_greedy(seqs.batch(new), kv))  # the same step again: same slots
        seqs.advance(new)
    return results, kv


def test_logit_rows_alone_give_what_every_row_gives(reference: Reference,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = reference.ours
    every_row, every_kv = run(model, False, monkeypatch)
    compact, compact_kv = run(model, True, monkeypatch)
    for i, (want, got) in enumerate(zip(every_row, compact, strict=True)):
        assert want.shape == got.shape and want.dtype == got.dtype
        if got.dtype == np.int32:
            np.testing.assert_array_equal(got, want, err_msg=f"greedy, step {i // 2}")
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"logits, step {i // 2}")
    # Every row's keys and values are still written, by the same calls.
    np.testing.assert_array_equal(compact_kv.k, every_kv.k)
    np.testing.assert_array_equal(compact_kv.v, every_kv.v)
    # And against transformers: each sequence's context after the first step.
    for i, chunk in enumerate(STEPS[0]):
        np.testing.assert_allclose(compact[0][i], reference.hf_logits(chunk)[-1], rtol=1e-4, atol=1e-4)


def test_the_last_layer_projects_only_the_logit_rows(reference: Reference,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = reference.ours
    rows_by_weight: dict[int, list[int]] = {}
    matmul = model.backend.matmul

    def counted(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
        rows_by_weight.setdefault(id(weight), []).append(x.shape[0])
        matmul(x, weight, bias, out)

    monkeypatch.setattr(model.backend, "matmul", counted)
    last = model.layers[-1]
    seqs = PagedSequences([[], [], []], 64, seed=3)
    kv = model.new_kv_cache(64, PAGE_SIZE)
    model.forward(seqs.batch(STEPS[0]), kv)
    tokens = sum(len(c) for c in STEPS[0])
    assert rows_by_weight[id(last.attention.qkv_w)] == [tokens]  # keys and values of every row
    for weight in (last.attention.o_w, last.mlp.gate_up_w, last.mlp.down_w, model.lm_head_w):
        assert rows_by_weight[id(weight)] == [3]
    for weight in (model.layers[0].attention.o_w, model.layers[0].mlp.down_w):
        assert rows_by_weight[id(weight)] == [tokens]

    rows_by_weight.clear()  # all_logits: every row returns logits, every row runs every layer
    model.forward(seqs.batch(STEPS[0], all_logits=True), kv)
    assert rows_by_weight[id(last.mlp.down_w)] == [tokens]

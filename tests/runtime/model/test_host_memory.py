"""host_memory: arrays that start on a page (a cache line when small), and a CPU model whose weights,
KV cache and activation buffers all do."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.host_memory import LINE_BYTES, PAGE_BYTES, aligned_copy, aligned_empty, alignment_of
from engines.runtime.model.llama import LlamaModel
from tests.runtime.model.test_model_parity import save_tiny_checkpoint


def starts_on(array: np.ndarray, boundary: int) -> bool:
    return array.ctypes.data % boundary == 0


@pytest.mark.parametrize("shape, dtype", [((0,), np.float32), (3, np.float32), ((1000,), np.float32),
                                          ((1024,), np.float32), ((2, 64, 512), np.float32), ((7, 5), np.int32),
                                          ((3, 4096), np.float16)])
def test_aligned_empty_is_a_writable_c_array_on_its_boundary(shape, dtype) -> None:
    # Several in a row: a plain np.empty of the large ones starts 16 bytes past a page here.
    arrays = [aligned_empty(shape, dtype) for _ in range(4)]
    expected_shape = (shape,) if isinstance(shape, int) else shape
    for array in arrays:
        assert array.shape == expected_shape and array.dtype == np.dtype(dtype)
        assert array.flags.c_contiguous and array.flags.writeable
        assert starts_on(array, alignment_of(array.nbytes)) or array.nbytes == 0  # nothing to align
        array[...] = 1  # the whole extent is ours to write
    assert alignment_of(4095) == LINE_BYTES and alignment_of(4096) == PAGE_BYTES


def test_aligned_copy_keeps_values_and_converts_dtype() -> None:
    source = np.arange(6 * 700, dtype=np.float64).reshape(6, 700).T  # not C-contiguous
    copy = aligned_copy(source, np.float32)
    assert copy.dtype == np.float32 and copy.flags.c_contiguous and starts_on(copy, PAGE_BYTES)
    np.testing.assert_array_equal(copy, source.astype(np.float32))
    source[0, 0] = -1.0
    assert copy[0, 0] == 0.0  # a copy, not a view


def test_a_cpu_models_weights_kv_cache_and_activations_start_on_a_page(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab=64, hidden=64, layers=2, tied=False, seed=1)
    model = LlamaModel.from_checkpoint(load_checkpoint(path), backend="cpu")
    arrays = {"embed_tokens": model.embed_tokens, "lm_head_w": model.lm_head_w, "norm": model.norm,
              **{f.name: getattr(model.layer_weights, f.name) for f in fields(model.layer_weights)}}
    kv = model.new_kv_cache(8, 4)
    arrays.update(k=kv.k, v=kv.v)
    act = model.workspace.activations(4, 2)
    arrays.update({f.name: getattr(act, f.name) for f in fields(act) if isinstance(getattr(act, f.name), np.ndarray)})
    for name, array in arrays.items():
        assert starts_on(array, LINE_BYTES) or array.nbytes == 0, name
    for name in ("qkv_w", "gate_up_w", "down_w", "o_w", "embed_tokens", "lm_head_w", "k", "v"):
        assert starts_on(arrays[name], PAGE_BYTES), name

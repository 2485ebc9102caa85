"""The op table (``model/kernels/ops.py``): each op's cost, from its kernel module's napkin math."""
from __future__ import annotations

import numpy as np

from engines.runtime.model.kernels.ops import kernel_cost


def test_kernel_costs_follow_the_arithmetic() -> None:
    x, w, b, out = np.zeros((3, 8), np.float32), np.zeros((16, 8), np.float16), None, np.zeros((3, 16), np.float32)
    assert kernel_cost("matmul", (x, w, b, out)) == ("matmul 8x16", 16 * 8 * 2 + 3 * 8 * 4 + 3 * 16 * 4,
                                                     2 * 3 * 8 * 16)
    # Attention over a 5-token prefill (positions 0-4) and one decode at position 9: keys and
    # values of 5 + 10 positions read once; 15 + 10 (query, position) pairs.
    qkv, cache, att = np.zeros((6, 16), np.float32), np.zeros((2, 4, 2, 4, 4), np.float16), np.zeros((6, 8), np.float32)
    name, nbytes, flops = kernel_cost("attention", (qkv, None, cache, cache, 0, 2, 1.0, att), 15, 25)
    assert name == "attention" and flops == 4 * 25 * 2 * 4
    assert nbytes == 2 * 15 * 2 * 4 * 2 + qkv.nbytes + att.nbytes

"""The compiled CPU step's ops on a weight in either of its storages: a float array, or a quantized
weight in the interleaved layout as the tuple :func:`step_form` makes.

``cpu_step`` is written once for both: where it multiplies by a weight or gathers an embedding row
it calls :func:`rows_matmul` or :func:`gather`, which numba resolves by the weight's type when it
compiles the step (``numba.extending.overload``), so a model of float weights and one of quantized
weights each get a step of their own, compiled from the same source. A model's layers of quantized
weights are a ``numba.typed.List`` of such tuples (the float ones one ``[layers, ...]`` array): the
layers of a GGUF file may differ in type (Q4_K_M keeps some layers' V and down projections in
Q6_K, which the loader converts to Q8_0), hence in their arrays' shapes.

The tuple's quants are a uint8 view (Q8_0's are int8): one list type for every kind; the group
dots read the bytes, the plain loops reinterpret Q8_0's (``interleaved_dot``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numba import njit, typeof, types
from numba.extending import overload
from numba.typed import List

from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.quant.interleaved_weight import InterleavedWeight
from engines.runtime.model.kernels import embedding, interleaved_dot, matmul, silu_mul

__all__ = ["StepWeight", "fuses_swiglu", "gather", "rows_matmul", "step_form", "step_layers", "swiglu_matmul"]

#: A weight as the compiled step takes it: a float array, or ``(quants as uint8, scales, minima,
#: half table)`` of an :class:`InterleavedWeight`.
StepWeight = Any


def step_form(weight: np.ndarray | InterleavedWeight) -> StepWeight:
    """``weight`` as the compiled step takes it (a float array as it is)."""
    if isinstance(weight, InterleavedWeight):
        return weight.quants.view(np.uint8), weight.scales, weight.minima, half_table()
    return weight


@njit(cache=True, fastmath=False)
def _typed_list(items):  # noqa: ANN001, ANN202
    """A typed list of a homogeneous tuple's items, made in compiled code: the list's methods then
    come from this function's cache entry, where a ``List`` made from Python compiles them in every
    process (0.85 s of a SmolLM2 load)."""
    listed = List()
    for item in items:
        listed.append(item)
    return listed


def step_layers(layers: np.ndarray | Sequence[InterleavedWeight]) -> Any:
    """A model's weights of one kind, every layer, as the compiled step indexes them by layer: the
    float ``[layers, ...]`` array as it is, interleaved ones as a typed list of :func:`step_form`."""
    if isinstance(layers, np.ndarray):
        return layers
    forms = tuple(step_form(w) for w in layers)
    if isinstance(typeof(forms), types.UniTuple):
        return _typed_list(forms)
    return List(forms)  # (arrays of other flags: a list of their own type, its methods compiled here)


def _quantized(weight: types.Type) -> bool:
    return isinstance(weight, types.BaseTuple)


def rows_matmul(x, w, bias, out, threads):  # noqa: ANN001, ANN201 - typed by its overload
    """``out = x @ W.T + bias`` for a step of a few rows, forking over numba's ``threads``: the
    float weight's ``matmul_rows_cpu``, the interleaved one's integer dots."""


@overload(rows_matmul, jit_options={"nogil": True})
def _rows_matmul(x, w, bias, out, threads):  # noqa: ANN001, ANN202
    if _quantized(w):
        def interleaved(x, w, bias, out, threads):  # noqa: ANN001, ANN202
            quants, scales, minima, table = w
            interleaved_dot.interleaved_dot_rows_cpu(x, quants, scales, minima, table, bias, out,
                                                     interleaved_dot.CHUNKS_PER_THREAD * threads)
        return interleaved

    def plain(x, w, bias, out, threads):  # noqa: ANN001, ANN202
        matmul.matmul_rows_cpu(x, w, bias, out)
    return plain


def swiglu_matmul(x, w, out, gate_up, no_bias, threads):  # noqa: ANN001, ANN201 - typed by its overload
    """``out = silu(gate) * up`` of ``x @ [gate | up].T`` for a step of one token where
    :func:`fuses_swiglu` says the kernel may: float weights' fused ``matmul_swiglu_cpu``
    (``gate_up`` unused); an interleaved weight's product into ``gate_up``, then ``silu_mul_cpu``
    (only a thread team fuses those)."""


@overload(swiglu_matmul, jit_options={"nogil": True})
def _swiglu_matmul(x, w, out, gate_up, no_bias, threads):  # noqa: ANN001, ANN202
    if _quantized(w):
        def interleaved(x, w, out, gate_up, no_bias, threads):  # noqa: ANN001, ANN202
            rows_matmul(x, w, no_bias, gate_up, threads)
            silu_mul.silu_mul_cpu(gate_up, out)
        return interleaved

    def plain(x, w, out, gate_up, no_bias, threads):  # noqa: ANN001, ANN202
        matmul.matmul_swiglu_cpu(x, w, out)
    return plain


def gather(token_ids, table, out):  # noqa: ANN001, ANN201 - typed by its overload
    """``out[t] = table[token_ids[t]]`` (an interleaved table's rows dequantized exactly)."""


@overload(gather, jit_options={"nogil": True})
def _gather(token_ids, table, out):  # noqa: ANN001, ANN202
    if _quantized(table):
        def interleaved(token_ids, table, out):  # noqa: ANN001, ANN202
            quants, scales, minima, half = table
            interleaved_dot.interleaved_embedding_cpu(token_ids, quants, scales, minima, half, out)
        return interleaved

    def plain(token_ids, table, out):  # noqa: ANN001, ANN202
        embedding.embedding_gather_cpu(token_ids, table, out)
    return plain


def fuses_swiglu(gate_up_w, team):  # noqa: ANN001, ANN201 - typed by its overload
    """Whether a step of one token may take the MLP's gate/up projection and SwiGLU as one op
    (:func:`swiglu_matmul`, or in a thread team with ``team``), for these layers' ``[gate | up]``
    weights: float ones when each of ``matmul_swiglu_cpu``'s blocks of four rows holds whole
    (gate, up) pairs; interleaved ones always, and in a team when the gates come in whole groups."""


@overload(fuses_swiglu, jit_options={"nogil": True})
def _fuses_swiglu(gate_up_w, team):  # noqa: ANN001, ANN202
    if isinstance(gate_up_w, types.Array):
        return lambda gate_up_w, team: gate_up_w.shape[1] % 4 == 0

    def interleaved(gate_up_w, team):  # noqa: ANN001, ANN202
        if not team:
            return True
        for layer in range(len(gate_up_w)):
            if gate_up_w[layer][1].shape[0] % 2 != 0:  # groups: the gates' must be whole ones
                return False
        return True
    return interleaved

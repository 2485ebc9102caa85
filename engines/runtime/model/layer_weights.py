"""The decoder layers' weights gathered by kind, one module below both the model that stores them
(``llama``) and the compiled CPU step that reads them whole (``cpu_step``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engines.runtime.model.backend import Array

__all__ = ["LayerWeights"]


@dataclass(frozen=True)
class LayerWeights:
    """Every decoder layer's weights, a sequence per kind indexed by layer (``backend.store_layers``):
    one ``[layers, ...]`` array each on the CPU, which the compiled CPU step (``cpu_step``) reads
    whole; a device array per layer on CUDA. q/k/v and gate/up are concatenated along ``out``."""

    input_norm: Sequence[Array]
    qkv_w: Sequence[Array]
    qkv_bias: Sequence[Array]  # empty rows when the checkpoint has no attention bias
    o_w: Sequence[Array]
    post_attention_norm: Sequence[Array]
    gate_up_w: Sequence[Array]
    down_w: Sequence[Array]

"""A checkpoint's weights placed on a backend: each tensor (Hugging Face names) checked against the
config, moved to the backend's storage once, the fused projections concatenated, the RoPE tables
made: what :class:`~engines.runtime.model.llama.LlamaModel` is built from, so that the model reads
as its forward pass and nothing else."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from engines.runtime.model.backend import Array, Backend
from engines.runtime.model.config import CheckpointError, ModelConfig, expected_tensor_shapes
from engines.runtime.model.kernels.rope_kv import rope_tables
from engines.runtime.model.layer_weights import LayerWeights
from engines.runtime.model.quant.quantized_weight import HostWeight, QuantizedWeight

__all__ = ["PlacedWeights", "check_weights", "place_weights"]


@dataclass(frozen=True)
class PlacedWeights:
    """A Llama model's weights in its backend's storage (:func:`place_weights`)."""

    embed_tokens: Array
    layers: LayerWeights
    #: The final RMSNorm's weight (float32, as every norm's whatever the dtype: tiny).
    norm: Array
    #: The LM head: the embedding table itself where the checkpoint ties them.
    lm_head: Array
    #: The empty bias of every matmul without one.
    no_bias: Array
    #: RoPE's cos and sin tables (float32), every position.
    rope: tuple[Array, Array]
    #: The weights' storage: ``dtype``, or the ggml types kept quantized and how many matrices each
    #: ("Q4_1 x210, Q8_0 x1"; "Q4_1 from Q4_K x.." where the loader converted the file's type; the
    #: others in ``dtype``).
    weights_format: str
    #: The stored weights' bytes (a tied LM head counted once; the norms, kept float32, as ``dtype``;
    #: a quantized weight's own bytes).
    weight_bytes: int


def check_weights(config: ModelConfig, weights: Mapping[str, HostWeight]) -> None:
    """Raise :class:`CheckpointError` for the first tensor ``config`` needs that is missing or
    has the wrong shape (``lm_head.weight`` is optional when embeddings are tied)."""
    for name, shape in expected_tensor_shapes(config).items():
        tensor = weights.get(name)
        if tensor is None:
            raise CheckpointError(f"weights lack tensor {name}, which the {config.model_type} config requires")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)} but the config implies {list(shape)}")
    head = weights.get("lm_head.weight")
    if head is not None and tuple(head.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(f"tensor lm_head.weight has shape {list(head.shape)} but the config implies "
                              f"{[config.vocab_size, config.hidden_size]}")


def place_weights(backend: Backend, config: ModelConfig, weights: Mapping[str, HostWeight],
                  dtype: str) -> PlacedWeights:
    """``weights`` (checked: :func:`check_weights`) in ``backend``'s storage of ``dtype``: q/k/v and
    gate/up fused into one matrix each, every layer's of a kind stored together
    (``Backend.store_layers``), in the order the model's constructor stored them."""
    be, c = backend, config
    quantized = {name: w.ggml_type + (f" from {w.converted_from}" if w.converted_from else "")
                 for name, w in weights.items() if isinstance(w, QuantizedWeight)}
    weights_format = ", ".join(f"{kind} x{n}" for kind, n in sorted(Counter(quantized.values()).items())) or dtype
    itemsize = np.dtype(dtype).itemsize
    weight_bytes = sum(w.nbytes if isinstance(w, QuantizedWeight) else int(w.size) * itemsize
                       for name, w in weights.items() if not (name == "lm_head.weight" and c.tie_word_embeddings))

    def store(array: HostWeight) -> Array:
        return be.to_storage(array, dtype)

    no_bias = store(np.zeros(0, np.float32))
    cos, sin = rope_tables(c.head_dim, c.rope_theta, c.max_position_embeddings)
    rope = (be.to_storage(cos, "float32"), be.to_storage(sin, "float32"))
    embed_tokens = store(weights["model.embed_tokens.weight"])

    def layers(make: Callable[[int], HostWeight], linear: bool = False, kind: str = dtype) -> Sequence[Array]:
        # (The CPU's is one [layers, ...] array: a sequence of layers, if not a typing.Sequence.)
        return be.store_layers(make, c.num_hidden_layers, kind, linear)

    def tensor(i: int, name: str) -> HostWeight:
        return weights[f"model.layers.{i}.{name}"]

    def fused(i: int, names: list[str]) -> HostWeight:
        # HF's [out, in] matrices (or biases), concatenated along out: one matmul for q/k/v, one for gate/up
        # (quantized ones stay quantized, as Q8_0 where their types differ; a float with a quantized
        # one is dequantized).
        parts = [tensor(i, name) for name in names]
        kept = [p for p in parts if isinstance(p, QuantizedWeight)]
        if len(kept) == len(parts):
            return QuantizedWeight.concatenate(kept)
        return np.concatenate([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts], axis=0)

    qkv = [f"self_attn.{n}_proj" for n in "qkv"]
    # A kept-quantized matmul adds a float32 bias whatever the dtype (quantized_matmul's
    # signatures; a float one's is in dtype): a float16 bias there would be read as float32.
    # (Every layer's q/k/v are of the same types in the files met: layer 0 decides.)
    qkv_kept = all(isinstance(tensor(0, f"{n}.weight"), QuantizedWeight) for n in qkv)
    layer_weights = LayerWeights(
        input_norm=layers(lambda i: tensor(i, "input_layernorm.weight"), kind="float32"),
        qkv_w=layers(lambda i: fused(i, [f"{n}.weight" for n in qkv]), linear=True),
        qkv_bias=layers((lambda i: fused(i, [f"{n}.bias" for n in qkv])) if c.attention_bias
                        else (lambda i: np.zeros(0, np.float32)), kind="float32" if qkv_kept else dtype),
        o_w=layers(lambda i: tensor(i, "self_attn.o_proj.weight"), linear=True),
        post_attention_norm=layers(lambda i: tensor(i, "post_attention_layernorm.weight"), kind="float32"),
        gate_up_w=layers(lambda i: fused(i, ["mlp.gate_proj.weight", "mlp.up_proj.weight"]), linear=True),
        down_w=layers(lambda i: tensor(i, "mlp.down_proj.weight"), linear=True),
    )
    norm = be.to_storage(weights["model.norm.weight"], "float32")  # tiny: kept float32 whatever the dtype
    head = weights.get("lm_head.weight")
    # A tied head is the embedding table itself: both backends keep linear weights [out, in],
    # the table's own layout, so one copy serves the gather and the LM head.
    lm_head = embed_tokens if head is None or c.tie_word_embeddings else be.store_linear(head, dtype)
    return PlacedWeights(embed_tokens, layer_weights, norm, lm_head, no_bias, rope, weights_format, weight_bytes)

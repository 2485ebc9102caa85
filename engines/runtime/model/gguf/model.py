"""A GGUF file as the engine's model: config, Hugging Face-named float weights, tokenizer files.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight`` for
``model.layers.3.self_attn.q_proj.weight``) and, for the ``llama`` architecture only, permutes the
rows of q and k from Hugging Face's rotate-half RoPE layout into its interleaved one. Reading it
back undoes both, so the forward pass (and any transformers parity test) sees the checkpoint it
would see in a Hugging Face folder: ``w.reshape(heads, head_dim // 2, 2, in).swapaxes(1, 2)``.
Qwen2 files keep Hugging Face's layout (llama.cpp runs them with NeoX-style RoPE).

Every refusal is a :class:`CheckpointError` naming what is supported: another architecture, a
tensor this engine would ignore (a MoE expert, a q/k norm, Llama 3.1's RoPE frequency factors,
which would make the answers silently wrong), a tensor type without a kernel, a tokenizer it
does not read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.runtime.model.config import CheckpointError, ModelConfig, expected_tensor_shapes
from engines.runtime.model.gguf.container import GGUFFile, GGUFTensor, read_gguf
from engines.runtime.model.quant.dequantize import DEQUANTIZABLE, dequantize
from engines.runtime.model.quant.quantized_weight import CONVERTED_TYPES, QUANTIZED_TYPES, HostWeight, QuantizedWeight
from engines.runtime.model.gguf.vocabulary import tokenizer_files_from_gguf

__all__ = ["GGUFModel", "SUPPORTED_ARCHITECTURES", "read_gguf_model"]

#: ``general.architecture`` -> the Hugging Face ``model_type`` it runs as.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Architectures whose q/k rows llama.cpp's converter permuted (see the module docstring).
_PERMUTED_QK = frozenset({"llama"})

# GGUF tensor name -> Hugging Face name; {i} is the layer.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFModel:
    """What the engine needs from a GGUF file (weights empty unless asked for)."""

    path: Path
    hf_config: dict[str, Any]            # as a config.json would hold it
    config: ModelConfig
    # Hugging Face names -> float32 (F16 tensors stay float16), or, with keep_quantized, the linear
    # weights and the embedding in Q8_0, Q4_0 or Q4_1 as they are (QuantizedWeight)
    weights: dict[str, HostWeight]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]     # as a tokenizer_config.json would hold it
    eos_token_ids: tuple[int, ...]
    tensor_types: dict[str, int]         # ggml type name -> how many tensors have it (what the file holds)


def read_gguf_model(path: str | Path, *, load_weights: bool = True, keep_quantized: bool = False) -> GGUFModel:
    """Read a GGUF file into a :class:`GGUFModel`; ``load_weights=False`` reads the metadata only.
    ``keep_quantized`` keeps the matrices the kernels read quantized (``QUANTIZED_TYPES``) as the
    file holds them, repacked (:class:`QuantizedWeight`); every other tensor is dequantized.

    Raises :class:`CheckpointError` for anything this engine cannot serve exactly.
    """
    file = Path(path)
    with read_gguf(file) as gguf:
        meta = gguf.metadata
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{file.name} holds a {arch!r} model; this engine serves GGUF architectures "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if meta.get(f"{arch}.expert_count"):
            raise CheckpointError(f"{file.name} is a mixture-of-experts model ({meta[f'{arch}.expert_count']} "
                                  "experts); this engine serves dense models only")
        hf_config = _hf_config(file, gguf, arch)
        try:
            config = ModelConfig.from_hf_dict(hf_config)
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise CheckpointError(f"{file.name} has an invalid value in its metadata: {exc}") from None
        except CheckpointError as exc:
            raise CheckpointError(f"{file.name}: {exc}") from None
        mapping = _tensor_names(file, gguf, config)
        tokenizer_json, tokenizer_config = tokenizer_files_from_gguf(meta)
        types: dict[str, int] = {}
        for tensor in gguf.tensors.values():
            types[tensor.ggml_type.name] = types.get(tensor.ggml_type.name, 0) + 1
        unreadable = sorted(t for t in types if t not in DEQUANTIZABLE)
        if unreadable:
            raise CheckpointError(f"{file.name} has tensors of ggml type {', '.join(unreadable)}; this engine reads "
                                  f"{', '.join(sorted(DEQUANTIZABLE))}")
        weights = _read_weights(gguf, mapping, config, arch, keep_quantized) if load_weights else {}
        return GGUFModel(
            path=file.resolve(), hf_config=hf_config, config=config, weights=weights,
            tokenizer_json=tokenizer_json, tokenizer_config=tokenizer_config,
            eos_token_ids=_eos_token_ids(meta), tensor_types=dict(sorted(types.items())),
        )


def _hf_config(file: Path, gguf: GGUFFile, arch: str) -> dict[str, Any]:
    """The metadata as the ``config.json`` the converter read it from."""
    meta = gguf.metadata

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise CheckpointError(f"{file.name} lacks metadata {arch}.{name}, which every {arch} GGUF carries")
        return value

    heads = int(key("attention.head_count", required=True))
    hidden = int(key("embedding_length", required=True))
    head_dim = int(key("attention.key_length", hidden // heads if heads else 0))
    rope_dim = key("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise CheckpointError(f"{file.name} rotates {rope_dim} of each head's {head_dim} dimensions (partial "
                              "RoPE); this engine rotates whole heads")
    if "rope_freqs.weight" in gguf.tensors:
        raise CheckpointError(f"{file.name} carries RoPE frequency factors (rope_freqs.weight: Llama 3.1-style "
                              "RoPE scaling), which this engine does not apply yet")
    embed = gguf.tensors.get("token_embd.weight")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size") or (embed.shape[0] if embed is not None else len(tokens or ()))
    config: dict[str, Any] = {
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _shortest(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _shortest(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor")}
    return config


def _shortest(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not 9.999999747378752e-06):
    the same float32, and the value config.json has."""
    return float(str(np.float32(value)))


def _tensor_names(file: Path, gguf: GGUFFile, config: ModelConfig) -> dict[str, GGUFTensor]:
    """Hugging Face name -> the GGUF tensor holding it, every shape checked against ``config``."""
    mapping: dict[str, GGUFTensor] = {}
    unknown: list[str] = []
    for name, tensor in gguf.tensors.items():
        hf = _GLOBAL_NAMES.get(name)
        layer = _LAYER_TENSOR.fullmatch(name)
        if layer is not None and layer.group(2) in _LAYER_NAMES:
            hf = f"model.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}"
        if hf is None:
            unknown.append(name)
        else:
            mapping[hf] = tensor
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(f"{file.name} has tensor(s) {', '.join(unknown[:3])}{more} that a Llama-family "
                              "model of this engine does not use; serving it without them would answer wrongly")
    expected = expected_tensor_shapes(config)
    for hf, shape in expected.items():
        held = mapping.get(hf)
        if held is None:
            raise CheckpointError(f"{file.name} lacks the tensor for {hf}, which its metadata "
                                  f"({config.num_hidden_layers} layers) requires")
        if held.shape != shape:
            raise CheckpointError(f"tensor {held.name} in {file.name} has shape {list(held.shape)} but the "
                                  f"metadata implies {list(shape)}: the file is inconsistent")
    stray = sorted(set(mapping) - set(expected) - {"lm_head.weight"})
    if stray:
        raise CheckpointError(f"{file.name} has tensor(s) for {', '.join(stray[:3])} beyond its metadata's "
                              f"{config.num_hidden_layers} layers: the file is inconsistent")
    return mapping


def _read_weights(gguf: GGUFFile, mapping: dict[str, GGUFTensor], config: ModelConfig,
                  arch: str, keep_quantized: bool) -> dict[str, HostWeight]:
    weights: dict[str, HostWeight] = {}
    for hf, tensor in mapping.items():
        array: HostWeight
        if keep_quantized and _kept_quantized(hf, tensor):
            out_features, in_features = tensor.shape
            array = QuantizedWeight.from_file(gguf.tensor_bytes(tensor), tensor.ggml_type,
                                              (out_features, in_features))
        else:
            array = dequantize(gguf.tensor_bytes(tensor), tensor.ggml_type, tensor.shape, keep_float16=True)
        if arch in _PERMUTED_QK:
            if hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias"):
                array = _unpermute_rope_rows(array, config.num_attention_heads)
            elif hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias"):
                array = _unpermute_rope_rows(array, config.num_key_value_heads)
        weights[hf] = array
    return weights


def _kept_quantized(hf: str, tensor: GGUFTensor) -> bool:
    """Whether the kernels read this tensor quantized: a matrix (a linear layer's weight, the LM head
    or the embedding table, which the embedding gather dequantizes a row at a time) of a type they read."""
    return (tensor.ggml_type.name in QUANTIZED_TYPES + CONVERTED_TYPES and len(tensor.shape) == 2
            and (hf.endswith("_proj.weight") or hf in ("lm_head.weight", "model.embed_tokens.weight")))


def _unpermute_rope_rows(w: HostWeight, heads: int) -> HostWeight:
    """Undo llama.cpp's ``permute``: each head's rows back from interleaved pairs to two halves
    (a quantized weight's rows move whole, with their blocks)."""
    rows = w.shape[0]
    order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(w, QuantizedWeight):
        return w.rows(order)
    return np.ascontiguousarray(w[order])


def _eos_token_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """Every id that ends generation: the EOS, then the end-of-turn and end-of-message tokens
    llama.cpp also stops on."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)

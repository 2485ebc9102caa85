"""GGUF files for the tests, written with the ``gguf`` package (llama.cpp's own writer).

:func:`write_gguf` writes a checkpoint's config, weights and byte-level BPE tokenizer the way
llama.cpp's converter does: llama.cpp's tensor names, the dimensions innermost first, q and k rows
permuted into the interleaved RoPE layout (architecture ``llama``), the vocabulary as
``tokenizer.ggml.*`` metadata.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from engines.runtime.model.config import ModelConfig

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp converter's ``permute``: each head's two halves into interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(tokenizer_json: str) -> dict[str, Any]:
    """A Hugging Face byte-level BPE ``tokenizer.json`` as GGUF's tokens, types and merges."""
    spec = json.loads(tokenizer_json)
    vocab: dict[str, int] = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {a["id"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokens": tokens, "types": [3 if i in special else 1 for i in range(len(tokens))], "merges": merges}


def write_gguf(path: Path, config: ModelConfig, weights: Mapping[str, np.ndarray], tokenizer_json: str, *,
               arch: str = "llama", pre: str = "gpt-2",
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               bos: int | None = None, eos: int | None = None, eot: int | None = None, add_bos: bool = False,
               chat_template: str | None = None, metadata: Mapping[str, Any] | None = None,
               raw_tensors: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
               skip: frozenset[str] = frozenset()) -> Path:
    """Write ``weights`` (Hugging Face names, float32) as llama.cpp would convert them.

    Matrices are stored as ``qtype`` (1-D tensors, the norms and biases, stay F32, as llama.cpp
    keeps them); ``raw_tensors`` adds tensors as given bytes of a type; ``skip`` leaves names out;
    ``metadata`` adds or overrides keys (a value None drops the key).
    """
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer_metadata(tokenizer_json)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for value, add in ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id), (eot, writer.add_eot_token_id)):
        if value is not None:
            add(value)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if key in writer.kv_data[0]:
            del writer.kv_data[0][key]
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for hf, array in weights.items():
        if hf in skip:
            continue
        w = np.asarray(array, np.float32)
        if arch == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute_rope_rows(w, config.num_attention_heads)
        elif arch == "llama" and hf.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute_rope_rows(w, config.num_key_value_heads)
        if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf), np.ascontiguousarray(w))
        else:
            writer.add_tensor(gguf_name(hf), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name, (data, raw_type) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""Model architecture configuration, read from a Hugging Face ``config.json``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class CheckpointError(Exception):
    """A checkpoint cannot be loaded; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2)

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed ``config.json``; raises :class:`CheckpointError` on what we can't run."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r}: this engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"config.json lacks required field(s): {', '.join(missing)}")
        # transformers 5 writes the RoPE settings as "rope_parameters" (and no top-level
        # rope_theta); older checkpoints use rope_theta + rope_scaling.
        rope_parameters = raw.get("rope_parameters") or {}
        for rope in (raw.get("rope_scaling"), rope_parameters):
            if rope and (rope.get("rope_type") or rope.get("type")) not in (None, "default"):
                raise CheckpointError(
                    f"RoPE scaling {rope!r} is not supported yet: only plain rope_theta is"
                )
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        )


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names a Llama-family checkpoint must hold for ``config``, with shapes."""
    h = config.hidden_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (q_dim, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_dim, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_dim, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q_dim)
        if config.attention_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (q_dim,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_dim,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes

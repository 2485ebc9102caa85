"""The built-in ``demo`` model: a small Llama checkpoint the project makes itself.

Everything runs without a download: :func:`demo_checkpoint_path` builds a ~26M-parameter
Llama-architecture checkpoint in Hugging Face format (loadable by :func:`load_checkpoint` and
by ``transformers``), once, into a cache folder, and returns that folder. The build is
deterministic: the byte-level BPE tokenizer is trained with the ``tokenizers`` library on
``demo_corpus.txt`` (shipped next to this file) and the weights come from seeded numpy
generators, so every machine builds byte-identical files. The weights are random: the demo
model produces fluent-looking token soup, which is all a debug server needs to exercise
batching, caching, tracing and streaming.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engines.runtime.cache_root import default_cache_root
from engines.runtime.model.config import ModelConfig, expected_tensor_shapes

__all__ = ["DEMO_VERSION", "demo_checkpoint_path", "build_demo_checkpoint"]

# Bump whenever anything below changes what gets written: the version names the cache folder,
# so a stale build is never mistaken for the current one.
DEMO_VERSION = "v1"
DEMO_NAME = "demo"
CORPUS_FILE = Path(__file__).with_name("demo_corpus.txt")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Ids 0..3, in this order: the trainer assigns special tokens first.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)
TARGET_VOCAB_SIZE = 4096

# ChatML, with the BOS written by the template: a rendered chat is encoded with
# add_special_tokens=False, as transformers does.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
_WEIGHT_STD = 0.02
_SEED = 20240601


def demo_checkpoint_path(cache_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """The folder of the demo checkpoint, building it on first use (``progress`` hears of the build).

    ``cache_dir`` (default :func:`default_cache_root`) gets a ``demo-<version>`` subfolder. The
    build happens in a temporary sibling folder that is renamed into place when complete, so
    concurrent processes never see half a checkpoint: the first rename wins, the others drop
    their copy.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / f"{DEMO_NAME}-{DEMO_VERSION}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(root, final.name)
    if progress is not None:
        progress(f"building the demo checkpoint into {final}")
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-build-", dir=root))
    try:
        build_demo_checkpoint(staging)
        # Durable before visible: after a crash the cache holds a whole checkpoint or none.
        for file in staging.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is ordinary user data
        try:
            os.rename(staging, final)
        except OSError:
            # Another process renamed its build into place first (the target now exists and
            # is not empty); both builds are identical, so keep theirs.
            if not (final / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _remove_abandoned_builds(root: Path, name: str) -> None:
    # A process killed mid-build leaves its staging folder behind. A build takes seconds, so
    # one an hour old is abandoned, not in progress in another process.
    cutoff = time.time() - 3600
    for stale in root.glob(f".{name}-build-*"):
        try:
            if stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process cleaned it up first


def build_demo_checkpoint(folder: Path) -> None:
    """Write the demo checkpoint's files into the existing, empty ``folder``."""
    tokenizer = train_demo_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = {
        "_name_or_path": DEMO_NAME,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **_ARCHITECTURE,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": _WEIGHT_STD,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[IM_END],
        "torch_dtype": "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": EOS_TOKEN,
        "model_max_length": _ARCHITECTURE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": ids[BOS_TOKEN],
        # Chat turns end with <|im_end|>; raw completions may end with <|end_of_text|>.
        "eos_token_id": [ids[IM_END], ids[EOS_TOKEN]],
    }
    _write_json(folder / "config.json", config)
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    _write_json(folder / "generation_config.json", generation_config)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    model_config = ModelConfig.from_hf_dict(config)
    _write_safetensors(folder / "model.safetensors", demo_weights(model_config))


def train_demo_tokenizer() -> HFTokenizer:
    """Train the demo's byte-level BPE on the shipped corpus (deterministic: the trainer breaks
    ties between equally frequent pairs by pair order, and the corpus is fixed)."""
    tokenizer = HFTokenizer(models.BPE())
    # GPT-2 style: split on the regex, map every byte to a printable character. Together with
    # the full 256-byte initial alphabet, any text encodes, emoji and all.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_FILE.read_text(encoding="utf-8").splitlines(), trainer)
    # Llama 3 style: the post-processor puts BOS before a raw prompt (encode(text)); chat
    # prompts get theirs from the template instead.
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def demo_weights(config: ModelConfig) -> dict[str, np.ndarray]:
    """Seeded random float32 weights for every tensor ``config`` needs.

    Each tensor has its own generator, seeded from its name, so a tensor's values do not
    depend on which others exist. Matrices are N(0, 0.02) and norms are 1, as in Llama's own
    initialisation, which keeps activations and logits small and finite through every layer.
    """
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
            continue
        seed = int.from_bytes(hashlib.sha256(f"{_SEED}:{name}".encode()).digest()[:8], "little")
        rng = np.random.Generator(np.random.PCG64(seed))
        weights[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(_WEIGHT_STD)).astype(np.float32)
    return weights


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 tensors in safetensors layout, names sorted, so the bytes are reproducible."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        nbytes = tensors[name].nbytes
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # The data must start 8-byte aligned; the format allows padding the header with spaces.
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name], dtype="<f4").tobytes())

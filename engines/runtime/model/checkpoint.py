"""Loading a checkpoint into host memory: a Hugging Face folder, or a GGUF file.

:func:`load_checkpoint` takes either. A GGUF file (llama.cpp's format) is read by
:mod:`engines.runtime.model.gguf`, which dequantizes its tensors and writes the tokenizer files
its metadata describes; everything after that is the same :class:`Checkpoint`.

A checkpoint folder holds ``config.json``, the weights (``model.safetensors``, or shards
listed in ``model.safetensors.index.json``), ``tokenizer.json``, and optionally
``tokenizer_config.json`` and ``generation_config.json``. :func:`load_checkpoint` reads and
checks all of it up front, so that every problem surfaces as one :class:`CheckpointError`
with a message the user can act on, before any kernel sees a tensor.

Safetensors files are parsed here rather than with the ``safetensors`` package because its
numpy API cannot represent bfloat16, the dtype most modern checkpoints ship in.
"""
from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from engines.runtime.model.config import CheckpointError, ModelConfig, expected_tensor_shapes
from engines.runtime.model.gguf.container import is_gguf_file
from engines.runtime.model.gguf.model import read_gguf_model
from engines.runtime.model.quant.quantized_weight import HostWeight
from engines.runtime.model.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint", "expected_tensor_shapes", "read_safetensors"]

SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> (numpy dtype to read the bytes as, bytes per element). bfloat16 is read
# as uint16 and widened below; numpy has no bfloat16.
_READABLE_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "F64": (np.dtype("<f8"), 8),
}
# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass
class Checkpoint:
    """Everything the engine needs from a checkpoint folder, in host memory."""

    path: Path
    name: str                          # folder name, "demo", or a GGUF file's name without .gguf
    config: ModelConfig
    # HF tensor names -> float32 (or float16) host arrays; a GGUF's matrices loaded with
    # keep_quantized stay in their block quantization (QuantizedWeight)
    weights: Mapping[str, HostWeight]
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]     # from generation_config.json / config.json / tokenizer_config.json
    chat_template: str | None          # Jinja source from tokenizer_config.json
    #: What the weights were stored as: "safetensors", or "GGUF Q4_1 x210, F32 x61, ..." (the
    #: ggml types and how many tensors have each), for the dashboard and /stats.
    source_format: str = "safetensors"

    @property
    def num_parameters(self) -> int:
        """Total number of weight elements (the tied LM head counted once)."""
        return int(sum(w.size for w in self.weights.values()))


def load_checkpoint(path: str | Path, *, load_weights: bool = True, keep_quantized: bool = False) -> Checkpoint:
    """Load and validate the Hugging Face checkpoint folder, or the GGUF file, at ``path``.

    ``keep_quantized``: a GGUF's matrices in a type the kernels read quantized stay so
    (``gguf.model.read_gguf_model``); a safetensors checkpoint has none.

    ``load_weights=False`` reads everything but the tensors (``weights`` is then empty): what a
    server process needs to tokenize and validate requests while the engine process holds the
    model.

    Raises :class:`CheckpointError` (never anything else for a bad checkpoint) naming the
    file or tensor at fault: a missing folder or file, invalid JSON, an unsupported
    ``model_type``, a missing tensor, a tensor whose shape does not fit ``config.json``, a
    dtype we cannot compute in (int8, fp8, ...), a corrupt safetensors or GGUF file, or a GGUF
    architecture, tensor type or tokenizer this engine does not read.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    if folder.is_file() and (folder.suffix.lower() == ".gguf" or is_gguf_file(folder)):
        return _load_gguf(folder, load_weights, keep_quantized)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is neither a checkpoint folder (one that holds config.json) nor a GGUF file")

    raw_config = _read_json(folder, "config.json", required=True)
    try:
        config = ModelConfig.from_hf_dict(raw_config)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:
        # A field of the wrong type ("hidden_size": "512x", "rope_scaling": 2, zero heads).
        raise CheckpointError(f"{folder / 'config.json'} has an invalid value: {exc}") from None
    tokenizer_config = _read_json(folder, "tokenizer_config.json", required=False)
    generation_config = _read_json(folder, "generation_config.json", required=False)

    tokenizer_json = _read_text(_require_file(folder, "tokenizer.json"))
    try:
        tokenizer = Tokenizer.from_json(
            tokenizer_json, tokenizer_config, chat_template=_read_chat_template_file(folder, tokenizer_config)
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens but config.json's vocab_size is "
            f"{config.vocab_size}: the tokenizer does not belong to this model"
        )

    weights = _load_weights(folder, config) if load_weights else {}
    return Checkpoint(
        path=folder.resolve(),
        # The demo build marks its config.json so; any other checkpoint is named after its folder.
        name="demo" if raw_config.get("_name_or_path") == "demo" else folder.resolve().name,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(generation_config, raw_config, tokenizer),
        chat_template=tokenizer.chat_template,
    )


def _load_gguf(file: Path, load_weights: bool, keep_quantized: bool) -> Checkpoint:
    model = read_gguf_model(file, load_weights=load_weights, keep_quantized=keep_quantized)
    try:
        tokenizer = Tokenizer.from_json(model.tokenizer_json, model.tokenizer_config)
    except CheckpointError as exc:
        raise CheckpointError(f"{file.name}: {exc}") from None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{file.name} has {tokenizer.vocab_size} tokens but {model.config.vocab_size} "
                              "embedding rows: the vocabulary does not belong to these weights")
    types = ", ".join(f"{name} x{count}" for name, count in model.tensor_types.items())
    return Checkpoint(
        path=model.path,
        name=file.name[:-len(".gguf")] if file.name.lower().endswith(".gguf") else file.name,
        config=model.config,
        weights=model.weights,
        tokenizer=tokenizer,
        eos_token_ids=model.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()),
        chat_template=tokenizer.chat_template,
        source_format=f"GGUF {types}",
    )


def read_safetensors(file: Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read tensors from one safetensors file as float32 (float16 stays float16).

    ``names`` limits which tensors are read (default: all). Raises :class:`CheckpointError`
    for a corrupt file or a dtype we cannot compute in.
    """
    header, data_start, size = _read_safetensors_header(file)
    wanted = set(header) - {"__metadata__"} if names is None else set(names)
    out: dict[str, np.ndarray] = {}
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name in sorted(wanted):
            out[name] = _tensor_from_mmap(file, name, header.get(name), mm, data_start, size)
    return out


# -- internals ----------------------------------------------------------------------------


def _require_file(folder: Path, filename: str) -> Path:
    file = folder / filename
    if not file.is_file():
        raise CheckpointError(f"{folder} has no {filename}: a Hugging Face checkpoint folder needs it")
    return file


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{file} is not UTF-8 text: re-download or fix the file") from None


def _read_chat_template_file(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template saved beside tokenizer_config.json, if it should win over the config's.

    transformers (4.47+) saves the template as ``chat_template.jinja`` and lets it win over
    tokenizer_config.json's; older multimodal checkpoints may carry ``chat_template.json`` instead.
    """
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_text(jinja_file)
    if tokenizer_config.get("chat_template"):
        return None
    template = _read_json(folder, "chat_template.json", required=False).get("chat_template")
    return template if isinstance(template, str) else None


def _read_json(folder: Path, filename: str, required: bool) -> dict[str, Any]:
    file = folder / filename
    if not file.is_file():
        if required:
            _require_file(folder, filename)
        return {}
    try:
        parsed = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}): re-download or fix the file") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{file} must hold a JSON object, found {type(parsed).__name__}")
    return parsed


def _weight_files(folder: Path) -> dict[str, Path]:
    """Which file holds each tensor: every tensor of a single file, or the shard index's map."""
    index_file = folder / SHARD_INDEX_FILE
    if index_file.is_file():
        index = _read_json(folder, SHARD_INDEX_FILE, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_file} has no valid \"weight_map\" (tensor name -> shard file)")
        shards = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(shards.values())):
            if not shard.is_file():
                raise CheckpointError(f"{folder} has no {shard.name}, which {SHARD_INDEX_FILE} lists as a shard")
        return shards
    single = folder / SINGLE_WEIGHTS_FILE
    if not single.is_file():
        if any(folder.glob("*.bin")) or any(folder.glob("*.pth")):
            raise CheckpointError(
                f"{folder} has PyTorch .bin/.pth weights but no {SINGLE_WEIGHTS_FILE}: convert them to "
                "safetensors (transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
        raise CheckpointError(f"{folder} has no {SINGLE_WEIGHTS_FILE} (nor a sharded {SHARD_INDEX_FILE})")
    header, _, _ = _read_safetensors_header(single)
    return {name: single for name in header if name != "__metadata__"}


def _load_weights(folder: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    expected = expected_tensor_shapes(config)
    location = _weight_files(folder)
    missing = [name for name in expected if name not in location]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"checkpoint {folder} lacks tensor(s) {', '.join(missing[:3])}{more} that config.json "
            f"({config.model_type}, {config.num_hidden_layers} layers) requires"
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(location[name], []).append(name)

    weights: dict[str, np.ndarray] = {}
    for file, names in by_file.items():
        # Check shapes against the header before reading any bytes: a mismatch is reported
        # instantly instead of after loading gigabytes.
        header, _, _ = _read_safetensors_header(file)
        for name in names:
            entry = header.get(name)
            if entry is None:
                raise CheckpointError(f"{file.name} lacks tensor {name}, which {SHARD_INDEX_FILE} places there")
            found = tuple(entry.get("shape", ())) if isinstance(entry, dict) else ()
            if found != expected[name]:
                raise CheckpointError(
                    f"tensor {name} in {file.name} has shape {list(found)} but config.json implies "
                    f"{list(expected[name])}: the weights do not match this config"
                )
        weights.update(read_safetensors(file, names))
    return weights


def _read_safetensors_header(file: Path) -> tuple[dict[str, Any], int, int]:
    """Parse the header: an 8-byte little-endian length, then that many bytes of JSON."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file} is not a safetensors file (only {size} bytes): re-download it")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{file} is corrupt or truncated (header claims {header_len} bytes, file has {size}): re-download it"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file} is corrupt: its safetensors header is not valid JSON; re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is corrupt: its safetensors header is not a JSON object; re-download it")
    return header, 8 + header_len, size


def _tensor_from_mmap(file: Path, name: str, entry: Any, mm: mmap.mmap, data_start: int, size: int) -> np.ndarray:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file.name} has no tensor {name}")
    dtype_name = entry.get("dtype")
    if dtype_name not in _READABLE_DTYPES:
        raise CheckpointError(
            f"tensor {name} in {file.name} has dtype {dtype_name}, which this engine cannot run: it computes in "
            "float32/float16/bfloat16; use an unquantized checkpoint"
        )
    dtype, itemsize = _READABLE_DTYPES[dtype_name]
    try:
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{file} is corrupt: bad header entry for {name}; re-download it") from None
    count = int(np.prod(shape, dtype=np.int64))
    if end - begin != count * itemsize or begin < 0 or data_start + end > size:
        raise CheckpointError(
            f"{file} is corrupt or truncated: tensor {name} does not fit the file's data; re-download it"
        )
    # frombuffer on the mmap is zero-copy; the copies below (astype / copy) detach the
    # result from the file, so the file may be replaced (the demo cache) while we run.
    raw = np.frombuffer(mm, dtype=dtype, count=count, offset=data_start + begin).reshape(shape)
    if dtype_name == "BF16":
        # bfloat16 is the top half of a float32: shift the bits up and reinterpret.
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype_name == "F64":
        return raw.astype(np.float32)
    return raw.copy()


def _eos_token_ids(generation_config: Mapping[str, Any], raw_config: Mapping[str, Any],
                   tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: generation_config.json's (it may list several, like Llama 3's
    <|eot_id|> and <|end_of_text|>), or config.json's when there is none (transformers reads
    config.json only then: its value is often a stale default), then the tokenizer's eos_token."""
    declared = generation_config.get("eos_token_id")
    if declared is None:
        declared = raw_config.get("eos_token_id")
    ids: list[int] = []
    for value in [*(declared if isinstance(declared, list) else [declared]), tokenizer.eos_token_id]:
        if isinstance(value, int) and not isinstance(value, bool) and value not in ids:
            ids.append(value)
    return tuple(ids)

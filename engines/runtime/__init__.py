"""The inference runtime: Llama-family engines on numba kernels, with no Django in sight.

This module is the runtime's face: everything outside ``engines/runtime/`` (the Django app,
``bench/``) imports from here, never from a room. The rooms, and the one direction their
imports run (``frontend -> core -> model -> kernels``; ``telemetry`` used by all, using none):

* ``model/``: what the weights compute. Config, checkpoint loading and tokenizer, the demo
  model, the Llama forward pass (``llama``) and its batch (``forward_batch``), the backends, the
  paged KV tensors (``kv_storage``) and the numba kernels (``kernels/``, each CUDA kernel beside
  its CPU twin).
* ``core/``: serving one model. Requests, the scheduler, the KV page pool and prefix cache
  (``kv_pool``), sampling, grammars, stop rules, and ``Engine``, whose ``step()`` is
  schedule -> execute -> update, with its collaborators (``output_processor``,
  ``profiler_control``, ``step_observer``) and disaggregated serving's side (``disagg/``: the
  transfer data, the receive and send sides, the ``kv_wire`` format, the ``kv_http`` listener
  and poster).
* ``frontend/``: the process boundary. The typed messages (each engine call with its handler),
  the engine-core loop (and an engine process's ``main``), the thread and process transports,
  ``AsyncEngine``, its supervision (restarts) and the cold-start precompile.
* ``telemetry/``: the event trace recorder, the window it hands its Chrome-trace exporters
  (``trace_window``), the exporters, engine metrics.

Names resolve lazily (PEP 562): ``from engines.runtime import SamplingParams`` loads the
sampler only, not numba or the model, so the server's protocol layer stays cheap to import.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # frontend
    "AsyncEngine": "frontend.async_engine",
    "EngineDeadError": "frontend.async_engine",
    "EngineSpec": "frontend.messages",
    "EngineInfo": "frontend.messages",
    "DashboardReading": "frontend.messages",
    "ProfileTrigger": "core.profile_trigger",
    "KVListenSpec": "core.disagg.kv_http",
    "KVPostError": "core.disagg.kv_http",
    "post_block": "core.disagg.kv_http",
    "KV_WIRE_VERSION": "core.disagg.kv_wire",
    "KVWireError": "core.disagg.kv_wire",
    "decode_block": "core.disagg.kv_wire",
    "encode_block": "core.disagg.kv_wire",
    "wire_size": "core.disagg.kv_wire",
    "EngineState": "frontend.supervision",
    "EngineStatus": "frontend.supervision",
    "RestartPolicy": "frontend.supervision",
    # core
    "Engine": "core.engine",
    "EngineConfig": "core.engine",
    "GenerationRequest": "core.request",
    "GrammarMode": "core.request",
    "RequestOutput": "core.request",
    "RequestTimes": "core.request",
    "ChoiceDelta": "core.request",
    "FinishReason": "core.request",
    "EngineRequestError": "core.request",
    "KVBlock": "core.disagg.transfer",
    "KVDelivery": "core.disagg.transfer",
    "KVReceipt": "core.disagg.transfer",
    "KVSend": "core.disagg.transfer",
    "KVTransferError": "core.disagg.transfer",
    "ModelIdentity": "core.disagg.transfer",
    "SamplingParams": "core.sampler",
    "InvalidSamplingParams": "core.sampler",
    "TokenLogprob": "core.sampler",
    "RequestLimits": "core.limits",
    "PHASES": "core.anatomy",
    "DEFAULT_KV_ENTRIES": "core.live_view",
    "DEFAULT_LIVE_LIMIT": "core.live_view",
    "LiveRequest": "core.live_view",
    "LiveRequests": "core.live_view",
    "KVCacheDump": "core.live_view",
    "PrefixCacheEntry": "core.live_view",
    "RequestPages": "core.live_view",
    "REQUEST_LIMITS": "core.limits",
    # model
    "LlamaModel": "model.llama",
    "ForwardBatch": "model.forward_batch",
    "ModelConfig": "model.config",
    "StepInputs": "model.backend",
    "PagedKVCache": "model.kv_storage",
    "select_backend": "model.backend",
    "cuda_usable": "model.backend",
    "precompile": "frontend.precompile",
    "rope_tables": "model.kernels.rope_kv",
    "CheckpointError": "model.config",
    "Checkpoint": "model.checkpoint",
    "load_checkpoint": "model.checkpoint",
    "QuantizedWeight": "model.quant.quantized_weight",
    "demo_checkpoint_path": "model.demo_model",
    "BUILTIN_MODEL_NAMES": "model.builtin_models",
    "BUILTIN_GGUF_NAMES": "model.builtin_models",
    "builtin_model_path": "model.builtin_models",
    "Tokenizer": "model.tokenizer",
    "ChatTemplateError": "model.tokenizer",
    # telemetry
    "TraceRecorder": "telemetry.trace_recorder",
    "TraceDelta": "telemetry.trace_recorder",
    "ProfileResult": "telemetry.profiler",
    "ProfiledBackend": "telemetry.profiler",
    "StepProfiler": "telemetry.profiler",
    "ProfileStatus": "telemetry.profiler",
    "ProfilerStateError": "telemetry.profiler",
    "measure_host_bandwidth": "telemetry.profiler",
    "epoch_anchor_ns": "telemetry.trace_recorder",
    "EngineMetrics": "telemetry.metrics",
    "HistogramSnapshot": "telemetry.latency_distribution",
    "LatencyDistribution": "telemetry.latency_distribution",
    "NOW_WINDOW_S": "telemetry.metrics",
    "WORKLOAD_FORMAT": "telemetry.flight_recorder",
    "WORKLOAD_VERSION": "telemetry.flight_recorder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engines.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engines.runtime.{module}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names resolve lazily above
    from engines.runtime.core.engine import Engine, EngineConfig
    from engines.runtime.core.anatomy import PHASES
    from engines.runtime.core.limits import REQUEST_LIMITS, RequestLimits
    from engines.runtime.core.profile_trigger import ProfileTrigger
    from engines.runtime.core.live_view import (DEFAULT_KV_ENTRIES, DEFAULT_LIVE_LIMIT, KVCacheDump, LiveRequest,
                                                LiveRequests, PrefixCacheEntry, RequestPages)
    from engines.runtime.core.request import (
        ChoiceDelta,
        EngineRequestError,
        FinishReason,
        GenerationRequest,
        GrammarMode,
        RequestOutput,
        RequestTimes,
    )
    from engines.runtime.core.sampler import InvalidSamplingParams, SamplingParams, TokenLogprob
    from engines.runtime.frontend.async_engine import AsyncEngine, EngineDeadError
    from engines.runtime.core.disagg.kv_http import KVListenSpec, KVPostError, post_block
    from engines.runtime.core.disagg.transfer import KVBlock, KVDelivery, KVReceipt, KVSend, KVTransferError, \
        ModelIdentity
    from engines.runtime.core.disagg.kv_wire import KV_WIRE_VERSION, KVWireError, decode_block, encode_block, wire_size
    from engines.runtime.frontend.messages import EngineInfo, DashboardReading, EngineSpec
    from engines.runtime.frontend.supervision import EngineState, EngineStatus, RestartPolicy
    from engines.runtime.frontend.precompile import precompile
    from engines.runtime.model.backend import StepInputs, cuda_usable, select_backend
    from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
    from engines.runtime.model.quant.quantized_weight import QuantizedWeight
    from engines.runtime.model.config import CheckpointError, ModelConfig
    from engines.runtime.model.builtin_models import BUILTIN_GGUF_NAMES, BUILTIN_MODEL_NAMES, builtin_model_path
    from engines.runtime.model.demo_model import demo_checkpoint_path
    from engines.runtime.model.kernels.rope_kv import rope_tables
    from engines.runtime.model.kv_storage import PagedKVCache
    from engines.runtime.model.forward_batch import ForwardBatch
    from engines.runtime.model.llama import LlamaModel
    from engines.runtime.model.tokenizer import ChatTemplateError, Tokenizer
    from engines.runtime.telemetry.flight_recorder import WORKLOAD_FORMAT, WORKLOAD_VERSION
    from engines.runtime.telemetry.latency_distribution import HistogramSnapshot, LatencyDistribution
    from engines.runtime.telemetry.metrics import NOW_WINDOW_S, EngineMetrics
    from engines.runtime.telemetry.profiler import ProfiledBackend, ProfileResult, ProfilerStateError, \
        ProfileStatus, StepProfiler, measure_host_bandwidth
    from engines.runtime.telemetry.trace_recorder import TraceDelta, TraceRecorder, epoch_anchor_ns

"""Everything an engine will compile, compiled before it says it is ready.

numba compiles a kernel for each set of argument types the first time it is called, and the
engine reaches its kernels by several paths: a step of one token runs the compiled team step,
other small steps the compiled batched step, larger ones kernel by kernel with BLAS (a long
prefill's attention in BLAS tiles), a profiled step through the profiler's timed backend; the
trace exporter, the host bandwidth read that profiles are compared with and the K/V window copies
of disaggregated serving are numba too. A first user who meets a path nobody warmed pays its
compilation in their time to first token, tens of seconds on a small machine (BENCHMARKS.md,
"First start"; docs/perf-log/code-comments.md#first-prefill-compile).

:func:`warm_up` runs a short scripted workload through the engine itself, one :data:`PARTS` entry
per path, so each path is reached exactly as requests reach it, then resets the engine: no
request, page, prefix-cache entry, metric, profile or trace event is left behind. With the
kernels in numba's disk cache the parts load rather than compile (a second or two). The parts
are also what :mod:`engines.runtime.frontend.precompile` spreads over processes on a cold
start, so that a fresh machine compiles on every core at once.

On the CUDA backend only the backend-independent parts run, and the first forward steps (its
kernels are compiled at first launch, its graphs recorded per shape).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.runtime.core.request import GenerationRequest
from engines.runtime.core.sampler import SamplingParams
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.telemetry.trace_recorder import TraceRecorder

if TYPE_CHECKING:
    from engines.runtime.core.engine import Engine

__all__ = ["PARTS", "WarmUpPart", "warm_up"]

# Request ids of the warm-up's own requests (never a user's: reset removes them before any arrives).
_ids = itertools.count()
# A step of more rows than this runs kernel by kernel (matmul.CPU_ROWS_KERNEL_MAX_ROWS), and a
# prefill run of at least 48 tokens takes BLAS attention (run_attention.MIN_RUN).
_COMPILED_STEP_MAX_ROWS = 32
_BLAS_ATTENTION_MIN_RUN = 48


@dataclass(frozen=True)
class WarmUpPart:
    """One path through the engine, the backends that have it, and its share of a cold start's
    compilation (parts are spread over processes heaviest first). Each part keeps to its own
    path, so that processes warming different parts do not compile the same function twice."""

    name: str
    run: Callable[["Engine"], None]
    backends: tuple[str, ...] = ("cpu",)
    weight: int = 1


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _sampled(max_tokens: int) -> SamplingParams:
    """Every sampling option at once: the logits path, penalties, logprobs."""
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, frequency_penalty=0.1,
                          presence_penalty=0.1, repetition_penalty=1.1, logit_bias={3: 1.0}, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=True, top_logprobs=2)


def _prompt(engine: "Engine", length: int, seed: int) -> list[int]:
    """``length`` ordinary token ids (past the special ones at the start of most vocabularies),
    different for each ``seed``: no prompt finds another's prefix in the prefix cache."""
    first = min(100, engine.vocab_size // 2)
    span = engine.vocab_size - first
    return [first + (seed * 7919 + i) % span for i in range(length)]


def _run(engine: "Engine", requests: list[GenerationRequest]) -> None:
    """Queue ``requests`` (those that fit this engine) and step until every one has finished."""
    for request in requests:
        if (len(request.prompt) + (request.sampling.max_tokens or 0) < engine.max_seq_len
                and engine.kv_pool.capacity(request.prompt) >= len(request.prompt)):
            engine.add_request(request)
    while engine.has_work:
        engine.step()


def _request(engine: "Engine", prompt_len: int, sampling: SamplingParams, **fields: Any) -> GenerationRequest:
    number = next(_ids)
    return GenerationRequest(f"warm-up-{number}", _prompt(engine, prompt_len, number), sampling, **fields)


def _one_token_steps(engine: "Engine") -> None:
    """A lone sequence of one token a step, its prompt too: the team step, greedy (argmax in it)
    and sampled."""
    _run(engine, [_request(engine, 1, _greedy(3))])
    _run(engine, [_request(engine, 1, _sampled(3))])


def _batched_steps(engine: "Engine") -> None:
    """Small steps of several sequences, short prefills together then their decodes: the compiled
    batched step."""
    count = max(2, min(4, engine.config.max_num_seqs))
    _run(engine, [_request(engine, 4 + i, _greedy(4)) for i in range(count)])
    _run(engine, [_request(engine, 4 + i, _sampled(4)) for i in range(count)])


def _large_steps(engine: "Engine") -> None:
    """Steps past the compiled step's rows, kernel by kernel with BLAS, each request done in its
    prefill step (one token): a long prefill (its attention in BLAS tiles, its last layer for the
    logit rows alone) beside a short one, and a wide batch of short ones (attention's threaded
    kernel: enough keys in all)."""
    length = min(2 * _BLAS_ATTENTION_MIN_RUN, engine.config.prefill_chunk_size - 2, engine.max_seq_len // 2)
    if length > _COMPILED_STEP_MAX_ROWS:
        _run(engine, [_request(engine, 2, _greedy(1)), _request(engine, length, _greedy(1))])
        _run(engine, [_request(engine, length, _sampled(1))])
    wide = min(engine.config.max_num_seqs, engine.config.prefill_chunk_size // 6)
    if 6 * wide > _COMPILED_STEP_MAX_ROWS:
        _run(engine, [_request(engine, 6, _greedy(1)) for _ in range(wide)])


def _structured_output(engine: "Engine") -> None:
    """A JSON grammar: llguidance's tables for this vocabulary (built once, on first use), a
    matcher's mask and forced tokens. No step: grammars change no kernel."""
    grammar = engine.grammars.compile({"type": "json_object"})
    assert grammar is not None  # a JSON object is a grammar (only free text is none)
    matcher = grammar.matcher()
    matcher.fill_mask(np.zeros(engine.vocab_size, np.bool_))
    matcher.forced_tokens()


def _profiled_step(engine: "Engine") -> None:
    """Profiled steps (every kernel launched from Python through the timed backend: a prefill,
    then decodes of two), and the host's read rate profiles are compared with, measured now
    rather than at the first profile's start."""
    engine.start_profile(max_steps=8)
    _run(engine, [_request(engine, 40, _greedy(2)), _request(engine, 3, _sampled(2))])
    engine.stop_profile("warm-up")


def _trace_export(engine: "Engine") -> None:
    """The trace exporter on a scratch recorder: the engine's own stays as it was."""
    recorder = TraceRecorder(engine="warm-up", model="warm-up", backend=engine.model.backend_name)
    recorder.add_event("a", "start prefill", {"batch_size": 2}, engine_lane=True)
    recorder.add_event(["a", "b"], "finish prefill", {"tokens": 3}, engine_lane=True)
    recorder.add_event("b", "kv cache admit", {"cached_tokens": 0, "pages": 1})
    recorder.add_event("a", "finish")
    recorder.dump_json(clear=True)


def _kv_windows(engine: "Engine") -> None:
    """Disaggregated serving's K/V copies, out of and into a page no sequence holds yet."""
    pages = (0,)
    k, v = engine.kv.read_tokens(pages, 0, 2)
    engine.kv.write_tokens(pages, 0, k, v)


def _first_steps(engine: "Engine") -> None:
    """One small prefill and one decode straight through the model (scratch K/V in page 0): the
    CUDA kernels' first launches and first graphs."""
    page_table = np.zeros((1, 1), np.int32)
    engine.model.forward(ForwardBatch(np.array([0, 1], np.int32), np.array([0, 2], np.int32),
                                      np.array([0], np.int32), page_table), engine.kv)
    engine.model.forward_greedy(ForwardBatch(np.array([1], np.int32), np.array([0, 1], np.int32),
                                             np.array([2], np.int32), page_table), engine.kv)


#: The paths, heaviest to compile first.
PARTS: tuple[WarmUpPart, ...] = (
    WarmUpPart("the batched step", _batched_steps, weight=30),
    WarmUpPart("the one-token step", _one_token_steps, weight=26),
    WarmUpPart("steps kernel by kernel", _large_steps, weight=12),
    WarmUpPart("the trace exporter", _trace_export, backends=("cpu", "cuda"), weight=10),
    WarmUpPart("profiling", _profiled_step, weight=6),
    WarmUpPart("structured output", _structured_output, backends=("cpu", "cuda"), weight=1),
    WarmUpPart("K/V windows", _kv_windows, backends=("cpu", "cuda"), weight=1),
    WarmUpPart("the first steps", _first_steps, backends=("cuda",), weight=1),
)


def warm_up(engine: "Engine", parts: tuple[WarmUpPart, ...] = PARTS,
            progress: Callable[[int, int, str], None] | None = None) -> None:
    """Run ``parts`` on ``engine`` (those its backend takes), then reset it to as it was.

    Only before any request: the parts use its pages and its loop. ``progress(done, total, name)``
    hears of each part as it starts.
    """
    if engine.requests or engine.kv_pool.num_used_pages:
        raise RuntimeError("warm_up() must run before the engine takes requests")
    chosen = [part for part in parts if engine.model.backend_name in part.backends]
    traced = engine.tracer
    engine.tracer = None  # the parts' requests leave no lane in the engine's trace
    try:
        for done, part in enumerate(chosen):
            if progress is not None:
                progress(done, len(chosen), part.name)
            part.run(engine)
    finally:
        engine.tracer = traced
        engine.reset()
        engine.num_steps = 0

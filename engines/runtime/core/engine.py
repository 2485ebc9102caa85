"""The serving engine: a synchronous step loop (``Engine``).

``Engine.step()`` reads as three verbs, as in vLLM's engine core:

1. ``_schedule``: the scheduler picks this step's chunks (``SchedulerOutput``); the
   engine stamps admissions, pins system prompts, ends what can never fit.
2. ``_execute``: one forward pass over those chunks (``ModelOutput``: greedy token
   ids computed on the device, or logits rows).
3. ``_update``: commit the K/V written, apply grammar masks and sample, run the stop
   rules and the detokenizer (and jump-forward); ``step`` then turns what changed into
   one ``RequestOutput`` per touched request.

Trace events and metrics hang off those seams. The engine is single-threaded:
``frontend.engine_core.EngineCore`` runs the loop and ``frontend.async_engine.AsyncEngine``
serves asyncio callers from it; no request handler touches model state.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.runtime.model.checkpoint import Checkpoint
from engines.runtime.core.grammar import GrammarCompiler, GrammarError
from engines.runtime.core.kv_pool import KVCachePool
from engines.runtime.core.kv_sizing import resolve_kv_cache_size
from engines.runtime.core.kv_transfer import KVBlock, KVReceipt, KVReceiver, KVSend, KVTransferError, \
    ModelIdentity, resolve_window_end
from engines.runtime.core.limits import REQUEST_LIMITS
from engines.runtime.telemetry.metrics import EngineMetrics, RecentRequest, RequestMetrics
from engines.runtime.model.llama import ForwardBatch, LlamaModel
from engines.runtime.core.request import (
    ChoiceDelta,
    EngineRequestError,
    FinishReason,
    GenerationRequest,
    GrammarMode,
    RequestOutput,
    RequestState,
    Sequence,
)
from engines.runtime.core.sampler import InvalidSamplingParams, Sampler, SamplingParams, SamplingState, TokenLogprob
from engines.runtime.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engines.runtime.core.stop_checker import StopChecker
from engines.runtime.core.warm_up import warm_up
from engines.runtime.telemetry.profiler import ProfiledBackend, ProfileResult, ProfilerStateError, ProfileStatus, \
    StepProfiler, measure_host_bandwidth
from engines.runtime.telemetry.trace_recorder import TraceRecorder

logger = logging.getLogger("engines.runtime")

__all__ = ["Engine", "EngineConfig", "validate_request"]


@dataclass
class EngineConfig:
    """Engine sizing, fixed at start-up."""

    max_num_seqs: int = 64
    # The KV cache's size, one of three ways, or none: sized for the model (core.kv_sizing).
    num_pages: int | None = None
    max_total_tokens: int | None = None
    kv_cache_bytes: int | None = None
    page_size: int = 16
    prefill_chunk_size: int = 512
    max_trace_events: int = 1_000_000
    enable_prefix_cache: bool = True


@dataclass
class ModelOutput:
    """What ``Engine._execute`` hands ``Engine._update``: one row per chunk that samples.

    Exactly one of ``token_ids`` (int32 ``[len(sampled)]``: every row was greedy, so the
    argmax ran on the device and only ids came back) and ``logits`` (``[len(sampled),
    vocab_size]``, for the sampler) is set.
    """

    sampled: list[ScheduledChunk]
    token_ids: np.ndarray | None = None
    logits: np.ndarray | None = None


def _disagg_half(request: GenerationRequest) -> str | None:
    """Which half of a disaggregated request this is, for the dashboard's table (None: not one)."""
    if request.kv_send is not None:
        end = resolve_window_end(request.kv_send.end, len(request.prompt))
        return f"prefill, sent KV [{request.kv_send.begin}:{end}]"
    if request.kv_window_begin is not None:
        return f"decode, KV [0:{request.kv_window_begin}] received"
    return None


def validate_request(request: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """Raise :class:`EngineRequestError` if no engine of this vocabulary and context could serve
    ``request`` (cheap, any thread or process: it reads only the request)."""
    if not request.request_id or len(request.request_id) > REQUEST_LIMITS.max_request_id_chars:
        raise EngineRequestError(f"the request id must be 1 to {REQUEST_LIMITS.max_request_id_chars} characters, "
                                 f"got {len(request.request_id)}")
    if not request.prompt:
        raise EngineRequestError("the prompt is empty: send at least one token")
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineRequestError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    try:
        request.sampling.check_vocab(vocab_size)
    except InvalidSamplingParams as e:
        raise EngineRequestError(str(e)) from e
    if len(request.prompt) >= max_seq_len:
        raise EngineRequestError(
            f"the prompt has {len(request.prompt)} tokens; this engine's context holds at most "
            f"{max_seq_len} tokens including the output. Shorten the prompt."
        )
    max_tokens = request.sampling.max_tokens
    if max_tokens is not None and len(request.prompt) + max_tokens > max_seq_len:
        # Refused up front, as OpenAI and vLLM do, rather than silently cut short.
        raise EngineRequestError(
            f"this engine's context holds {max_seq_len} tokens, but the request asks for "
            f"{len(request.prompt) + max_tokens} ({len(request.prompt)} in the prompt, {max_tokens} "
            f"for the completion). Lower max_tokens to at most {max_seq_len - len(request.prompt)}, "
            f"or leave it unset to generate until the context is full."
        )


class Engine:
    """One model's continuous-batching engine; single-threaded (the AsyncEngine thread owns it).

    Args:
        model: the model, weights already on its backend.
        checkpoint: tokenizer, EOS ids and name come from here.
        config: sizing.
        tracer: the event recorder, or ``None`` when tracing is off (each seam checks it
            before building any event, so a disabled trace costs one comparison there).
    """

    def __init__(self, model: LlamaModel, checkpoint: Checkpoint, config: EngineConfig | None = None,
                 tracer: TraceRecorder | None = None) -> None:
        self.model = model
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.config = config or EngineConfig()
        self.tracer = tracer
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(checkpoint.eos_token_ids)
        c = self.config
        self.kv_size = resolve_kv_cache_size(
            page_size=c.page_size, bytes_per_token=model.kv_bytes_per_token, num_pages=c.num_pages,
            max_total_tokens=c.max_total_tokens, kv_cache_bytes=c.kv_cache_bytes, weight_bytes=model.weight_bytes,
            context_length=model.config.max_position_embeddings, max_num_seqs=c.max_num_seqs,
            free_memory_bytes=model.backend.free_memory_bytes())
        num_pages = self.kv_size.num_pages
        self.kv = model.new_kv_cache(num_pages, self.config.page_size)
        self.kv_pool = KVCachePool(num_pages, self.config.page_size, self.config.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv_pool, self.config.max_num_seqs, self.config.prefill_chunk_size)
        self.sampler = Sampler(self.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer.tokenizer_json, self.vocab_size, checkpoint.eos_token_ids)
        self.metrics = EngineMetrics()
        self.requests: dict[str, RequestState] = {}
        # A sequence can never hold more tokens than the pool or the position table.
        self.max_seq_len = min(num_pages * self.config.page_size, model.config.max_position_embeddings)
        self.num_steps = 0
        # The running profile (None when none runs: one check per step seam), and one that
        # stopped by itself and waits for stop_profile().
        self.profiler: StepProfiler | None = None
        self._stopped_profile: StepProfiler | None = None
        self._plain_backend = model.backend
        self._peak_bandwidth: tuple[float | None, str] | None = None
        self._identity: ModelIdentity | None = None
        # Disaggregated serving's receive side: pages reserved for K/V another engine sends.
        self.kv_receiver = KVReceiver(self.kv_pool, self.kv, lambda: self.model_identity, tracer)
        self._update_gauges()

    # ------------------------------------------------------------------ requests

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`EngineRequestError` if the request cannot be served (cheap)."""
        if request.request_id in self.requests:
            raise EngineRequestError(f"request id {request.request_id!r} is already running")
        validate_request(request, self.vocab_size, self.max_seq_len)

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a validated request; raises :class:`EngineRequestError` for a bad one.

        Engine thread only (the prefix cache is read). Nothing changes when it raises.
        """
        self.validate(request)
        room = self.kv_pool.capacity(request.prompt)
        if len(request.prompt) > room:
            # Pins only go at reset, so this prompt would never be scheduled.
            raise EngineRequestError(
                f"the prompt has {len(request.prompt)} tokens but only {room} fit in the KV cache beside "
                f"the pinned system prompts ({self.kv_pool.num_pinned_pages} pages). Shorten the prompt, "
                f"or reset the engine to unpin them."
            )
        kv_send = self._check_kv_send(request)
        try:
            grammar = self.grammars.compile(request.response_format)
        except GrammarError as e:
            raise EngineRequestError(f"response_format: {e}") from e
        if request.kv_window_begin is not None:  # last check: adopting takes the reservation
            received = self.kv_receiver.adopt(request.request_id, request.prompt, request.kv_window_begin,
                                              request.sampling.n)
        state = RequestState(request, time.perf_counter())
        max_output = self.max_seq_len - len(request.prompt)
        for index in range(1 if kv_send else request.sampling.n):
            seq = Sequence(state, index, request.prompt[:kv_send.end] if kv_send else request.prompt)
            seq.kv_send = kv_send
            seq.sampling = SamplingState(request.sampling, self.vocab_size, request.prompt, index)
            seq.detokenizer = self.tokenizer.detokenizer()
            seq.stop_checker = StopChecker.from_params(request.sampling, self.eos_token_ids, max_output)
            if grammar is not None:
                seq.grammar = grammar.matcher()
            state.sequences.append(seq)
        # Queued only once every choice is built, so a failure above leaves no orphan sequence.
        if request.kv_window_begin is not None:
            self.kv_pool.rename(received.pool_id, state.sequences[0].seq_id)
        for seq in state.sequences:
            self.scheduler.add(seq)
        self.requests[request.request_id] = state
        if self.tracer is not None:
            self.tracer.add_event(request.request_id, "request added to engine",
                                  {"prompt_tokens": len(request.prompt)})
            self.tracer.add_event(request.request_id, "start queue")
        self._update_gauges()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (finish reason ``abort``), or None if unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if not seq.finished:
                self._finish_sequence(seq, FinishReason.ABORT)
        out = self._collect_output(state)
        self._update_gauges()
        return out

    def _check_kv_send(self, request: GenerationRequest) -> KVSend | None:
        """A ``remote_send`` request's window with its end resolved (MLC forces ``n = 1`` there)."""
        send = request.kv_send
        if send is None:
            return None
        end = resolve_window_end(send.end, len(request.prompt))
        if not 0 <= send.begin < end:
            raise KVTransferError(f'"begin >= end" is not supported by remote prefill (begin {send.begin}, '
                                  f"end {end} on a prompt of {len(request.prompt)} tokens)")
        return dataclasses.replace(send, end=end)

    # ------------------------------------------------------- disaggregated serving

    @property
    def model_identity(self) -> ModelIdentity:
        """What another engine must share with this one to exchange K/V (computed once)."""
        if self._identity is None:
            self._identity = ModelIdentity.of(self.checkpoint, self.model.config, self.kv.dtype,
                                              self.config.page_size)
        return self._identity

    def prepare_receive(self, request_id: str, prompt: list[int], end: int,
                        timeout_s: float = 60.0) -> KVReceipt:
        """Reserve pages for the K/V of ``prompt[:end]`` another engine will send (MicroServing's
        ``prep_recv``); released after ``timeout_s`` if no ``start_generation`` took them."""
        if request_id in self.requests:
            raise KVTransferError(f"request id {request_id!r} is already running on this engine")
        validate_request(GenerationRequest(request_id, prompt, SamplingParams()), self.vocab_size,
                         self.max_seq_len)
        receipt = self.kv_receiver.prepare(request_id, prompt, end, timeout_s, time.monotonic())
        self._update_gauges()
        return receipt

    def receive_kv(self, block: KVBlock) -> None:
        """Store K/V another engine computed into the pages ``prepare_receive`` reserved."""
        try:
            self.kv_receiver.receive(block)
        finally:
            self._update_gauges()

    def release_receive(self, request_id: str, ticket: str | None = None) -> bool:
        """Give up a reservation (its transfer failed elsewhere); False when there was none, or
        ``ticket`` names another one."""
        released = self.kv_receiver.release(request_id, "released", ticket)
        self._update_gauges()
        return released

    def expire_receives(self) -> None:
        """Free the reservations no ``start_generation`` took in time (the loop calls it)."""
        if self.kv_receiver.reservations and self.kv_receiver.expire(time.monotonic()):
            self._update_gauges()

    def _send_kv(self, seq: Sequence) -> None:
        """A ``remote_send`` sequence computed its window: copy the K/V out and end it."""
        send = seq.kv_send
        k, v = self.kv.read_tokens(self.kv_pool.pages(seq.seq_id), send.begin, send.end,
                                   on_device=send.on_device and self.model.backend_name == "cuda")
        block = KVBlock(seq.request.request_id, send.ticket, send.begin, send.end, self.model_identity, k, v)
        seq.request.kv_block = block
        if self.tracer is not None:
            self.tracer.add_event(seq.request.request_id, "kv send", {
                "begin": send.begin, "end": send.end, "bytes": block.nbytes,
                "device": not isinstance(k, np.ndarray)})
        self._finish_sequence(seq, FinishReason.STOP, flush=False)

    def reset(self, clear_trace: bool = False) -> list[RequestOutput]:
        """Abort everything, free all KV pages and the prefix cache (pinned too), zero every metric."""
        outputs = [o for rid in list(self.requests) if (o := self.abort_request(rid)) is not None]
        self.kv_receiver.clear()
        self.scheduler.clear()
        self.kv_pool.reset()
        self.metrics.reset()
        if clear_trace and self.tracer is not None:
            self.tracer.clear()
        self._update_gauges()
        return outputs

    def live_requests(self) -> list[dict[str, Any]]:
        """The requests in the engine now, oldest first: waiting for their first step, in their
        prefill, or decoding (JSON-ready). Safe from any thread, mid-step included (a reader of
        plain fields; a request that ends meanwhile may still show)."""
        now = time.perf_counter()
        out = []
        for state in list(self.requests.values()):  # a copy taken in one go under the GIL
            phase = ("waiting" if state.first_scheduled_time is None
                     else "prefill" if state.first_token_time is None else "decode")
            out.append({
                "request_id": state.request_id, "phase": phase, "prompt_tokens": len(state.request.prompt),
                "output_tokens": sum(seq.num_output_tokens for seq in state.sequences), "n": len(state.sequences),
                "age_s": now - state.arrival_time,
                "ttft_s": None if state.first_token_time is None else state.first_token_time - state.arrival_time,
                "disagg": _disagg_half(state.request),
            })
        return out

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running (``step`` has something to do)."""
        return self.scheduler.has_work

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) every kernel a request, a profile or a trace export
        can reach, before any request (``core.warm_up``); leaves the engine as it found it."""
        warm_up(self)

    # ------------------------------------------------------------------- profiling

    def start_profile(self, max_steps: int | None = None, max_seconds: float = 60.0,
                      stack_sampling: bool = False) -> ProfileStatus:
        """Profile the next steps (every kernel launch and step seam timed) until
        :meth:`stop_profile`, ``max_steps`` steps or ``max_seconds``; between steps only.
        A profile already running (or stopped and not yet taken) is a :class:`ProfilerStateError`."""
        if self.profiler is not None:
            raise ProfilerStateError("a profile is already running: stop it first")
        if self._stopped_profile is not None:
            raise ProfilerStateError("a finished profile has not been taken yet: stop it first")
        profiler = StepProfiler(max_steps=max_steps, max_seconds=max_seconds, stack_sampling=stack_sampling)
        if self._peak_bandwidth is None:
            self._peak_bandwidth = self._measure_peak()
        self.model.use_backend(ProfiledBackend(self._plain_backend, profiler))
        self.profiler = profiler
        return profiler.status()

    def profile_status(self) -> ProfileStatus:
        """Where the profiler stands; safe from any thread."""
        profiler = self.profiler or self._stopped_profile
        return profiler.status() if profiler is not None else ProfileStatus(running=False)

    def stop_profile(self, engine_name: str = "engine") -> ProfileResult:
        """End the profile (or take the one that stopped by itself) and summarise it; between
        steps only. None to stop is a :class:`ProfilerStateError`."""
        if self.profiler is not None:
            self._end_profile()
        profiler, self._stopped_profile = self._stopped_profile, None
        if profiler is None:
            raise ProfilerStateError("no profile is running: start one first")
        peak, source = self._peak_bandwidth or (None, "")
        model = self.model
        return profiler.result(engine=engine_name, model=self.checkpoint.name, backend=model.backend_name,
                               device=self._device_name(), peak_gbs=peak, peak_source=source,
                               config=self.describe())

    def _end_profile(self) -> None:
        profiler, self.profiler = self.profiler, None
        self.model.use_backend(self._plain_backend)
        assert profiler is not None
        profiler.finish("request")  # no-op when it ended by itself
        self._stopped_profile = profiler

    def _measure_peak(self) -> tuple[float | None, str]:
        """The memory bandwidth kernels are compared with: the GPU's spec, or this host's read rate."""
        if self.model.backend_name != "cuda":
            return measure_host_bandwidth(), "measured"
        from numba import cuda

        try:
            device = cuda.get_current_device()
            clock_khz, bus_bits = device.MEMORY_CLOCK_RATE, device.GLOBAL_MEMORY_BUS_WIDTH
        except Exception:  # noqa: BLE001 - the simulator has no such attributes
            return None, ""
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device"

    def _device_name(self) -> str:
        if self.model.backend_name == "cuda":
            from numba import cuda

            try:
                name = cuda.get_current_device().name
                return name.decode() if isinstance(name, bytes) else str(name)
            except Exception:  # noqa: BLE001 - the simulator
                return "cuda (simulator)"
        return f"cpu ({os.cpu_count()} cores)"

    def describe(self) -> dict[str, Any]:
        """The engine's configuration as plain data: what a profile was taken on."""
        import numba

        return {
            "checkpoint": self.checkpoint.name, "backend": self.model.backend_name, "dtype": self.model.dtype,
            **dataclasses.asdict(self.model.config),
            **{f"engine_{k}": v for k, v in dataclasses.asdict(self.config).items()},
            "numba": numba.__version__,
        }

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, execute the model once, update from its output.

        Returns what the requests this step changed have to report (new text, finish reasons, usage).
        """
        prof = self.profiler
        if prof is not None:
            prof.begin_step()
        sched = self._schedule()
        if prof is not None:
            prof.lap("schedule")
        touched = [seq.request for seq in sched.out_of_pages + sched.preempted if seq.finished]
        if sched.chunks:
            t0 = time.perf_counter()
            output = self._execute(sched)
            touched += self._update(sched, output)
            self.metrics.on_step(time.perf_counter() - t0, prefill_tokens=sched.num_prefill_tokens,
                                 decode_seqs=sched.num_decode_seqs)
        outputs = self._outputs(touched)
        if prof is not None:
            prof.lap("outputs")
            if prof.end_step(len(sched.chunks), sched.num_tokens, sched.num_prefill_tokens):
                self._end_profile()
        return outputs

    # ------------------------------------------------------------------ schedule

    def _schedule(self) -> SchedulerOutput:
        """This step's chunks, from the scheduler; the engine's side of admission and preemption.

        Stamps each request's first admission, pins system prompts as they are admitted, counts
        preemptions, and ends (``length``) the sequences the pool can never hold.
        """
        sched = self.scheduler.schedule()
        if self.tracer is not None:
            self._trace_schedule(sched)  # first, while first_scheduled_time still tells a first admission
        now = time.perf_counter()
        for seq in sched.admitted:
            state = seq.request
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
            if state.request.pin_system_prompt and seq.index == 0:
                self.kv_pool.pin(seq.seq_id, state.request.system_prompt_tokens or len(state.request.prompt))
        for seq in sched.preempted:
            self.metrics.on_preemption()
            if seq.kv_send is not None or seq.request.request.kv_window_begin is not None:
                # As MLC: a disaggregated request is not recomputed here; the router retries it.
                self._finish_sequence(seq, FinishReason.PREEMPT)
        for seq in sched.out_of_pages:
            # As at the context limit: the pool, less its pinned pages, is this sequence's limit.
            logger.warning("request %s: the KV cache, less its %d pinned pages, cannot hold the %d tokens of "
                           "choice %d; it ends with 'length'. Reset the engine to unpin system prompts, or "
                           "start it with more pages.", seq.request.request_id, self.kv_pool.num_pinned_pages,
                           len(seq.token_ids), seq.index)
            self._finish_sequence(seq, FinishReason.LENGTH)
        return sched

    def _trace_schedule(self, sched: SchedulerOutput) -> None:
        """The schedule seam's events: queue spans that close, what each admission got, preemptions."""
        tracer = self.tracer
        dequeued: set[str] = set()  # the choices of one request leave its queue span once
        for seq in sched.admitted:
            rid = seq.request.request_id
            if seq.request.first_scheduled_time is None and rid not in dequeued:
                dequeued.add(rid)
                tracer.add_event(rid, "finish queue")
            # What the prefix cache gave back and what the pool handed out.
            tracer.add_event(rid, "kv cache admit", {"cached_tokens": seq.num_cached_prefix_tokens,
                                                     "pages": len(self.kv_pool.pages(seq.seq_id))})
        for seq in sched.preempted:
            tracer.add_event(seq.request.request_id, "preempt")

    # ------------------------------------------------------------------- execute

    def _execute(self, sched: SchedulerOutput) -> ModelOutput:
        """The forward pass over every scheduled chunk: writes their K/V and returns a row per
        chunk that samples (token ids when every such row is greedy, else logits)."""
        self.num_steps += 1
        chunks = sched.chunks
        # Plain lists, then one array each: right after a step has streamed the weights through
        # the caches every NumPy call is slow, and these were five more (57-61 -> 32 us a batch-1 step,
        # outside the forward pass).
        token_ids: list[int] = []
        starts = [0]
        for c in chunks:
            token_ids += c.seq.token_ids[c.start:c.start + c.num_tokens]
            starts.append(starts[-1] + c.num_tokens)
        batch = ForwardBatch(
            token_ids=np.array(token_ids, dtype=np.int32),
            query_starts=np.array(starts, dtype=np.int32),
            cached_lens=np.array([c.start for c in chunks], dtype=np.int32),
            page_table=self.kv_pool.page_table([c.seq.seq_id for c in chunks]),
        )
        rows = [i for i, c in enumerate(chunks) if c.samples]
        sampled = [chunks[i] for i in rows]
        # Argmax on the device when no row needs its logits: only token ids come back.
        greedy = not any(c.seq.grammar is not None or not c.seq.request.params.is_greedy
                         or c.seq.request.params.logprobs or c.seq.sampling.modifies_logits for c in sampled)
        tracer, prof = self.tracer, self.profiler
        if tracer is not None:
            # Each request's lane gets its own chunk's phase (a decode riding along a prefill step is
            # a decode there); the engine lane gets the step's (prefill if any chunk prefills).
            kind = "prefill" if sched.num_prefill_tokens else "decode"
            prefill_ids = [c.seq.request.request_id for c in chunks if c.prefills]
            decode_ids = [c.seq.request.request_id for c in chunks if not c.prefills]
            step_args = {"batch_size": len(chunks)}
            tracer.add_event(prefill_ids, "start prefill", step_args, engine_lane=kind == "prefill")
            tracer.add_event(decode_ids, "start decode", step_args, engine_lane=kind == "decode")
        if prof is not None:
            prof.lap("prepare")
        result = (self.model.forward_greedy if greedy else self.model.forward)(batch, self.kv)
        if prof is not None:
            prof.lap("forward")
        if tracer is not None:
            step_args = {"tokens": sched.num_tokens}
            tracer.add_event(prefill_ids, "finish prefill", step_args, engine_lane=kind == "prefill")
            tracer.add_event(decode_ids, "finish decode", step_args, engine_lane=kind == "decode")
        if len(rows) < len(chunks):  # some chunks end mid-prompt: keep the sampling rows
            result = result[rows]
        if greedy:
            return ModelOutput(sampled, token_ids=result)
        return ModelOutput(sampled, logits=result)

    # -------------------------------------------------------------------- update

    def _update(self, sched: SchedulerOutput, output: ModelOutput) -> list[RequestState]:
        """Everything after the forward pass: commit the K/V it wrote, pick a token per sampling row
        (grammar masks, sampler), append it (stop rules, detokenization); returns the requests with news."""
        prof = self.profiler
        self._commit(sched.chunks)
        sent = [c.seq for c in sched.chunks if c.seq.kv_send is not None and c.completes]
        for seq in sent:
            self._send_kv(seq)
        if prof is not None:
            prof.lap("commit")
        picks = self._pick_tokens(output)
        if prof is not None:
            prof.lap("sampling")
        self._append_picks(output.sampled, picks)
        if prof is not None:
            prof.lap("detokenization")
        return [c.seq.request for c in output.sampled] + [seq.request for seq in sent]

    def _commit(self, chunks: list[ScheduledChunk]) -> None:
        """The forward pass wrote these chunks' K/V: the pool caches their full pages, the
        sequences and requests count the tokens as computed."""
        for chunk in chunks:
            seq = chunk.seq
            self.kv_pool.commit(seq.seq_id, seq.token_ids[chunk.start:chunk.start + chunk.num_tokens])
            seq.num_computed = chunk.start + chunk.num_tokens
            if chunk.is_prefill:
                seq.request.prefill_tokens += chunk.num_tokens
            else:
                seq.request.decode_tokens += chunk.num_tokens

    def _pick_tokens(self, output: ModelOutput) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """(token, logprob) per sampling row: the device's argmax, or the sampler's draw under the
        row's grammar mask.

        A row whose grammar failed to give a mask gets the exception instead: that request fails
        alone (``_update``), the rest of the batch samples as usual.
        """
        if output.token_ids is not None:
            return [(int(t), None) for t in output.token_ids]
        sampled = output.sampled
        masks, failures = self._grammar_masks(sampled)
        if self.profiler is not None:
            self.profiler.lap("grammar")
        tracer = self.tracer
        if tracer is not None:
            sample_ids = [c.seq.request.request_id for c in sampled]
            tracer.add_event(sample_ids, "start sampling")
        picked = self.sampler.sample(output.logits, [c.seq.sampling for c in sampled], masks)
        if tracer is not None:
            tracer.add_event(sample_ids, "finish sampling")
        return [failures[i] if i in failures
                else (int(picked.token_ids[i]), picked.logprobs[i] if picked.logprobs else None)
                for i in range(len(sampled))]

    def _grammar_masks(self, sampled: list[ScheduledChunk]) -> tuple[list[np.ndarray | None], dict[int, Exception]]:
        """Each row's allowed next tokens (``None``: no grammar), and the rows whose grammar failed."""
        masks: list[np.ndarray | None] = [None] * len(sampled)
        failures: dict[int, Exception] = {}
        grammar_rows = [i for i, c in enumerate(sampled) if c.seq.grammar is not None]
        if not grammar_rows:
            return masks, failures
        tracer = self.tracer
        if tracer is not None:
            grammar_ids = [sampled[i].seq.request.request_id for i in grammar_rows]
            tracer.add_event(grammar_ids, "start apply logit mask")
        rows_mask = np.empty((len(grammar_rows), self.vocab_size), dtype=np.bool_)
        for j, i in enumerate(grammar_rows):
            try:
                sampled[i].seq.grammar.fill_mask(rows_mask[j])
                if not rows_mask[j].any():  # the sampler would fail the whole batch on this row
                    raise GrammarError("the grammar allows no next token")
            except Exception as e:  # noqa: BLE001 - fails this request alone; its row samples unmasked, unused
                failures[i] = e
                continue
            masks[i] = rows_mask[j]
        if tracer is not None:
            tracer.add_event(grammar_ids, "finish apply logit mask")
        return masks, failures

    def _append_picks(self, sampled: list[ScheduledChunk],
                      picks: list[tuple[int, TokenLogprob | None] | Exception]) -> None:
        """Give each sampling choice its token: stop rules, detokenization, jump-forward, failures."""
        now = time.perf_counter()
        gaps = []
        tracer = self.tracer
        if tracer is not None and sampled:
            # MLC's name for the streamer's work: text deltas, stop strings, grammar state.
            sampled_ids = [c.seq.request.request_id for c in sampled]
            tracer.add_event(sampled_ids, "start detokenization")
        for chunk, picked in zip(sampled, picks):
            seq = chunk.seq
            if isinstance(picked, Exception):
                self._fail_sequence(seq, picked)
                continue
            if seq.last_token_time is not None:
                gaps.append(now - seq.last_token_time)
            seq.last_token_time = now
            try:
                self._append_sampled(seq, *picked)
            except Exception as e:  # noqa: BLE001 - a grammar or tokenizer error fails its request, not the engine
                self._fail_sequence(seq, e)
        if tracer is not None and sampled:
            tracer.add_event(sampled_ids, "finish detokenization")
        self.metrics.on_token_gaps(gaps)

    def _append_sampled(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Add a sampled token (and any tokens the grammar then forces) and check every stop rule."""
        state = seq.request
        now = time.perf_counter()
        if state.first_token_time is None:
            state.first_token_time = now
            self.metrics.on_first_token(now - state.arrival_time)
            if self.tracer is not None:
                self.tracer.add_event(state.request_id, "first token")
        if self._accept_token(seq, token, logprob) or seq.grammar is None:
            return
        # As MLC: jump-forward only when asked (the default) and no logprobs are wanted,
        # since forced tokens are never sampled and so have none.
        if state.request.grammar_mode is GrammarMode.CONSTRAINT or state.params.logprobs:
            return
        forced = seq.grammar.forced_tokens()
        if not forced:
            return
        t0 = time.perf_counter()
        budget = self._remaining_tokens(seq)
        forced = forced[:budget]
        seq.sampling.record_output(forced)
        accepted = 0
        for t in forced:
            accepted += 1
            if self._accept_token(seq, t, None):
                break  # a stop rule fired: the rest of the run is never output, so not counted
        state.jump_forward_tokens += accepted
        self.metrics.on_jump_forward(time.perf_counter() - t0, accepted)
        if self.tracer is not None:
            self.tracer.add_event(state.request_id, "jump forward", {"tokens": accepted})

    def _remaining_tokens(self, seq: Sequence) -> int:
        """Output tokens the choice may still add before max_tokens or the context ends it."""
        limit = self.max_seq_len - len(seq.token_ids)
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens)
        return max(limit, 0)

    def _accept_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """Append one output token; finish the choice if a stop rule fires. Returns True if finished."""
        seq.token_ids.append(token)
        seq.pending_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        if seq.grammar is not None and token not in self.eos_token_ids:
            seq.grammar.consume([token])
        if seq.stop_checker.is_stop_token(token):
            # Its own text is never output, so the detokenizer never sees it; what the
            # tokens before it held back (an unfinished byte-fallback run) is complete now.
            text = seq.detokenizer.finish()
        else:
            text = seq.detokenizer.add(token)
        check = seq.stop_checker.step(token, text)
        seq.pending_text += check.text
        if check.finish_reason is FinishReason.STOP:
            # Nothing to flush: the stop token took the rest, and what follows a stop string is dropped.
            self._finish_sequence(seq, FinishReason.STOP, flush=False)
            return True
        # Before the length limit: output the grammar completes on its last allowed
        # token is whole, and "length" would tell the client it was cut.
        if seq.grammar is not None and seq.grammar.is_finished():
            self._finish_sequence(seq, FinishReason.STOP)
            return True
        if check.finish_reason is not None:
            self._finish_sequence(seq, check.finish_reason)  # the last token: what the detokenizer holds is whole
            return True
        return False

    def _fail_sequence(self, seq: Sequence, error: Exception) -> None:
        """Abort a choice whose update raised (grammar, tokenizer); the engine serves on."""
        rid = seq.request.request_id
        logger.error("request %s (choice %d) failed and is aborted: %r", rid, seq.index, error, exc_info=error)
        if self.tracer is not None:
            self.tracer.add_event(rid, "request error", {"error": f"{type(error).__name__}: {error}"})
        # No flush: the detokenizer or stop checker may be what failed.
        if not any(s.finished for s in seq.request.sequences):  # a request fails once, whatever its choices
            self.metrics.on_request_failed()
        self._finish_sequence(seq, FinishReason.ABORT, flush=False)

    def _finish_sequence(self, seq: Sequence, reason: FinishReason, flush: bool = True) -> None:
        """End a choice. ``flush``: no stop rule cut the text (grammar done, length, abort), so
        held-back text is output."""
        if seq.finished:
            return
        if flush:
            seq.pending_text += seq.stop_checker.flush() + seq.detokenizer.finish()
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        state = seq.request
        if state.finished:
            state.finish_time = time.perf_counter()
            del self.requests[state.request_id]

    # ------------------------------------------------------------------- outputs

    def _outputs(self, touched: list[RequestState]) -> list[RequestOutput]:
        """What the requests this step changed have to report, in the order they were touched;
        refreshes the gauges."""
        outputs = [o for state in dict.fromkeys(touched) if (o := self._collect_output(state)) is not None]
        self._update_gauges()
        return outputs

    def _collect_output(self, state: RequestState) -> RequestOutput | None:
        """Turn what each choice produced since the last output into deltas (and usage when done)."""
        choices = []
        for seq in state.sequences:
            reason_now = seq.finish_reason if seq.finished and not seq.finish_reported else None
            if not seq.pending_ids and not seq.pending_text and reason_now is None:
                continue
            choices.append(ChoiceDelta(
                index=seq.index,
                text=seq.pending_text,
                token_ids=seq.pending_ids,
                logprobs=seq.pending_logprobs if state.params.logprobs else None,
                finish_reason=reason_now,
            ))
            seq.pending_ids, seq.pending_text, seq.pending_logprobs = [], "", []
            if reason_now is not None:
                seq.finish_reported = True
        usage = None
        if state.finished:
            usage = self._finish_request(state)
        if not choices and usage is None:
            return None
        return RequestOutput(state.request_id, choices, usage, state.kv_block if usage is not None else None)

    def _finish_request(self, state: RequestState) -> dict[str, Any]:
        """Account for a request whose every choice ended (metrics, trace); returns its usage."""
        completion = sum(s.num_output_tokens for s in state.sequences)
        prompt = len(state.request.prompt)
        aborted = all(s.finish_reason is FinishReason.ABORT for s in state.sequences)
        rm = RequestMetrics(
            prompt_tokens=prompt,
            completion_tokens=completion,
            prefill_tokens=state.prefill_tokens,
            decode_tokens=state.decode_tokens,
            jump_forward_tokens=state.jump_forward_tokens,
            add_time=state.arrival_time,
            first_scheduled_time=state.first_scheduled_time,
            first_token_time=state.first_token_time,
            finish_time=state.finish_time or time.perf_counter(),
        )
        if not aborted:
            self.metrics.on_request_finished(rm)
        # One reason, or the choices' several ("length,stop"); a plain str either way.
        finish_reason = ",".join(sorted({s.finish_reason for s in state.sequences}))
        extra = rm.as_usage_extra()
        self.metrics.on_request_ended(RecentRequest(
            request_id=state.request_id, finish_reason=finish_reason, prompt_tokens=prompt,
            completion_tokens=completion,
            queue_s=rm.queue_time_s if state.first_scheduled_time is not None else None,
            ttft_s=rm.ttft_s if state.first_token_time is not None else None,
            decode_tokens_per_s=extra.get("decode_tokens_per_s"), end_to_end_s=rm.end_to_end_latency_s,
            finished_at=time.time(), disagg=_disagg_half(state.request)))
        if self.tracer is not None:
            if state.first_scheduled_time is None:  # aborted or dropped while waiting
                self.tracer.add_event(state.request_id, "finish queue")
            self.tracer.add_event(state.request_id, "finish", {
                "finish_reason": finish_reason,
                "prompt_tokens": prompt, "completion_tokens": completion,
                "prefill_tokens": state.prefill_tokens,
            })
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "extra": extra,
        }

    # ----------------------------------------------------------------- bookkeeping

    def _update_gauges(self) -> None:
        """Refresh the running/waiting and KV gauges after anything that may change them."""
        usage = self.kv_pool.usage()
        # Requests, not choices (a request has n). Counted from the running side, which is
        # bounded by max_num_seqs, where the waiting queue may be long: every other live
        # request waits, and a running one does too while a choice of its is unadmitted.
        # Plain loops: a Counter and generators cost ~19 us a step here, the caches cold after the
        # forward pass (~7 with these); a request of one choice needs no count of its choices.
        running: dict[str, int] = {}
        for seq in self.scheduler.running:
            rid = seq.request.request_id
            running[rid] = running.get(rid, 0) + 1
        waiting = len(self.requests) - len(running)
        for rid, n in running.items():
            choices = self.requests[rid].sequences
            if n < len(choices) and n < sum(not s.finished for s in choices):
                waiting += 1
        self.metrics.set_gauges(
            num_running_requests=len(running),
            num_waiting_requests=waiting,
            kv_pages_used=usage.used_pages,
            kv_pages_total=usage.total_pages,
            prefix_cache_hit_rate=usage.hit_rate,
        )

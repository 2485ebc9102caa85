"""The serving engine: a synchronous step loop (``Engine``).

``Engine.step()`` reads as three verbs, as in vLLM's engine core:

1. ``_schedule``: the scheduler picks this step's chunks (``SchedulerOutput``); the
   engine stamps admissions, pins system prompts, ends what can never fit.
2. execute: ``runner.execute`` (``core.model_runner``), one forward pass over those chunks
   (``ModelOutput``: greedy token ids computed on the device, or logits rows).
3. ``_update``: commit the K/V written, pick the tokens (``picker``, ``core.token_picker``:
   grammar masks and the sampler), append them (``appender``, ``core.token_appender``: the
   stop rules, the detokenizer, jump-forward); ``step`` then turns what changed into one
   ``RequestOutput`` per touched request (``outputs``, ``core.output_processor``).

Trace events and metrics hang off those seams. The engine is single-threaded:
``frontend.engine_core.EngineCore`` runs the loop and ``frontend.async_engine.AsyncEngine``
serves asyncio callers from it; no request handler touches model state.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import numpy as np

from engines.runtime.model.checkpoint import Checkpoint
from engines.runtime.core.disagg.receiver import KVReceiver
from engines.runtime.core.disagg.sender import KVSender
from engines.runtime.core.disagg.transfer import KVBlock, KVReceipt, KVTransferError, ModelIdentity
from engines.runtime.core.grammar import GrammarCompiler, GrammarError
from engines.runtime.core.kv_pool import KVCachePool
from engines.runtime.core.kv_sizing import resolve_kv_cache_size
from engines.runtime.core.model_runner import ModelOutput, ModelRunner
from engines.runtime.core.live_view import (DEFAULT_KV_ENTRIES, DEFAULT_LIVE_LIMIT, KVCacheDump, LiveRequests,
                                            dump_kv_cache, live_requests)
from engines.runtime.core.output_processor import OutputProcessor
from engines.runtime.core.profiler_control import ProfilerControl
from engines.runtime.core.prompt_logprobs import prompt_logprobs
from engines.runtime.telemetry.flight_recorder import Workload
from engines.runtime.telemetry.metrics import EngineMetrics
from engines.runtime.model.llama import LlamaModel
from engines.runtime.core.request import (
    EngineRequestError,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestState,
    Sequence,
    validate_request,
)
from engines.runtime.core.sampler import SamplingParams, SamplingState
from engines.runtime.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engines.runtime.core.profile_trigger import ProfileTrigger
from engines.runtime.core.anatomy import QueueClock
from engines.runtime.core.step_observer import StepObserver
from engines.runtime.core.stop_checker import StopChecker
from engines.runtime.core.token_appender import TokenAppender
from engines.runtime.core.token_picker import TokenPicker
from engines.runtime.telemetry.profiler import ProfileResult, ProfileStatus
from engines.runtime.telemetry.trace_recorder import TraceRecorder

logger = logging.getLogger("engines.runtime")

__all__ = ["Engine", "EngineConfig"]


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


class Engine:
    """One model's continuous-batching engine; single-threaded (the AsyncEngine thread owns it).

    Its jobs besides the step live in collaborators: ``runner`` (``ModelRunner``: the forward
    pass), ``picker`` (``TokenPicker``: grammar masks and sampling), ``appender``
    (``TokenAppender``: stop rules, detokenization, jump-forward), ``outputs``
    (``OutputProcessor``: ending choices, outputs, finished requests, gauges), ``profiling``
    (``ProfilerControl``), ``kv_sender`` and ``kv_receiver`` (disaggregated serving,
    ``core.disagg``); ``observer`` (``StepObserver``) watches the step's seams while tracing is
    on or a profile runs, and is None otherwise.

    Args:
        model: the model, weights already on its backend.
        checkpoint: tokenizer, EOS ids and name come from here.
        config: sizing.
        tracer: the event recorder, or ``None`` when tracing is off.
    """

    def __init__(self, model: LlamaModel, checkpoint: Checkpoint, config: EngineConfig | None = None,
                 tracer: TraceRecorder | None = None) -> None:
        self.model = model
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.config = c = config or EngineConfig()
        self._tracer = tracer
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(checkpoint.eos_token_ids)
        self.kv_size = resolve_kv_cache_size(
            page_size=c.page_size, bytes_per_token=model.kv_bytes_per_token, num_pages=c.num_pages,
            max_total_tokens=c.max_total_tokens, kv_cache_bytes=c.kv_cache_bytes, weight_bytes=model.weight_bytes,
            context_length=model.config.max_position_embeddings, max_num_seqs=c.max_num_seqs,
            free_memory_bytes=model.backend.free_memory_bytes())
        num_pages = self.kv_size.num_pages
        self.kv = model.new_kv_cache(num_pages, c.page_size)
        self.kv_pool = KVCachePool(num_pages, c.page_size, c.enable_prefix_cache)
        self.runner = ModelRunner(model, self.kv, self.kv_pool)
        self.scheduler = Scheduler(self.kv_pool, c.max_num_seqs, c.prefill_chunk_size)
        self.queue_clock = QueueClock()  # why the waiting queue waits (core.anatomy)
        self.picker = TokenPicker(self.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer.tokenizer_json, self.vocab_size, checkpoint.eos_token_ids)
        self.metrics = EngineMetrics()
        self.requests: dict[str, RequestState] = {}
        # A sequence can never hold more tokens than the pool or the position table.
        self.max_seq_len = min(num_pages * c.page_size, model.config.max_position_embeddings)
        self.num_steps = 0
        self.outputs = OutputProcessor(self.requests, self.scheduler, self.kv_pool, self.metrics, tracer)
        self.profiling = ProfilerControl(model, checkpoint.name, c)
        self.appender = TokenAppender(self.eos_token_ids, self.max_seq_len, self.metrics, self.profiling, self.outputs)
        self.observer = StepObserver.watching(tracer, None)
        self.kv_sender = KVSender(self.kv, self.kv_pool, lambda: self.model_identity, model.backend_name == "cuda")
        self.kv_receiver = KVReceiver(self.kv_pool, self.kv, lambda: self.model_identity, tracer)
        self.outputs.update_gauges()

    @property
    def tracer(self) -> TraceRecorder | None:
        """The event recorder, or None while tracing is off."""
        return self._tracer

    @tracer.setter
    def tracer(self, tracer: TraceRecorder | None) -> None:
        """Record into ``tracer`` from now on (None: stop recording; the warm-up's requests leave no lane)."""
        self._tracer = self.outputs.tracer = self.kv_receiver.tracer = tracer
        self.observer = StepObserver.watching(tracer, self.profiling.running)

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
        kv_send = self.kv_sender.check(request)
        try:
            grammar = self.grammars.compile(request.response_format)
        except GrammarError as e:
            raise EngineRequestError(f"response_format: {e}") from e
        if request.kv_window_begin is not None:  # last check: adopting takes the reservation
            received = self.kv_receiver.adopt(request.request_id, request.prompt, request.kv_window_begin,
                                              request.sampling.n)
        now = time.perf_counter()
        # Its life counts from its arrival at the server (one clock: docs/metrics.md), not from
        # here: the server hands it over between two steps, after its tokenizing; behind a router,
        # from its arrival there.
        arrival = now if request.arrival_time is None else min(request.arrival_time, now)
        state = RequestState(request, arrival - max(request.age_at_arrival_s, 0.0), added_time=now)
        state.anatomy.running_at_add = len(self.scheduler.running)
        state.anatomy.max_num_seqs = self.scheduler.max_num_seqs
        state.anatomy.clock_at_add = self.queue_clock.prefill_blocked_s
        max_output = self.max_seq_len - len(request.prompt)
        for index in range(1 if kv_send else request.sampling.n):
            seq = Sequence(state, index, request.prompt[:kv_send.end] if kv_send else request.prompt,
                           SamplingState(request.sampling, self.vocab_size, request.prompt, index),
                           self.tokenizer.detokenizer(),
                           StopChecker.from_params(request.sampling, self.eos_token_ids, max_output),
                           grammar.matcher() if grammar is not None else None)
            seq.kv_send = kv_send
            state.sequences.append(seq)
        # Queued only once every choice is built, so a failure above leaves no orphan sequence.
        if request.kv_window_begin is not None:
            self.kv_pool.rename(received.pool_id, state.sequences[0].seq_id)
        for seq in state.sequences:
            self.scheduler.add(seq)
        self.requests[request.request_id] = state
        if (armed := self.profiling.armed) is not None:
            armed.on_request(request.request_id, request.client_request_id, request.user)
        if self.observer is not None:
            self.observer.event(request.request_id, "request added to engine", {"prompt_tokens": len(request.prompt)})
            # The queue span opens at the arrival here (before the tokenizer's span): the queue time
            # less any age a router reported (the trace keeps each server's own time).
            self.observer.event(request.request_id, "start queue", at=arrival)
        self.outputs.update_gauges()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (finish reason ``abort``), or None if unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if not seq.finished:
                self.outputs.finish(seq, FinishReason.ABORT)
        out = self.outputs.collect(state)
        self.outputs.update_gauges()
        return out

    def live_requests(self, limit: int = DEFAULT_LIVE_LIMIT, with_text: bool = False) -> LiveRequests:
        """The requests in the engine now (``live_view.live_requests``); any thread, mid-step too.
        ``with_text``: each row's prompt start and output end as text (``serve --capture-text``)."""
        return live_requests(self.requests, self.scheduler, self.kv_pool, self.kv_receiver, self.max_seq_len, limit,
                             self.tokenizer.decode if with_text else None)

    def dump_workload(self, engine_name: str, with_text: bool = False) -> Workload:
        """The flight recorder's window: the last requests that ended, as a replayable workload
        (named ``engine_name``: the name it is served under); any thread. ``with_text``: their
        token ids and outputs too (``serve --capture-text``)."""
        return self.outputs.recorder.dump(engine_name, self.tokenizer.decode if with_text else None)

    def dump_kv_cache(self, max_entries: int = DEFAULT_KV_ENTRIES, with_text: bool = False) -> KVCacheDump:
        """The KV cache opened (``live_view.dump_kv_cache``); any thread, mid-step too. ``with_text``:
        each prefix-cache entry's first words (``serve --capture-text``)."""
        return dump_kv_cache(self.kv_pool, self.requests, self.scheduler.num_preemptions, max_entries,
                             self.tokenizer.decode if with_text else None)

    def reset(self, clear_trace: bool = False) -> list[RequestOutput]:
        """Abort everything, free all KV pages and the prefix cache (pinned too), zero every metric."""
        outputs = [o for rid in list(self.requests) if (o := self.abort_request(rid)) is not None]
        self.kv_receiver.clear()
        self.scheduler.clear()
        self.kv_pool.reset()
        self.metrics.reset()
        self.outputs.recorder.clear()
        if clear_trace and self.tracer is not None:
            self.tracer.clear()
        self.outputs.update_gauges()
        return outputs

    def reset_prefix_cache(self) -> dict[str, int]:
        """Empty the prefix cache, pinned pages aside, and nothing else (vLLM's route of that name;
        ``KVCachePool.reset_prefix_cache``): requests run on. Returns the cached pages dropped and
        the pinned pages kept."""
        dropped = self.kv_pool.reset_prefix_cache()
        self.outputs.update_gauges()
        return {"dropped_pages": dropped, "pinned_pages": self.kv_pool.num_pinned_pages}

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running (``step`` has something to do)."""
        return self.scheduler.has_work

    # ------------------------------------------------------- disaggregated serving

    @functools.cached_property
    def model_identity(self) -> ModelIdentity:
        """What another engine must share with this one to exchange K/V (computed once)."""
        return ModelIdentity.of(self.checkpoint, self.model.config, self.kv.dtype, self.config.page_size)

    def prepare_receive(self, request_id: str, prompt: list[int], end: int,
                        timeout_s: float = 60.0) -> KVReceipt:
        """Reserve pages for the K/V of ``prompt[:end]`` another engine will send (MicroServing's
        ``prep_recv``); released after ``timeout_s`` if no ``start_generation`` took them."""
        if request_id in self.requests:
            raise KVTransferError(f"request id {request_id!r} is already running on this engine")
        validate_request(GenerationRequest(request_id, prompt, SamplingParams()), self.vocab_size,
                         self.max_seq_len)
        receipt = self.kv_receiver.prepare(request_id, prompt, end, timeout_s, time.monotonic())
        self.outputs.update_gauges()
        return receipt

    def receive_kv(self, block: KVBlock) -> None:
        """Store K/V another engine computed into the pages ``prepare_receive`` reserved."""
        try:
            self.kv_receiver.receive(block)
        finally:
            self.outputs.update_gauges()

    def release_receive(self, request_id: str, ticket: str | None = None, why: str = "released") -> bool:
        """Give up a reservation (its transfer failed elsewhere, or it was aborted: ``why``, in the
        trace); False when there was none, or ``ticket`` names another one."""
        released = self.kv_receiver.release(request_id, why, ticket)
        self.outputs.update_gauges()
        return released

    def expire_receives(self) -> None:
        """Free the reservations no ``start_generation`` took in time (the loop calls it)."""
        if self.kv_receiver.reservations and self.kv_receiver.expire(time.monotonic()):
            self.outputs.update_gauges()

    def _send_kv(self, seq: Sequence) -> None:
        """A ``remote_send`` sequence computed its window: its K/V goes on its last output, and it ends."""
        block = self.kv_sender.block(seq)
        seq.request.kv_block = block
        if self.observer is not None:
            self.observer.event(seq.request.request_id, "kv send", {
                "begin": block.begin, "end": block.end, "bytes": block.nbytes,
                "device": not isinstance(block.k, np.ndarray)})
        self.outputs.finish(seq, FinishReason.STOP, flush=False)

    # ------------------------------------------------------------------- profiling

    def start_profile(self, max_steps: int | None = None, max_seconds: float = 60.0,
                      stack_sampling: bool = False, trigger: ProfileTrigger | None = None) -> ProfileStatus:
        """Profile the next steps (``ProfilerControl.start``), or, with a ``trigger``, arm a profile
        that starts itself (``ProfilerControl.arm``); between steps only."""
        if trigger is not None:
            return self.profiling.arm(trigger, max_steps, max_seconds, stack_sampling)
        profiler = self.profiling.start(max_steps, max_seconds, stack_sampling)
        self.observer = StepObserver.watching(self.tracer, profiler)
        return profiler.status()

    def _fire_profile(self) -> None:
        """The armed profile's trigger fired (in the last step, or as a request came): it starts now."""
        self.observer = StepObserver.watching(self.tracer, self.profiling.fire())

    def stop_profile(self, engine_name: str = "engine") -> ProfileResult:
        """End the profile, or take the one that stopped by itself (``ProfilerControl.stop``)."""
        result = self.profiling.stop(engine_name)
        self.observer = StepObserver.watching(self.tracer, None)
        return result

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, execute the model once, update from its output.

        Returns what the requests this step changed have to report (new text, finish reasons, usage).
        """
        armed = self.profiling.armed
        if armed is not None and armed.fired_by is not None:
            self._fire_profile()
        obs = self.observer
        if obs is not None:
            obs.begin_step()
        sched = self._schedule()
        if obs is not None:
            obs.lap("schedule")
        touched = [seq.request for seq in sched.out_of_pages + sched.preempted if seq.finished]
        if sched.chunks:
            t0 = time.perf_counter()
            self.num_steps += 1
            output = self.runner.execute(sched, obs)
            self._charge_anatomy(sched, t0, time.perf_counter())
            touched += self._update(sched, output)
            step_s = time.perf_counter() - t0
            if (armed := self.profiling.armed) is not None:
                armed.on_step(step_s)
            self.metrics.on_step(step_s, prefill_tokens=sched.num_prefill_tokens,
                                 decode_seqs=sched.num_decode_seqs, generated_tokens=self.appender.appended,
                                 prompt_tokens=self._prompts_completed(sched.chunks))
        outputs = self.outputs.outputs(touched)
        if obs is not None:
            obs.lap("outputs")
            if obs.end_step(len(sched.chunks), sched.num_tokens, sched.num_prefill_tokens):
                self.profiling.end()  # its step or time limit: taken later by stop_profile
                self.observer = StepObserver.watching(self.tracer, None)
        return outputs

    # ------------------------------------------------------------------ schedule

    def _schedule(self) -> SchedulerOutput:
        """This step's chunks, from the scheduler; the engine's side of admission and preemption.

        Stamps each request's first admission, pins system prompts as they are admitted, counts
        preemptions, and ends (``length``) the sequences the pool can never hold.
        """
        sched = self.scheduler.schedule()
        if self.observer is not None:
            self.observer.scheduled(sched, self.kv_pool)  # first, while first_scheduled_time tells a first admission
        now = time.perf_counter()
        for seq in sched.admitted:
            state = seq.request
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
                state.anatomy.admitted(now, self.queue_clock)
                # vLLM's rule: what the first admission found; a recompute after a preemption
                # is the engine's business, not the client's.
                state.cached_prompt_tokens = seq.num_cached_prefix_tokens
                self.metrics.on_scheduled(now - state.arrival_time)
            if state.request.pin_system_prompt and seq.index == 0:
                self.kv_pool.pin(seq.seq_id, state.request.system_prompt_tokens or len(state.request.prompt))
        for seq in sched.preempted:
            self.metrics.on_preemption()
            seq.request.anatomy.was_preempted()
            if seq.kv_send is not None or seq.request.request.kv_window_begin is not None:
                # As MLC: a disaggregated request is not recomputed here; the router retries it.
                self.outputs.finish(seq, FinishReason.PREEMPT)
        for seq in sched.out_of_pages:
            # As at the context limit: the pool, less its pinned pages, is this sequence's limit.
            logger.warning("request %s: the KV cache, less its %d pinned pages, cannot hold the %d tokens of "
                           "choice %d; it ends with 'length'. Reset the engine to unpin system prompts, or "
                           "start it with more pages.", seq.request.request_id, self.kv_pool.num_pinned_pages,
                           len(seq.token_ids), seq.index)
            self.outputs.finish(seq, FinishReason.LENGTH)
        return sched

    def _charge_anatomy(self, sched: SchedulerOutput, start: float, end: float) -> None:
        """Charge each request in the step its share of the forward pass (``core.anatomy``).

        Two passes over the chunks, plain ints and float adds: no allocation per request."""
        prefill_tokens = 0
        top = second = 0  # the two largest prompts among the prefilling chunks
        top_id = -1
        for c in sched.chunks:
            if c.is_prefill:
                prefill_tokens += c.num_tokens
                n = c.seq.num_prompt_tokens
                if n > top:
                    top, second, top_id = n, top, c.seq.seq_id
                elif n > second:
                    second = n
        total = sched.num_tokens
        step = self.num_steps
        # Requests still wait with slots free and the budget gone, some of it to prefill: their
        # queue time is time behind prefill (``QueueClock``).
        scheduler = self.scheduler
        self.queue_clock.step(start, end, bool(scheduler.waiting) and prefill_tokens > 0
                              and len(scheduler.running) < scheduler.max_num_seqs
                              and total >= scheduler.token_budget, top)
        for c in sched.chunks:
            seq = c.seq
            prefills = c.is_prefill
            seq.request.anatomy.charge_step(
                step, start, end, c.num_tokens, prefills, c.start + c.num_tokens >= seq.num_prompt_tokens,
                total, prefill_tokens, second if seq.seq_id == top_id else top)

    # -------------------------------------------------------------------- update

    def _update(self, sched: SchedulerOutput, output: ModelOutput) -> list[RequestState]:
        """Everything after the forward pass: commit the K/V it wrote, pick a token per sampling row
        (grammar masks, sampler), append it (stop rules, detokenization); returns the requests with news."""
        obs = self.observer
        self._commit(sched.chunks)
        sent = [c.seq for c in sched.chunks if c.seq.kv_send is not None and c.completes]
        for seq in sent:
            t0 = time.perf_counter()
            self._send_kv(seq)
            seq.request.anatomy.kv_pending += time.perf_counter() - t0
        # max_tokens 0: the prompt is all there is; it ends once computed (OpenAI's and vLLM's "length").
        scored = [c.seq for c in sched.chunks if c.completes and c.seq.prefill_only and c.seq.kv_send is None]
        if obs is not None:
            obs.lap("commit")
        self._score_prompts(output.prompt_rows)
        for seq in scored:
            self.outputs.finish(seq, FinishReason.LENGTH)
        picks = self.picker.pick(output, obs)
        if obs is not None:
            obs.lap("sampling")
        self.appender.append(output.sampled, picks, obs)
        if obs is not None:
            obs.lap("detokenization")
        return ([c.seq.request for c in output.sampled] + [seq.request for seq in sent]
                + [seq.request for seq in scored])

    def _score_prompts(self, prompt_rows: list[tuple[ScheduledChunk, np.ndarray]]) -> None:
        """Append the prompt logprobs these chunks' logits give (``core.prompt_logprobs``); each
        row is read once, right after the forward pass, and dropped with the step's output."""
        for chunk, logits in prompt_rows:
            state = chunk.seq.request
            got = state.prompt_logprobs
            assert got is not None  # only chunks of a request that asked for them have rows here
            prompt = state.request.prompt
            first = len(got) - 1  # the position that scores the first missing token
            # The prefix cache gave this choice no position past the ones it has scored
            # (Sequence.prefix_cache_limit), so the chunk starts at or before ``first``.
            assert chunk.start <= first, (chunk.start, first)
            end = min(chunk.start + chunk.num_tokens, len(prompt) - 1)
            rows = logits[first - chunk.start:end - chunk.start]
            targets = np.array(prompt[first + 1:end + 1], dtype=np.int64)
            top = state.params.prompt_logprobs
            assert top is not None
            got.extend(prompt_logprobs(rows, targets, top))

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

    @staticmethod
    def _prompts_completed(chunks: list[ScheduledChunk]) -> int:
        """Prompt tokens of the requests whose whole prompt these chunks brought into the KV cache
        for the first time (cached tokens included; a recompute after preemption counts nothing)."""
        tokens = 0
        for chunk in chunks:
            seq, state = chunk.seq, chunk.seq.request
            if not state.prompt_counted and chunk.prefills and chunk.start + chunk.num_tokens >= seq.num_prompt_tokens:
                state.prompt_counted = True
                tokens += seq.num_prompt_tokens
        return tokens

"""The serving engine: a synchronous step loop (``Engine``).

``Engine.step()`` reads as three verbs, as in vLLM's engine core: the scheduler
picks this step's chunks, the model computes them, and the engine updates every
request from the result (sampling, grammar, stop checks, detokenization,
metrics, trace events). ``engine_core.EngineCore`` runs that loop and
``async_engine.AsyncEngine`` serves asyncio callers from it; no request handler
touches model state.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.runtime.model.checkpoint import Checkpoint
from engines.runtime.core.grammar import GrammarCompiler, GrammarError
from engines.runtime.core.kv_pool import KVCachePool
from engines.runtime.telemetry.metrics import EngineMetrics, RequestMetrics
from engines.runtime.model.llama import ForwardBatch, LlamaModel
from engines.runtime.core.request import (
    ChoiceDelta,
    EngineRequestError,
    GenerationRequest,
    GrammarMode,
    RequestOutput,
    RequestState,
    Sequence,
    SequenceStatus,
)
from engines.runtime.core.sampler import InvalidSamplingParams, Sampler, SamplingState
from engines.runtime.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engines.runtime.core.stop_checker import StopChecker
from engines.runtime.telemetry.trace_recorder import TraceRecorder

logger = logging.getLogger("engines.runtime")

__all__ = ["Engine", "EngineConfig", "validate_request"]


@dataclass
class EngineConfig:
    """Engine sizing, fixed at start-up."""

    max_num_seqs: int = 64
    num_pages: int | None = None
    page_size: int = 16
    max_total_tokens: int = 65536
    prefill_chunk_size: int = 512
    max_trace_events: int = 1_000_000
    enable_prefix_cache: bool = True

    def resolved_num_pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return -(-self.max_total_tokens // self.page_size)


def validate_request(request: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """Raise :class:`EngineRequestError` if no engine of this vocabulary and context could serve
    ``request`` (cheap, any thread or process: it reads only the request)."""
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
        tracer: the event recorder, or ``None`` when tracing is off (every call site
            checks it, so a disabled trace costs one comparison).
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
        num_pages = self.config.resolved_num_pages()
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
        try:
            grammar = self.grammars.compile(request.response_format)
        except GrammarError as e:
            raise EngineRequestError(f"response_format: {e}") from e
        state = RequestState(request, time.perf_counter())
        max_output = self.max_seq_len - len(request.prompt)
        for index in range(request.sampling.n):
            seq = Sequence(state, index, request.prompt)
            seq.sampling = SamplingState(request.sampling, self.vocab_size, request.prompt, index)
            seq.detokenizer = self.tokenizer.detokenizer()
            seq.stop_checker = StopChecker.from_params(request.sampling, self.eos_token_ids, max_output)
            if grammar is not None:
                seq.grammar = grammar.matcher()
            state.sequences.append(seq)
        # Queued only once every choice is built, so a failure above leaves no orphan sequence.
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
                self._finish_sequence(seq, "abort")
        out = self._collect_output(state)
        self._update_gauges()
        return out

    def reset(self, clear_trace: bool = False) -> list[RequestOutput]:
        """Abort everything, free all KV pages and the prefix cache (pinned too), zero every metric."""
        outputs = [o for rid in list(self.requests) if (o := self.abort_request(rid)) is not None]
        self.scheduler.clear()
        self.kv_pool.reset()
        self.metrics.reset()
        if clear_trace and self.tracer is not None:
            self.tracer.clear()
        self._update_gauges()
        return outputs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def warm_up(self) -> None:
        """Run one tiny prefill and one decode so JIT compilation (numba, a first CUDA graph)
        happens now, not inside the first user's time to first token.

        Only before any request: it writes scratch K/V into page 0, which no sequence holds yet.
        """
        if self.requests or self.kv_pool.num_used_pages:
            raise RuntimeError("warm_up() must run before the engine takes requests")
        page_table = np.zeros((1, 1), np.int32)
        self.model.forward(ForwardBatch(np.array([0, 1], np.int32), np.array([0, 2], np.int32),
                                        np.array([0], np.int32), page_table), self.kv)
        self.model.forward_greedy(ForwardBatch(np.array([1], np.int32), np.array([0, 1], np.int32),
                                               np.array([2], np.int32), page_table), self.kv)

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, update every scheduled request; returns the new outputs."""
        sched = self.scheduler.schedule()
        self._trace_schedule(sched)
        touched: dict[str, RequestState] = {}
        for seq in sched.out_of_pages:
            # As at the context limit: the pool, less its pinned pages, is this sequence's limit.
            logger.warning("request %s: the KV cache, less its %d pinned pages, cannot hold the %d tokens of "
                           "choice %d; it ends with 'length'. Reset the engine to unpin system prompts, or "
                           "start it with more pages.", seq.request.request_id, self.kv_pool.num_pinned_pages,
                           len(seq.token_ids), seq.index)
            self._finish_sequence(seq, "length")
            touched[seq.request.request_id] = seq.request
        if not sched.chunks:
            return self._outputs(touched)
        self.num_steps += 1
        t0 = time.perf_counter()
        sampled_chunks = [c for c in sched.chunks if c.samples]
        token_ids = self._run_model(sched, sampled_chunks)
        for chunk in sched.chunks:
            seq = chunk.seq
            self.kv_pool.commit(seq.seq_id, seq.token_ids[chunk.start:chunk.start + chunk.num_tokens])
            seq.num_computed = chunk.start + chunk.num_tokens
            state = seq.request
            if chunk.is_prefill:
                state.prefill_tokens += chunk.num_tokens
            else:
                state.decode_tokens += chunk.num_tokens
        now = time.perf_counter()
        gaps = []
        sampled_ids = [c.seq.request.request_id for c in sampled_chunks]
        if self.tracer is not None and sampled_ids:
            # MLC's name for the streamer's work: text deltas, stop strings, grammar state.
            self.tracer.add_event(sampled_ids, "start detokenization")
        for chunk, picked in zip(sampled_chunks, token_ids):
            seq = chunk.seq
            touched[seq.request.request_id] = seq.request
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
        if self.tracer is not None and sampled_ids:
            self.tracer.add_event(sampled_ids, "finish detokenization")
        self.metrics.on_token_gaps(gaps)
        elapsed = time.perf_counter() - t0
        prefill_tokens = sched.num_prefill_tokens
        decode_seqs = sched.num_decode_seqs
        self.metrics.on_step(elapsed, prefill_tokens=prefill_tokens, decode_seqs=decode_seqs)
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """What the requests this step changed have to report; refreshes the gauges."""
        outputs = [o for state in touched.values() if (o := self._collect_output(state)) is not None]
        self._update_gauges()
        return outputs

    def _run_model(self, sched: SchedulerOutput,
                   sampled: list[ScheduledChunk]) -> list[tuple[int, Any] | Exception]:
        """The forward pass and sampling; returns (token, logprob) per sampling chunk.

        A chunk whose grammar failed to give a mask gets the exception instead: that
        request fails alone (``step``), the rest of the batch samples as usual.
        """
        chunks = sched.chunks
        batch = ForwardBatch(
            token_ids=np.fromiter((t for c in chunks for t in c.seq.token_ids[c.start:c.start + c.num_tokens]),
                                  dtype=np.int32, count=sched.num_tokens),
            query_starts=np.concatenate(([0], np.cumsum([c.num_tokens for c in chunks]))).astype(np.int32),
            cached_lens=np.fromiter((c.start for c in chunks), dtype=np.int32, count=len(chunks)),
            page_table=self.kv_pool.page_table([c.seq.seq_id for c in chunks]),
        )
        tracer = self.tracer
        kind = "prefill" if sched.num_prefill_tokens else "decode"
        lane_ids = [c.seq.request.request_id for c in chunks]
        # Argmax on the device when no row needs its logits: only token ids come back.
        greedy = not any(c.seq.grammar is not None or not c.seq.request.params.is_greedy
                         or c.seq.request.params.logprobs or c.seq.sampling.modifies_logits for c in sampled)
        if tracer is not None:
            tracer.add_event(lane_ids, f"start {kind}", {"batch_size": len(chunks)}, engine_lane=True)
        result = (self.model.forward_greedy if greedy else self.model.forward)(batch, self.kv)
        if tracer is not None:
            tracer.add_event(lane_ids, f"finish {kind}", {"tokens": sched.num_tokens}, engine_lane=True)
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if greedy:
            return [(int(result[r]), None) for r in rows]
        logits = result[rows]
        states = [c.seq.sampling for c in sampled]
        sample_ids = [c.seq.request.request_id for c in sampled]
        masks: list[np.ndarray | None] = [None] * len(sampled)
        failures: dict[int, Exception] = {}
        grammar_rows = [i for i, c in enumerate(sampled) if c.seq.grammar is not None]
        if grammar_rows:
            if tracer is not None:
                tracer.add_event([sample_ids[i] for i in grammar_rows], "start apply logit mask")
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
                tracer.add_event([sample_ids[i] for i in grammar_rows], "finish apply logit mask")
        if tracer is not None:
            tracer.add_event(sample_ids, "start sampling")
        picked = self.sampler.sample(logits, states, masks)
        if tracer is not None:
            tracer.add_event(sample_ids, "finish sampling")
        return [failures[i] if i in failures
                else (int(picked.token_ids[i]), picked.logprobs[i] if picked.logprobs else None)
                for i in range(len(sampled))]

    # -------------------------------------------------------------------- update

    def _append_sampled(self, seq: Sequence, token: int, logprob: Any) -> None:
        """Add a sampled token (and any tokens the grammar then forces) and check every stop rule."""
        state = seq.request
        now = time.perf_counter()
        if state.first_token_time is None:
            state.first_token_time = now
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
        limit = self.max_seq_len - len(seq.token_ids)
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens)
        return max(limit, 0)

    def _accept_token(self, seq: Sequence, token: int, logprob: Any) -> bool:
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
        if check.finish_reason == "stop":
            # Nothing to flush: the stop token took the rest, and what follows a stop string is dropped.
            self._finish_sequence(seq, "stop", flush=False)
            return True
        # Before the length limit: output the grammar completes on its last allowed
        # token is whole, and "length" would tell the client it was cut.
        if seq.grammar is not None and seq.grammar.is_finished():
            self._finish_sequence(seq, "stop")
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
        self._finish_sequence(seq, "abort", flush=False)

    def _finish_sequence(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        """End a choice. ``flush``: no stop rule cut the text (grammar done, length, abort), so
        held-back text is output."""
        if seq.finished:
            return
        if flush:
            seq.pending_text += seq.stop_checker.flush() + seq.detokenizer.finish()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        state = seq.request
        if state.finished:
            state.finish_time = time.perf_counter()
            del self.requests[state.request_id]

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
        return RequestOutput(state.request_id, choices, usage)

    def _finish_request(self, state: RequestState) -> dict[str, Any]:
        completion = sum(s.num_output_tokens for s in state.sequences)
        prompt = len(state.request.prompt)
        aborted = all(s.finish_reason == "abort" for s in state.sequences)
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
        if self.tracer is not None:
            if state.first_scheduled_time is None:  # aborted or dropped while waiting
                self.tracer.add_event(state.request_id, "finish queue")
            reasons = sorted({s.finish_reason or "" for s in state.sequences})
            self.tracer.add_event(state.request_id, "finish", {
                "finish_reason": reasons[0] if len(reasons) == 1 else ",".join(reasons),
                "prompt_tokens": prompt, "completion_tokens": completion,
                "prefill_tokens": state.prefill_tokens,
            })
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "extra": rm.as_usage_extra(),
        }

    # ----------------------------------------------------------------- bookkeeping

    def _trace_schedule(self, sched: SchedulerOutput) -> None:
        now = time.perf_counter()
        for seq in sched.admitted:
            state = seq.request
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
                if self.tracer is not None:
                    self.tracer.add_event(state.request_id, "finish queue")
            if self.tracer is not None:
                # What the prefix cache gave back and what the pool handed out.
                self.tracer.add_event(state.request_id, "kv cache admit", {
                    "cached_tokens": seq.num_cached_prefix_tokens,
                    "pages": len(self.kv_pool.pages(seq.seq_id))})
            if state.request.pin_system_prompt and seq.index == 0:
                pin = state.request.system_prompt_tokens or len(state.request.prompt)
                self.kv_pool.pin(seq.seq_id, pin)
        for seq in sched.preempted:
            self.metrics.on_preemption()
            if self.tracer is not None:
                self.tracer.add_event(seq.request.request_id, "preempt")

    def _update_gauges(self) -> None:
        usage = self.kv_pool.usage()
        # Requests, not choices (a request has n). Counted from the running side, which is
        # bounded by max_num_seqs, where the waiting queue may be long: every other live
        # request waits, and a running one does too while a choice of its is unadmitted.
        running = Counter(s.request.request_id for s in self.scheduler.running)
        waiting = len(self.requests) - len(running) + sum(
            1 for rid, n in running.items() if n < sum(not s.finished for s in self.requests[rid].sequences))
        self.metrics.set_gauges(
            num_running_requests=len(running),
            num_waiting_requests=waiting,
            kv_pages_used=usage.used_pages,
            kv_pages_total=usage.total_pages,
            prefix_cache_hit_rate=usage.hit_rate,
        )

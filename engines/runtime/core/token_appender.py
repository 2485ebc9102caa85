"""A picked token's effects on its choice (``TokenAppender``): the update's second half.

Each sampling row's token is appended to its choice; the grammar advances, the detokenizer turns
it into text, the stop rules (``core.stop_checker``) decide whether the choice ends, and, as MLC
does, the tokens the grammar then forces are appended at once (jump-forward). A choice whose
grammar or tokenizer raised is aborted alone: the engine serves on. Engine thread only.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engines.runtime.core.request import FinishReason, GrammarMode, Sequence
from engines.runtime.core.sampler import TokenLogprob
from engines.runtime.core.token_picker import Pick

if TYPE_CHECKING:
    from engines.runtime.core.output_processor import OutputProcessor
    from engines.runtime.core.profiler_control import ProfilerControl
    from engines.runtime.core.scheduler import ScheduledChunk
    from engines.runtime.core.step_observer import StepObserver
    from engines.runtime.telemetry.metrics import EngineMetrics

logger = logging.getLogger("engines.runtime")

__all__ = ["TokenAppender"]


class TokenAppender:
    """Appends each sampling row's token to its choice and applies what follows from it.

    Args:
        eos_token_ids: the model's end tokens (a grammar never consumes one).
        max_seq_len: the most tokens a choice may hold (jump-forward stops there).
        metrics: the engine's metrics (token gaps, first tokens, jump-forward, failures).
        profiling: whose armed profile hears of each first token.
        outputs: which ends the choices a stop rule or a failure ends.
    """

    def __init__(self, eos_token_ids: frozenset[int], max_seq_len: int, metrics: EngineMetrics,
                 profiling: ProfilerControl, outputs: OutputProcessor) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_seq_len = max_seq_len
        self.metrics = metrics
        self.profiling = profiling
        self.outputs = outputs
        self.appended = 0  # output tokens the last ``append`` added (the step's, for its metrics)

    def append(self, sampled: list[ScheduledChunk], picks: list[Pick], obs: StepObserver | None) -> None:
        """Give each sampling choice its token: stop rules, detokenization, jump-forward, failures;
        ``appended`` counts the output tokens it added (forced ones too). ``obs``: the step's
        observer (None: nobody watches)."""
        self.appended = 0
        now = time.perf_counter()
        gaps = []
        if obs is not None and sampled:
            # MLC's name for the streamer's work: text deltas, stop strings, grammar state.
            sampled_ids = [c.seq.request.request_id for c in sampled]
            obs.event(sampled_ids, "start detokenization")
        for chunk, picked in zip(sampled, picks, strict=True):
            seq = chunk.seq
            if isinstance(picked, Exception):
                self._fail_sequence(seq, picked, obs)
                continue
            if seq.last_token_time is not None:
                gaps.append(now - seq.last_token_time)
            seq.last_token_time = now
            try:
                self._append_sampled(seq, *picked, obs)
            except Exception as e:  # noqa: BLE001 - a grammar or tokenizer error fails its request, not the engine
                self._fail_sequence(seq, e, obs)
        if obs is not None and sampled:
            obs.event(sampled_ids, "finish detokenization")
        self.metrics.on_token_gaps(gaps)

    def _append_sampled(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
                        obs: StepObserver | None) -> None:
        """Add a sampled token (and any tokens the grammar then forces) and check every stop rule."""
        state = seq.request
        now = time.perf_counter()
        if state.first_token_time is None:
            state.first_token_time = now
            self.metrics.on_first_token(now - state.arrival_time)
            if (armed := self.profiling.armed) is not None:
                armed.on_first_token(now - state.arrival_time, now)
            if obs is not None:
                obs.event(state.request_id, "first token")
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
        if obs is not None:
            obs.event(state.request_id, "jump forward", {"tokens": accepted})

    def _remaining_tokens(self, seq: Sequence) -> int:
        """Output tokens the choice may still add before max_tokens or the context ends it."""
        limit = self.max_seq_len - len(seq.token_ids)
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens)
        return max(limit, 0)

    def _accept_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """Append one output token; finish the choice if a stop rule fires. Returns True if finished."""
        self.appended += 1
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
            self.outputs.finish(seq, FinishReason.STOP, flush=False)
            return True
        # Before the length limit: output the grammar completes on its last allowed
        # token is whole, and "length" would tell the client it was cut.
        if seq.grammar is not None and seq.grammar.is_finished():
            self.outputs.finish(seq, FinishReason.STOP)
            return True
        if check.finish_reason is not None:
            self.outputs.finish(seq, check.finish_reason)  # the last token: what the detokenizer holds is whole
            return True
        return False

    def _fail_sequence(self, seq: Sequence, error: Exception, obs: StepObserver | None) -> None:
        """Abort a choice whose update raised (grammar, tokenizer); the engine serves on."""
        rid = seq.request.request_id
        logger.error("request %s (choice %d) failed and is aborted: %r", rid, seq.index, error, exc_info=error)
        if obs is not None:
            obs.event(rid, "request error", {"error": f"{type(error).__name__}: {error}"})
        # No flush: the detokenizer or stop checker may be what failed.
        if not any(s.finished for s in seq.request.sequences):  # a request fails once, whatever its choices
            self.metrics.on_request_failed()
        self.outputs.finish(seq, FinishReason.ABORT, flush=False)

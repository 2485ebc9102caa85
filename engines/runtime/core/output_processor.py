"""What a step's changes report, and the records they leave: the engine's outputs side.

:class:`OutputProcessor` ends choices (``finish``), turns what each touched request's choices
produced since its last output into one ``RequestOutput`` (text deltas, token ids, logprobs,
finish reasons), accounts for a request whose every choice ended (usage, metrics, the
recent-requests record, the trace's ``finish``), and keeps the running/waiting and KV gauges
current. Engine thread only (the requests in the engine now, for the dashboard, are
``live_view``'s).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from engines.runtime.core.diagnosis import AnatomyFacts, diagnose
from engines.runtime.core.disagg.sender import describe_half
from engines.runtime.core.request import ChoiceDelta, FinishReason, RequestOutput, RequestState, Sequence
from engines.runtime.telemetry.flight_recorder import FlightRecorder, WorkloadRequest
from engines.runtime.telemetry.metrics import EngineMetrics, RecentRequest, RequestMetrics

if TYPE_CHECKING:
    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.core.scheduler import Scheduler
    from engines.runtime.telemetry.trace_recorder import TraceRecorder

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """The engine's outputs, ending choices, finished requests' accounting and gauges.

    Args:
        requests: the engine's live requests by id (shared: the engine adds them, ``finish`` drops them).
        scheduler: whose running sequences the gauges count.
        kv_pool: whose usage the gauges show.
        metrics: the engine's metrics.
        tracer: the event recorder, or None.
    """

    def __init__(self, requests: dict[str, RequestState], scheduler: "Scheduler", kv_pool: "KVCachePool",
                 metrics: EngineMetrics, tracer: "TraceRecorder | None",
                 recorder: FlightRecorder | None = None) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.kv_pool = kv_pool
        self.metrics = metrics
        self.tracer = tracer
        #: Every request that ends, for ``/debug/dump_workload`` (the flight recorder).
        self.recorder = recorder if recorder is not None else FlightRecorder()

    def outputs(self, touched: list[RequestState]) -> list[RequestOutput]:
        """What the requests a step changed have to report, in the order they were touched;
        refreshes the gauges."""
        outputs = [o for state in dict.fromkeys(touched) if (o := self.collect(state)) is not None]
        self.update_gauges()
        return outputs

    def collect(self, state: RequestState) -> RequestOutput | None:
        """Turn what each choice produced since the last output into deltas (and usage when done).

        A request that asked for prompt logprobs reports no choice before they are complete
        (another choice may finish its prefill first, from the prefix cache): they go out once,
        on its first output with a delta, or on its last."""
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            if state.prompt_logprobs_missing and not state.finished:
                return None  # the choices' deltas wait, pending, for the prompt's logprobs
            prompt_logprobs = state.prompt_logprobs
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
        usage = times = None
        if state.finished:
            finish = state.finish_time or time.perf_counter()
            usage = self._finish_request(state, finish)
            times = state.times(finish)
        if not choices and usage is None:
            return None
        if prompt_logprobs is not None:
            state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, choices, usage, state.kv_block if usage is not None else None,
                             cached_prompt_tokens=state.cached_prompt_tokens, prompt_logprobs=prompt_logprobs,
                             times=times)

    def _finish_request(self, state: RequestState, finish: float) -> dict[str, Any]:
        """Account for a request whose every choice ended at ``finish`` (metrics, trace); returns its usage."""
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
            finish_time=finish,
        )
        if not aborted:
            self.metrics.on_request_finished(rm)
        # One reason, or the choices' several ("length,stop"); a plain str either way. (Every
        # choice has ended, so each has its reason.)
        finish_reason = ",".join(sorted({s.finish_reason for s in state.sequences if s.finish_reason is not None}))
        extra = rm.as_usage_extra()
        anatomy = state.anatomy
        breakdown = anatomy.close(finish)
        extra["time_breakdown"] = breakdown.as_dict()
        extra["diagnosis"] = diagnose(AnatomyFacts(
            breakdown, anatomy.running_at_add, anatomy.max_num_seqs, anatomy.blocker_tokens,
            self.scheduler.token_budget, anatomy.preemptions, prompt))
        self.metrics.on_request_ended(RecentRequest(
            request_id=state.request_id, finish_reason=finish_reason, prompt_tokens=prompt,
            completion_tokens=completion,
            queue_s=rm.queue_time_s if state.first_scheduled_time is not None else None,
            ttft_s=rm.ttft_s if state.first_token_time is not None else None,
            decode_tokens_per_s=extra.get("decode_tokens_per_s"), end_to_end_s=rm.end_to_end_latency_s,
            finished_at=time.time(), disagg=describe_half(state.request),
            time_breakdown=extra["time_breakdown"], diagnosis=tuple(extra["diagnosis"])))
        params = state.params
        self.recorder.record(WorkloadRequest(
            request_id=state.request_id, arrival=state.arrival_time, prompt_tokens=prompt,
            completion_tokens=completion, cached_tokens=state.cached_prompt_tokens, max_tokens=params.max_tokens,
            temperature=params.temperature, top_p=params.top_p, n=params.n, seed=params.seed,
            ignore_eos=params.ignore_eos, finish_reason=finish_reason,
            queue_s=rm.queue_time_s if state.first_scheduled_time is not None else None,
            ttft_s=rm.ttft_s if state.first_token_time is not None else None, e2e_s=rm.end_to_end_latency_s),
            state.request.prompt, state.sequences[0].token_ids[state.sequences[0].num_prompt_tokens:])
        if self.tracer is not None:
            if state.first_scheduled_time is None:  # aborted or dropped while waiting
                self.tracer.add_event(state.request_id, "finish queue")
            self.tracer.add_event(state.request_id, "finish", {
                "finish_reason": finish_reason,
                "prompt_tokens": prompt, "completion_tokens": completion,
                "prefill_tokens": state.prefill_tokens,
                # The anatomy rides on the trace so a saved trace's request summaries keep it.
                "time_breakdown": extra["time_breakdown"], "diagnosis": extra["diagnosis"],
            })
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # OpenAI's name for the prompt tokens served from the cache.
            "prompt_tokens_details": {"cached_tokens": state.cached_prompt_tokens},
            "extra": extra,
        }

    def finish(self, seq: Sequence, reason: FinishReason, flush: bool = True) -> None:
        """End a choice: out of the scheduler, and its request out of the engine once its every
        choice has ended (``collect`` then accounts for it). ``flush``: no stop rule cut the text
        (grammar done, length, abort), so held-back text is output."""
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

    def update_gauges(self) -> None:
        """Refresh the running/waiting and KV gauges after anything that may change them."""
        usage = self.kv_pool.usage()
        # Requests, not choices (a request has n). Counted from the running side, which is
        # bounded by max_num_seqs, where the waiting queue may be long: every other live
        # request waits, and a running one does too while a choice of its is unadmitted.
        # Plain loops: the caches are cold after the forward pass, where a Counter and generators
        # cost several times as much (docs/perf-log/cpu-anchors.md#2026-11-26-one-numba-call-a-step);
        # a request of one choice needs no count of its choices.
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
            num_kv_evictions=self.kv_pool.num_evictions,
        )

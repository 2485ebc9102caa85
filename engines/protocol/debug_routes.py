"""The bodies of the ``/debug/*`` routes (and vLLM's control routes served beside them), besides
the ``model`` every one of them takes: what each accepts and its bounds (docs/interfaces.md, "The
debug routes' bodies"). Pure pydantic, no Django: ``engines.views.debug`` parses with these and
answers MLC's texts for what they refuse. Keys a route does not know are ignored, as MLC does; a
profile's ``trigger`` is the exception (``extra="forbid"``), a new object of ours.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from engines.runtime import DEFAULT_KV_ENTRIES, DEFAULT_LIVE_LIMIT, REQUEST_LIMITS, ProfileTrigger

from .limits import DEFAULT_MAX_SECONDS, MAX_NOTE_CHARS, MAX_TAGS

__all__ = ["PROFILE_HINT", "AbortOptions", "DebugRequest", "DumpWorkloadOptions", "KVDumpOptions",
           "ListRequestsOptions", "ProfileOptions",
           "ProfileStopOptions", "SaveTraceOptions", "TriggerOptions"]

#: What a refused ``profile_start`` body is told to send.
PROFILE_HINT = ('Send "max_steps" as a whole number >= 1, "max_seconds" as a number of seconds (at most 3600), '
                '"stack_sampling" as true or false, "delay_steps" as a whole number >= 0 and "trigger" as an object '
                'with at least one of "step_over_ms", "ttft_p99_over_ms" (with "ttft_window_s"), "request_id", "user".')


class DebugRequest(BaseModel):
    """The body every debug route accepts. Keys MLC does not know are ignored, as MLC does."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    clear_trace: StrictBool = False  # reset_engine only: also empty the event trace


class SaveTraceOptions(BaseModel):
    """What ``save_event_trace`` takes besides ``model``: the record's note and tags, and whether to
    empty the engine's trace in the same step that takes it."""

    model_config = ConfigDict(extra="ignore")

    note: StrictStr = Field(default="", max_length=MAX_NOTE_CHARS)
    tags: list[StrictStr] = Field(default=[], max_length=MAX_TAGS)
    clear: StrictBool = False


class TriggerOptions(BaseModel):
    """``profile_start``'s ``trigger``: what starts an armed profile (any one of these, after
    ``delay_steps``; ``core.profile_trigger``)."""

    model_config = ConfigDict(extra="forbid")

    step_over_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    ttft_p99_over_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    ttft_window_s: float = Field(default=60.0, gt=0, le=3600)
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=REQUEST_LIMITS.max_request_id_chars)
    user: StrictStr | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_condition(self) -> "TriggerOptions":
        if all(v is None for v in (self.step_over_ms, self.ttft_p99_over_ms, self.request_id, self.user)):
            raise ValueError("a trigger needs a condition")
        return self


class ProfileOptions(BaseModel):
    """What ``profile_start`` (and ``cuda_profiler_start``) take besides ``model``."""

    model_config = ConfigDict(extra="ignore")

    max_steps: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    max_seconds: float = Field(default=DEFAULT_MAX_SECONDS, gt=0, le=3600)
    stack_sampling: StrictBool = False
    delay_steps: StrictInt = Field(default=0, ge=0, le=1_000_000)
    trigger: TriggerOptions | None = None

    def profile_trigger(self) -> ProfileTrigger | None:
        """The engine's trigger for these options; None to start at once."""
        t = self.trigger
        if t is None:
            return ProfileTrigger(delay_steps=self.delay_steps) if self.delay_steps else None
        ms = 1e-3
        return ProfileTrigger(delay_steps=self.delay_steps,
                              step_over_s=t.step_over_ms * ms if t.step_over_ms is not None else None,
                              ttft_p99_over_s=t.ttft_p99_over_ms * ms if t.ttft_p99_over_ms is not None else None,
                              ttft_window_s=t.ttft_window_s, request_id=t.request_id, user=t.user)


class ProfileStopOptions(BaseModel):
    """What ``profile_stop`` takes besides ``model``: the saved profile's note."""

    model_config = ConfigDict(extra="ignore")

    note: StrictStr = Field(default="", max_length=MAX_NOTE_CHARS)


class ListRequestsOptions(BaseModel):
    """What ``list_requests`` takes besides ``model``: how many rows at most (oldest first)."""

    model_config = ConfigDict(extra="ignore")

    limit: StrictInt = Field(default=DEFAULT_LIVE_LIMIT, ge=1, le=4096)


class AbortOptions(BaseModel):
    """What ``abort_request`` takes besides ``model``: the id of the request to end."""

    model_config = ConfigDict(extra="ignore")

    request_id: StrictStr = Field(min_length=1, max_length=REQUEST_LIMITS.max_request_id_chars)


class DumpWorkloadOptions(BaseModel):
    """What ``dump_workload`` takes besides ``model``: whether to save it into the history, with a note."""

    model_config = ConfigDict(extra="ignore")

    save: StrictBool = False
    note: StrictStr = Field(default="", max_length=MAX_NOTE_CHARS)


class KVDumpOptions(BaseModel):
    """What ``dump_kv_cache`` takes besides ``model``: how many prefix-cache entries at most."""

    model_config = ConfigDict(extra="ignore")

    max_entries: StrictInt = Field(default=DEFAULT_KV_ENTRIES, ge=0, le=4096)

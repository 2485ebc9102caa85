"""Replay a workload (``engines.runtime.telemetry.flight_recorder``, ``/debug/dump_workload``) onto any
OpenAI-compatible server, and keep what its client saw: the run a regression report compares.

Each recorded request is sent at its arrival offset (divided by ``speed``) to ``/v1/completions``,
streamed, with its recorded prompt where the workload holds one (``prompt_token_ids``: recorded
with ``serve --capture-text``), else a prompt of its recorded token length (token ids, the
completions API's other prompt form), and its recorded sampling parameters; ``max_tokens`` is its
recorded output length with ``ignore_eos`` and as many ``min_tokens`` (for a server without
``ignore_eos``: llama.cpp's Python server stops at EOS), so the two runs do the same work. Each carries
``X-Request-Id: replay-<tag>-<index>``, which names its trace lane and history rows on our servers
(unless ``request_ids`` is false: llama-cpp-python's server refuses an id that is not a UUID).
The client measures TTFT (first token chunk), the gaps between token chunks (ITL) and E2E, as an
OpenAI client does. A run is bounded by ``max_requests`` and ``max_seconds``.
"""
from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

from engines.runtime import WORKLOAD_FORMAT, WORKLOAD_VERSION

__all__ = ["PROMPT_FORMS", "RUN_FORMAT", "RUN_VERSION", "ReplayedRequest", "Run", "WorkloadError", "check_workload",
           "output_tokens", "prompt_for", "replay", "summarize"]

RUN_FORMAT = "llm-debugsite.run"
RUN_VERSION = 1
#: The token ids a replayed prompt is made of: ordinary ids every Llama-family vocabulary holds.
PROMPT_TOKEN_IDS = range(1000, 2000)


class WorkloadError(ValueError):
    """The value is not a workload this version replays; the message says why."""


@dataclass
class ReplayedRequest:
    """One request as the replaying client saw it (seconds; None where the moment never came)."""

    request_id: str
    offset_s: float
    sent_offset_s: float
    #: The ``X-Request-Id`` it was sent with (the target's name for it; empty: sent without one).
    sent_id: str = ""
    status: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None


@dataclass
class Run:
    """A replay's outcome: what was sent where, and each request as its client saw it."""

    target: str
    model: str
    workload_engine: str
    speed: float
    started_unix: float
    requests: list[ReplayedRequest]
    duration_s: float = 0.0
    #: What names this run's requests (``replay-<tag>-<index>``).
    tag: str = ""
    format: str = RUN_FORMAT
    version: int = RUN_VERSION

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = summarize(self.requests, self.duration_s)
        return out


def output_tokens(completion_tokens: int | None, itl_s: list[float]) -> int:
    """A replayed request's output tokens: as its usage chunk said, else its text chunks counted
    (docs/metrics.md, "Regression report")."""
    return completion_tokens or len(itl_s) + 1


def summarize(requests: list[ReplayedRequest], duration_s: float) -> dict[str, Any]:
    """A run's headline figures: requests, successes, TTFT p50 and p90, E2E p50, output tokens/s."""
    ok = [r for r in requests if r.error is None and r.ttft_s is not None]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tokens = sum(output_tokens(r.completion_tokens, r.itl_s) for r in ok)
    return {
        "requests": len(requests), "succeeded": len(ok),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
        "e2e_p50_s": statistics.median([r.e2e_s for r in ok if r.e2e_s is not None]) if ok else None,
        "tokens_per_s": tokens / duration_s if duration_s > 0 else None,
    }


def check_workload(value: Any) -> list[dict[str, Any]]:
    """``value``'s requests, oldest first, if it is a workload of the version this replays."""
    if not isinstance(value, dict) or value.get("format") != WORKLOAD_FORMAT:
        raise WorkloadError(f"not a workload: its \"format\" must be {WORKLOAD_FORMAT!r}")
    if value.get("version") != WORKLOAD_VERSION:
        raise WorkloadError(f"workload version {value.get('version')!r}; this server replays version "
                            f"{WORKLOAD_VERSION}")
    requests = value.get("requests")
    if not isinstance(requests, list):
        raise WorkloadError("a workload's \"requests\" must be a list")
    for i, r in enumerate(requests):
        if not isinstance(r, dict) or not isinstance(r.get("offset_s"), (int, float)) or r["offset_s"] < 0 \
                or not isinstance(r.get("prompt_tokens"), int) or r["prompt_tokens"] < 1:
            raise WorkloadError(f"request {i}: needs offset_s >= 0 and prompt_tokens >= 1")
        ids = r.get("prompt_token_ids")
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise WorkloadError(f"request {i}: prompt_token_ids must be a non-empty list of token ids")
    return sorted(requests, key=lambda r: r["offset_s"])


#: How a prompt is sent: as token ids (the completions API's other prompt form; every server of
#: ours, vLLM and SGLang take it), or as text for a server that takes text only (llama.cpp's
#: Python server): a recorded prompt's ids are then sent as words, one " the" a token, which
#: Llama-family tokenizers split into about as many tokens.
PROMPT_FORMS = ("ids", "text")


def prompt_for(index: int, length: int) -> list[int]:
    """A prompt of ``length`` token ids, different per request (no prefix shared by accident)."""
    ids = PROMPT_TOKEN_IDS
    return [ids[(index * 7919 + i) % len(ids)] for i in range(length)]


def _prompt(index: int, recorded: dict[str, Any], form: str) -> list[int] | str:
    if form == "text":
        return f"{index}:" + " the" * (recorded["prompt_tokens"] - 1)
    return recorded.get("prompt_token_ids") or prompt_for(index, recorded["prompt_tokens"])


def _body(index: int, recorded: dict[str, Any], model: str, prompt_form: str = "ids") -> dict[str, Any]:
    completion = recorded.get("completion_tokens") or 1
    body: dict[str, Any] = {
        "model": model, "prompt": _prompt(index, recorded, prompt_form),
        "max_tokens": completion,
        "temperature": recorded.get("temperature", 1.0), "top_p": recorded.get("top_p", 1.0), "stream": True,
        # Its recorded length either way: the replay does the same work (vLLM's extensions, as ours;
        # llama-cpp-python's server ignores ignore_eos, and honours min_tokens).
        "ignore_eos": True, "min_tokens": completion,
        # The last chunk's usage: the output tokens as the server counts them.
        "stream_options": {"include_usage": True},
    }
    if recorded.get("seed") is not None:
        body["seed"] = recorded["seed"]
    return body


async def _one(client: httpx.AsyncClient, index: int, recorded: dict[str, Any], body: dict[str, Any], sent_id: str,
               start: float, speed: float, deadline: float) -> ReplayedRequest:
    await asyncio.sleep(max(0.0, start + recorded["offset_s"] / speed - time.perf_counter()))
    sent = time.perf_counter()
    out = ReplayedRequest(str(recorded.get("request_id", index)), recorded["offset_s"], sent - start, sent_id=sent_id)
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"X-Request-Id": out.sent_id} if out.sent_id else {},
                                 timeout=max(1.0, deadline - sent)) as response:
            out.status = response.status_code
            if response.status_code != 200:
                reply = (await response.aread()).decode("utf-8", "replace")[:500]
                out.error = reply or f"HTTP {response.status_code} with no body"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if event.get("usage"):
                    out.completion_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        now = time.perf_counter()
                        if out.ttft_s is None:
                            out.ttft_s = now - sent
                        elif last is not None:
                            out.itl_s.append(now - last)
                        last = now
                        out.text += choice["text"]
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.e2e_s = time.perf_counter() - sent
    return out


async def replay(workload: dict[str, Any], client: httpx.AsyncClient, model: str, target: str, speed: float = 1.0,
                 max_requests: int | None = None, max_seconds: float = 600.0, tag: str | None = None,
                 prompt_form: str = "ids", request_ids: bool = True,
                 extra_body: Mapping[str, Any] | None = None) -> Run:
    """Send ``workload``'s requests through ``client`` (its base URL the server) to ``model``, at their
    offsets divided by ``speed``; at most ``max_requests`` of them, and none after ``max_seconds``.
    ``tag`` names the requests (``replay-<tag>-<index>``; default: a fresh one); ``prompt_form``
    is one of :data:`PROMPT_FORMS`; ``request_ids`` false sends no ``X-Request-Id`` (for a server
    that refuses ours: llama-cpp-python's takes UUIDs only, and answers any other with a bare 400);
    ``extra_body``'s keys go into every request's body (a server's own settings: llama-cpp-python's
    server applies ``repeat_penalty`` 1.1 unless a request says 1.0, where ours and vLLM apply none)."""
    if not speed > 0:
        raise WorkloadError(f"speed must be > 0, not {speed}")
    if prompt_form not in PROMPT_FORMS:
        raise WorkloadError(f"prompt_form must be one of {', '.join(PROMPT_FORMS)}, not {prompt_form!r}")
    requests = check_workload(workload)[:max_requests]
    requests = [r for r in requests if r["offset_s"] / speed <= max_seconds]
    tag = tag or uuid.uuid4().hex[:8]
    started_unix, start = time.time(), time.perf_counter()
    deadline = start + max_seconds
    done = await asyncio.gather(*(_one(client, i, r, {**_body(i, r, model, prompt_form), **(extra_body or {})},
                                       f"replay-{tag}-{i}" if request_ids else "", start, speed, deadline)
                                  for i, r in enumerate(requests)))
    return Run(target, model, str(workload.get("engine", "")), speed, started_unix, list(done),
               duration_s=time.perf_counter() - start, tag=tag)

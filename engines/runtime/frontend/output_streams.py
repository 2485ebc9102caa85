"""The per-request output queues a front end's ``generate`` calls read (``OutputStreams``).

Each ``AsyncEngine.generate`` call opens one stream: an asyncio queue on the caller's event
loop, keyed by request id. The thread that carries the core's messages puts each step's
outputs on their streams (one wake-up per event loop per step), and an error that ends a
stream (a rejection, the engine's death) goes on it the same way. A consumer that fell behind
takes what is waiting as one merged output (``merge_outputs``): one SSE chunk, not one per
token, as vLLM's ``RequestOutputCollector`` does.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from engines.runtime.core.request import ChoiceDelta, RequestOutput

__all__ = ["OutputStreams", "merge_outputs"]


class OutputStreams:
    """Open streams by request id; opened and read on their event loops, fed from any thread."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def ids(self) -> list[str]:
        """The request ids with an open stream (from any thread)."""
        return list(self._streams)

    def open(self, request_id: str) -> asyncio.Queue:
        """A new stream for ``request_id`` on the running event loop (the caller checked that
        none is open)."""
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        return outputs

    def release(self, request_id: str, outputs: asyncio.Queue) -> None:
        """Forget the stream of ``request_id`` if it is still ``outputs`` (a later request may reuse
        the id)."""
        stream = self._streams.get(request_id)
        if stream is not None and stream[1] is outputs:
            del self._streams[request_id]

    @staticmethod
    async def next_batch(outputs: asyncio.Queue) -> tuple[RequestOutput | None, BaseException | None]:
        """Wait for the stream's next output, merged with whatever else is waiting behind it, and
        the error that ends the stream if one came (either may be None, not both)."""
        batch = [await outputs.get()]
        while not outputs.empty() and not isinstance(batch[-1], BaseException):
            batch.append(outputs.get_nowait())
        error = batch.pop() if isinstance(batch[-1], BaseException) else None
        return (merge_outputs(batch) if batch else None), error

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Put each output on its request's stream (a request without one is ignored)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        # One wake-up per event loop per step, not one per request.
        for loop, items in by_loop.items():
            _put_threadsafe(loop, items)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End the stream of ``request_id`` (if open) with ``error``."""
        stream = self._streams.get(request_id)
        if stream is not None:
            _put_threadsafe(stream[0], [(stream[1], error)])

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error``."""
        for loop, q in list(self._streams.values()):
            _put_threadsafe(loop, [(q, error)])


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Join consecutive outputs of one request into one (texts, tokens and logprobs appended)."""
    if len(outputs) == 1:
        return outputs[0]
    merged: dict[int, ChoiceDelta] = {}
    for out in outputs:
        for c in out.choices:
            m = merged.get(c.index)
            if m is None:
                merged[c.index] = ChoiceDelta(c.index, c.text, list(c.token_ids),
                                              None if c.logprobs is None else list(c.logprobs), c.finish_reason)
                continue
            m.text += c.text
            m.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                m.logprobs = (m.logprobs or []) + list(c.logprobs)
            m.finish_reason = c.finish_reason or m.finish_reason
    last = outputs[-1]
    prompt_logprobs = next((out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None), None)
    return RequestOutput(last.request_id, [merged[i] for i in sorted(merged)], last.usage, last.kv_block,
                         last.kv_delivery, last.cached_prompt_tokens, prompt_logprobs, last.times)


def _put_threadsafe(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the caller's loop closed; nobody is listening
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)

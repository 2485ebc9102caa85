"""Helpers for tests that run requests through an engine over the demo model."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from engines.runtime.core.engine import Engine
from engines.runtime.frontend.async_engine import AsyncEngine
from engines.runtime.core.request import GenerationRequest, GrammarMode, RequestOutput
from engines.runtime.core.sampler import SamplingParams


@dataclasses.dataclass
class Result:
    """Everything a request produced, joined across its outputs, per choice."""

    texts: dict[int, str]
    token_ids: dict[int, list[int]]
    finish_reasons: dict[int, str | None]
    logprobs: dict[int, list]
    usage: dict | None = None

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def tokens(self) -> list[int]:
        return self.token_ids[0]

    @property
    def finish_reason(self) -> str | None:
        return self.finish_reasons[0]


def collect(results: dict[str, Result], outputs: Iterable[RequestOutput]) -> None:
    for out in outputs:
        r = results.setdefault(out.request_id, Result({}, {}, {}, {}))
        for c in out.choices:
            r.texts[c.index] = r.texts.get(c.index, "") + c.text
            r.token_ids.setdefault(c.index, []).extend(c.token_ids)
            r.logprobs.setdefault(c.index, []).extend(c.logprobs or [])
            if c.finish_reason is not None:
                r.finish_reasons[c.index] = c.finish_reason
        if out.usage is not None:
            r.usage = out.usage


def run_all(engine: Engine, requests: list[GenerationRequest], max_steps: int = 10_000) -> dict[str, Result]:
    """Add every request, step the engine until all finish, return their results."""
    results: dict[str, Result] = {}
    for req in requests:
        engine.add_request(req)
    for _ in range(max_steps):
        if not engine.has_work:
            break
        collect(results, engine.step())
    assert not engine.has_work, "engine did not finish within max_steps"
    return results


def request(rid: str, prompt: list[int] | str, tokenizer=None, *, response_format: dict | None = None,
            system_prompt_tokens: int | None = None, pin_system_prompt: bool = False,
            grammar_mode: GrammarMode = GrammarMode.JUMP_FORWARD, **sampling: Any) -> GenerationRequest:
    """A greedy 8-token request unless ``sampling`` says otherwise (any ``SamplingParams`` field)."""
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **sampling})
    return GenerationRequest(rid, list(prompt), params, response_format=response_format,
                             system_prompt_tokens=system_prompt_tokens, pin_system_prompt=pin_system_prompt,
                             grammar_mode=grammar_mode)


def prompts(demo, count: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    """Distinct random prompts of ordinary (non-special) tokens."""
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(300, demo.config.vocab_size - 10, size=length))) for _ in range(count)]


async def consume(engine: AsyncEngine, req) -> Result:
    results: dict[str, Result] = {}
    async for out in engine.generate(req):
        collect(results, [out])
    return results[req.request_id]


def lane_events(trace: dict, request_id: str) -> list[dict]:
    """The events of ``request_id``'s lane in a dumped trace (the lane is named by its
    ``thread_name``; events do not repeat the id)."""
    tids = {e["tid"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] != 0 and e["args"]["name"] == request_id}
    return [e for e in trace["traceEvents"] if e["ph"] != "M" and e["tid"] in tids]


def full_forward_logprobs(model, prompt: list[int]) -> np.ndarray:
    """The plain reference of prompt logprobs: log-softmax (float64 NumPy) of every position's
    float32 logits, the prompt in one full-sequence forward of ``model`` on a KV cache of its own."""
    from engines.runtime.model.forward_batch import ForwardBatch

    pages = -(-len(prompt) // 16)
    kv = model.new_kv_cache(pages, 16)
    batch = ForwardBatch(np.array(prompt, np.int32), np.array([0, len(prompt)], np.int32), np.array([0], np.int32),
                         np.arange(pages, dtype=np.int32)[None, :], all_logits=True)
    logits = model.forward(batch, kv).astype(np.float64)
    peak = logits.max(axis=1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))

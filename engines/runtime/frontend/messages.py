"""The typed messages between ``AsyncEngine`` and the engine core (see ``docs/interfaces.md``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.runtime.core.engine import EngineConfig

__all__ = ["EngineInfo", "EngineSpec"]


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know of its engine, fixed once the model is loaded."""

    backend_name: str
    dtype: str
    vocab_size: int
    max_seq_len: int
    tracing: bool


@dataclass(frozen=True)
class EngineSpec:
    """Everything a child process needs to build the engine its parent asked for (picklable)."""

    checkpoint_path: Path
    name: str
    config: EngineConfig
    backend: str = "auto"
    dtype: str = "float32"
    enable_tracing: bool = False
    epoch_anchor_ns: int = 0

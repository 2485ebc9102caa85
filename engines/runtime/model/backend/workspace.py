"""Activation buffers for a step, on any backend: a :class:`Workspace` grows to the largest step
seen and is reused after that, so a steady decode loop allocates nothing, on either backend."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.runtime.model.backend.contract import Array, Backend

__all__ = ["Activations", "Workspace"]


@dataclass
class Activations:
    """Views of the :class:`Workspace` sized for one step (``T`` tokens, ``R`` logit rows)."""

    hidden: Array    # [T, hidden] the residual stream
    delta: Array     # [T, hidden] the last sublayer's output, not yet added to ``hidden``
    normed: Array    # [T, hidden] RMSNorm output, the next matmul's input
    qkv: Array       # [T, (q_heads + 2 * kv_heads) * head_dim]
    attn: Array      # [T, q_heads * head_dim]
    gate_up: Array   # [T, 2 * intermediate]
    act: Array       # [T, intermediate]
    final: Array     # [R, hidden] final-normed rows that feed the LM head
    logits: Array    # [R, vocab]
    next_ids: Array  # [R] int32 greedy tokens
    no_residual: Array  # [0, hidden]: "nothing to add" for the first layer's norm


class Workspace:
    """Activation buffers reused across steps: one flat buffer per activation, grown (never
    shrunk) to the largest step seen; a step takes contiguous views of their fronts."""

    _TOKEN_WIDTHS = ("hidden", "delta", "normed", "qkv", "attn", "gate_up", "act")
    _ROW_WIDTHS = ("final", "logits")

    def __init__(self, backend: Backend, widths: dict[str, int]) -> None:
        self.backend = backend
        self.widths = widths
        self._flat: dict[str, Array] = {}
        self._capacity = (0, 0)
        self._views: dict[tuple[int, int], Activations] = {}
        self._no_residual = backend.empty((0, widths["hidden"]), np.float32)

    def activations(self, num_tokens: int, num_rows: int) -> Activations:
        """Buffers for a step of ``num_tokens`` new tokens and ``num_rows`` logit rows."""
        views = self._views.get((num_tokens, num_rows))
        if views is not None:
            return views
        tokens_cap, rows_cap = self._capacity
        if num_tokens > tokens_cap or num_rows > rows_cap:
            # Grow by doubling so that a slowly growing prefill does not reallocate each step.
            tokens_cap = max(num_tokens, 2 * tokens_cap)
            rows_cap = max(num_rows, 2 * rows_cap)
            for name in self._TOKEN_WIDTHS:
                self._flat[name] = self.backend.empty((tokens_cap * self.widths[name],), np.float32)
            for name in self._ROW_WIDTHS:
                self._flat[name] = self.backend.empty((rows_cap * self.widths[name],), np.float32)
            self._flat["next_ids"] = self.backend.empty((rows_cap,), np.int32)
            self._capacity = (tokens_cap, rows_cap)
            self._views.clear()

        def view(name: str, rows: int) -> Array:
            width = self.widths[name]
            return self._flat[name][: rows * width].reshape(rows, width)

        views = Activations(
            **{name: view(name, num_tokens) for name in self._TOKEN_WIDTHS},
            **{name: view(name, num_rows) for name in self._ROW_WIDTHS},
            next_ids=self._flat["next_ids"][:num_rows],
            no_residual=self._no_residual,
        )
        # Decode steps repeat the same few shapes: keep their views (cheap on the host, but
        # a DeviceNDArray view costs tens of microseconds to build).
        if len(self._views) >= 64:
            self._views.clear()
        self._views[(num_tokens, num_rows)] = views
        return views

"""What each sampling row of a step gets as its next token (``TokenPicker``).

The update's first half: the device's argmax when the forward pass ran greedy, else the
sampler's draw under each row's mask: the grammar's allowed tokens (``core.grammar``) and
``min_tokens``' ban on early EOS and stop tokens (``core.stop_checker``). A row whose grammar
fails gets its exception instead of a token: that request fails alone, the batch samples on.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from engines.runtime.core.grammar import GrammarError
from engines.runtime.core.sampler import Sampler, TokenLogprob

if TYPE_CHECKING:
    from engines.runtime.core.model_runner import ModelOutput
    from engines.runtime.core.scheduler import ScheduledChunk
    from engines.runtime.core.step_observer import StepObserver

__all__ = ["Pick", "TokenPicker"]

#: A row's pick: its token and (when asked for) its logprob, or why its grammar failed.
Pick: TypeAlias = tuple[int, TokenLogprob | None] | Exception


class TokenPicker:
    """Picks a token for every sampling row of a step; engine thread only.

    Args:
        vocab_size: the model's vocabulary (the masks' width).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.sampler = Sampler(vocab_size)

    def pick(self, output: ModelOutput, obs: StepObserver | None) -> list[Pick]:
        """(token, logprob) per sampling row: the device's argmax, or the sampler's draw under the
        row's grammar mask.

        A row whose grammar failed to give a mask gets the exception instead: that request fails
        alone (the engine's update), the rest of the batch samples as usual. ``obs``: the step's
        observer (None: nobody watches).
        """
        if output.token_ids is not None:
            return [(int(t), None) for t in output.token_ids]
        sampled, logits = output.sampled, output.logits
        assert logits is not None, "a step's output holds token ids or logits"
        masks, failures = self._grammar_masks(sampled, obs)
        self._ban_early_stops(sampled, masks)
        if obs is not None:
            obs.lap("grammar")
            sample_ids = [c.seq.request.request_id for c in sampled]
            obs.event(sample_ids, "start sampling")
        picked = self.sampler.sample(logits, [c.seq.sampling for c in sampled], masks)
        if obs is not None:
            obs.event(sample_ids, "finish sampling")
        return [failures[i] if i in failures
                else (int(picked.token_ids[i]), picked.logprobs[i] if picked.logprobs else None)
                for i in range(len(sampled))]

    def _grammar_masks(self, sampled: list[ScheduledChunk],
                       obs: StepObserver | None) -> tuple[list[np.ndarray | None], dict[int, Exception]]:
        """Each row's allowed next tokens (``None``: no grammar), and the rows whose grammar failed."""
        masks: list[np.ndarray | None] = [None] * len(sampled)
        failures: dict[int, Exception] = {}
        grammars = {i: c.seq.grammar for i, c in enumerate(sampled) if c.seq.grammar is not None}
        grammar_rows = list(grammars)
        if not grammar_rows:
            return masks, failures
        if obs is not None:
            grammar_ids = [sampled[i].seq.request.request_id for i in grammar_rows]
            obs.event(grammar_ids, "start apply logit mask")
        rows_mask = np.empty((len(grammar_rows), self.vocab_size), dtype=np.bool_)
        for j, i in enumerate(grammar_rows):
            t0 = time.perf_counter()
            try:
                grammars[i].fill_mask(rows_mask[j])
                if not rows_mask[j].any():  # the sampler would fail the whole batch on this row
                    raise GrammarError("the grammar allows no next token")
            except Exception as e:  # noqa: BLE001 - fails this request alone; its row samples unmasked, unused
                failures[i] = e
                continue
            masks[i] = rows_mask[j]
            sampled[i].seq.request.anatomy.grammar_pending += time.perf_counter() - t0
        if obs is not None:
            obs.event(grammar_ids, "finish apply logit mask")
        return masks, failures

    def _ban_early_stops(self, sampled: list[ScheduledChunk], masks: list[np.ndarray | None]) -> None:
        """``min_tokens``: no EOS or stop token among a choice's first ``min_tokens`` tokens (vLLM
        bans them from sampling too). A grammar that allows nothing else keeps its mask: its end wins."""
        for i, chunk in enumerate(sampled):
            banned = chunk.seq.stop_checker.banned_tokens()
            if not banned:
                continue
            ids = np.fromiter((t for t in banned if t < self.vocab_size), dtype=np.int64)
            mask = masks[i]
            if mask is None:
                mask = masks[i] = np.ones(self.vocab_size, dtype=np.bool_)
            allowed = mask[ids].copy()
            mask[ids] = False
            if not mask.any():
                mask[ids] = allowed

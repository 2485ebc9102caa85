"""When a request stops, and what text it may stream meanwhile.

One ``StopChecker`` per choice. The engine passes every output token (sampled or
jump-forward) with the text it added (from the incremental detokenizer) to
``step``, streams the returned ``text``, and finishes the choice when
``finish_reason`` is set. A stop token (``is_stop_token``) comes instead with the
text the tokens before it still owed (the detokenizer's final flush, e.g. a
byte-fallback character it was holding back): the stop token ends that text.

- ``"stop"``: an EOS token, one of ``stop_token_ids``, or one of the ``stop``
  strings. Following OpenAI, the stop token's text and the stop string are not
  part of the output, nor is anything generated after the stop string. With
  several stop strings, the first one to be complete in the text wins.
- ``"length"``: ``max_tokens`` reached (or the engine's cap, e.g. the context).

A stop string can arrive split over several tokens, so text that could be the
start of a stop string is held back until it is known not to be one (OpenAI
streams never show a partial stop string either). When the engine ends a choice
for a reason of its own (a finished grammar, an abort) it calls ``flush`` for the
held-back text.

``ignore_eos`` (MLC's ``debug_config``) turns off EOS, stop tokens and stop
strings alike: only the length limit ends the choice here.

``min_tokens`` (vLLM's): the first ``min_tokens`` tokens never end the choice. An EOS or
stop token among them is an ordinary token (the engine bans them from sampling meanwhile:
``banned_tokens``), and stop strings are looked for only in the text of the tokens after
them, so no match can begin inside that text (vLLM looks a stop string's length back).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engines.runtime.core.finish_reason import FinishReason
from engines.runtime.core.sampler import SamplingParams

__all__ = ["StopCheck", "StopChecker"]


@dataclass(frozen=True)
class StopCheck:
    """Result of one ``StopChecker.step``.

    ``text``: new output text that is safe to stream (possibly empty while text is
    held back). ``finish_reason``: ``FinishReason.STOP``, ``FinishReason.LENGTH`` or
    ``None`` while running. ``stop_reason`` (as vLLM): the matched stop string or stop
    token id; ``None`` for EOS, for ``"length"`` and while running.
    """

    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class StopChecker:
    """Incremental stop detection for one choice; see the module docstring."""

    def __init__(self, stop: Sequence[str] = (), stop_token_ids: Iterable[int] = (),
                 eos_token_ids: Iterable[int] = (), max_tokens: int | None = None,
                 ignore_eos: bool = False, min_tokens: int = 0) -> None:
        # 0: a choice that samples nothing (the engine ends it once its prompt is computed).
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {max_tokens}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {min_tokens}")
        self._stop = () if ignore_eos else tuple(s for s in stop if s)
        self._stop_token_ids = frozenset() if ignore_eos else frozenset(int(t) for t in stop_token_ids)
        self._eos = frozenset() if ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self._max_tokens = max_tokens
        self._min_tokens = min_tokens
        self._held = ""  # output text not yet streamed: it may begin a stop string
        self.num_tokens = 0
        self.finished = False

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int],
                    max_tokens_cap: int | None = None) -> StopChecker:
        """A checker for a request: its stops and limits, the checkpoint's EOS ids.

        ``max_tokens_cap`` is the engine's own limit (tokens left in the context);
        the smaller of it and ``params.max_tokens`` applies.
        """
        limits = [m for m in (params.max_tokens, max_tokens_cap) if m is not None]
        return cls(stop=params.stop, stop_token_ids=params.stop_token_ids, eos_token_ids=eos_token_ids,
                   max_tokens=min(limits) if limits else None, ignore_eos=params.ignore_eos,
                   min_tokens=params.min_tokens)

    def is_stop_token(self, token_id: int) -> bool:
        """Whether ``token_id``, as the next token, ends the choice: an EOS or a stop token (never
        with ``ignore_eos``, nor among the first ``min_tokens``)."""
        return self.num_tokens >= self._min_tokens and (token_id in self._eos or token_id in self._stop_token_ids)

    def banned_tokens(self) -> frozenset[int]:
        """The tokens the next one must not be: the EOS and stop tokens while the first
        ``min_tokens`` are still to come (empty otherwise, and with ``ignore_eos``)."""
        if self.num_tokens >= self._min_tokens:
            return frozenset()
        return self._eos | self._stop_token_ids

    def step(self, token_id: int, text: str) -> StopCheck:
        """Account for one output token and the text it added to the output.

        For a stop token, ``text`` is what the tokens before it still owed, never the
        stop token's own text (which is not output): it is output, and checked for
        stop strings like any other text.
        """
        if self.finished:
            raise RuntimeError("StopChecker.step called after the choice finished")
        stop_token = self.is_stop_token(token_id)  # judged as the next token, before it is counted
        self.num_tokens += 1
        scan = bool(self._stop) and self.num_tokens > self._min_tokens
        out, matched = self._scan(text) if scan else (text, None)
        if matched is not None:
            return self._finish(FinishReason.STOP, matched, out)
        if stop_token:
            # What was held back is output: no stop string can complete any more.
            reason = None if token_id in self._eos and token_id not in self._stop_token_ids else token_id
            return self._finish(FinishReason.STOP, reason, out + self.flush())
        if self._max_tokens is not None and self.num_tokens >= self._max_tokens:
            return self._finish(FinishReason.LENGTH, None, out + self.flush())
        return StopCheck(out)

    def flush(self) -> str:
        """Release the held-back text (the choice ends without a stop string match)."""
        text, self._held = self._held, ""
        return text

    def _scan(self, text: str) -> tuple[str, str | None]:
        """(text to stream, matched stop string) after appending ``text`` to the held text."""
        pending = self._held + text
        # The match that *ends* first wins (the longest one if several end there), as
        # if the text arrived one character at a time: the result then does not
        # depend on how the tokenizer cut the text. No match can start before
        # `pending`, or its beginning would still be held back.
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for s in self._stop:
            i = pending.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            self._held = ""
            end, neg_len, matched = best
            return pending[:end + neg_len], matched
        keep = self._longest_partial_stop(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], None

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _finish(self, reason: FinishReason, stop_reason: str | int | None, text: str) -> StopCheck:
        self.finished = True
        return StopCheck(text, reason, stop_reason)

"""Sampling: request parameters, per-request sampling state, and the batch sampler.

The engine builds one ``SamplingState`` per choice when a request arrives and keeps it
for the request's life (across preemptions). Each step it calls
``Sampler.sample(logits, states, masks)`` on the host logits of the batch's last
positions and gets one token per row, plus log-probabilities when asked.

Per row, in order (each step is skipped when it does nothing):

1. ``logit_bias`` is added (-100..100 as OpenAI, effectively ban/force).
2. ``repetition_penalty`` (HF/vLLM: positive logits divided, negative ones
   multiplied) over tokens seen in the prompt or the output.
3. ``frequency_penalty`` * count + ``presence_penalty`` * (count > 0) subtracted,
   counts over the output only (OpenAI).
4. The grammar mask: disallowed tokens get ``-inf``; applied last so that no bias
   can bring a forbidden token back.
5. **Log-probabilities are taken here**: the log-softmax of the logits after
   steps 1-4 and before temperature, top-k and top-p. So they describe what the
   model (with the user's own bias and penalties) thinks of each token, do not
   change with temperature, and are never ``-inf`` for a sampled token. (OpenAI and
   vLLM's default report the raw model log-softmax, before bias and penalties; the
   difference only shows when those are set.)
6. Greedy (``temperature == 0`` or ``top_k == 1``): argmax. Otherwise divide by the
   temperature, keep the ``top_k`` most likely, then the smallest most-likely set
   whose mass reaches ``top_p``, and draw one token from what is left.

Reproducibility: every row draws from its own ``np.random.Generator`` (seeded
from ``seed`` and the choice index), exactly one uniform number per sampled token,
and a row's computation never depends on the other rows, so the same seed gives
the same tokens whatever the batch around it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

import numpy as np

from engines.runtime.core.limits import REQUEST_LIMITS

__all__ = [
    "InvalidSamplingParams",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingState",
    "TokenLogprob",
]

# First candidate-set size tried when looking for the top-p nucleus: almost always enough.
_NUCLEUS_PREFILTER = 256


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; ``field`` names it, ``reason`` says why.

    The message is ``"<field> <reason>"``. The server turns it into a 400 whose ``param``
    is the field, so this is the one check of these ranges for HTTP and direct callers alike.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_range(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidSamplingParams(name, f"must be a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        low = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        raise InvalidSamplingParams(name, f"must be {low} and at most {hi:g}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops; validated on construction.

    Defaults are OpenAI's, ranges come from ``REQUEST_LIMITS``. ``top_k`` of -1 or 0 means
    off. ``max_tokens=None`` means "until the context is full" (the engine caps it).
    ``stop`` accepts a string or a list and is stored as a tuple. ``logit_bias`` maps
    token ids to biases; check the ids against the model with ``check_vocab``.
    ``ignore_eos`` (MLC ``debug_config``) disables EOS, ``stop_token_ids`` and ``stop``
    strings: only ``max_tokens``, the context limit or a finished grammar end the request.
    ``min_tokens`` (vLLM's): the first ``min_tokens`` output tokens of each choice are never
    an EOS or stop token (the sampler bans them) and no stop string ends the choice inside
    them; at most ``max_tokens``. A finished grammar and the context limit still end it.
    ``max_tokens=0`` computes the prompt and samples nothing (the request ends ``length``):
    with ``prompt_logprobs``, a scoring request. ``prompt_logprobs`` (vLLM's name; None: off)
    asks for every prompt token's logprob (none for the first) and that many of the most
    likely alternatives at each position (0: the token's own only); the engine's prefill
    computes them (``core.prompt_logprobs``).

    Raises ``InvalidSamplingParams`` naming the first bad field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        limits = REQUEST_LIMITS
        _check_range("temperature", self.temperature, limits.temperature_min, limits.temperature_max)
        _check_range("top_p", self.top_p, limits.top_p_min_exclusive, limits.top_p_max, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidSamplingParams("top_k", f"must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidSamplingParams("seed", f"must be an integer, got {self.seed!r}")
        _check_range("frequency_penalty", self.frequency_penalty, limits.penalty_min, limits.penalty_max)
        _check_range("presence_penalty", self.presence_penalty, limits.penalty_min, limits.penalty_max)
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            raise InvalidSamplingParams(
                "repetition_penalty", f"must be a number greater than 0, got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", self._normalise_logit_bias(self.logit_bias))
        object.__setattr__(self, "stop", self._normalise_stop(self.stop))
        stop_ids = tuple(self.stop_token_ids or ())
        for tid in stop_ids:
            if not _is_int(tid) or tid < 0:
                raise InvalidSamplingParams("stop_token_ids", f"must hold non-negative integers, got {tid!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise InvalidSamplingParams(
                "max_tokens", f"must be a positive integer (or 0: the prompt only), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidSamplingParams("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(name, f"must be a boolean, got {getattr(self, name)!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= limits.max_top_logprobs:
            raise InvalidSamplingParams(
                "top_logprobs", f"must be an integer from 0 to {limits.max_top_logprobs}, got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidSamplingParams("top_logprobs", "requires logprobs to be true")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= limits.max_top_logprobs):
            raise InvalidSamplingParams(
                "prompt_logprobs", f"must be null (off) or an integer from 0 to {limits.max_top_logprobs}, "
                                   f"got {self.prompt_logprobs!r}")
        if not _is_int(self.n) or not 1 <= self.n <= limits.max_n:
            raise InvalidSamplingParams(
                "n", f"must be an integer from 1 to {limits.max_n} (choices per request on this server; "
                     f"send several requests for more), got {self.n!r}")

    @staticmethod
    def _normalise_logit_bias(bias: Mapping[int, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        if not isinstance(bias, Mapping):
            raise InvalidSamplingParams("logit_bias", f"must map token ids to biases, got {bias!r}")
        lo, hi = REQUEST_LIMITS.logit_bias_min, REQUEST_LIMITS.logit_bias_max
        out: dict[int, float] = {}
        for key, value in bias.items():
            if not _is_int(key):
                raise InvalidSamplingParams("logit_bias", f"keys must be token ids (integers), got {key!r}")
            tid = int(key)
            if tid < 0:
                raise InvalidSamplingParams("logit_bias", f"token id {tid} is negative")
            if not _is_number(value) or not lo <= value <= hi:  # NaN fails the comparison too
                raise InvalidSamplingParams(
                    "logit_bias", f"values must be numbers from {lo:g} to {hi:g}, got {value!r} for token {tid}")
            out[tid] = float(value)
        return out

    @staticmethod
    def _normalise_stop(stop: str | Iterable[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else tuple(stop)
        most = REQUEST_LIMITS.max_stop_sequences
        if len(items) > most:
            raise InvalidSamplingParams("stop", f"allows at most {most} sequences, got {len(items)}")
        for s in items:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams(
                    "stop", f"sequences must be non-empty strings (an empty one would end every choice at once), "
                            f"got {s!r}")
        return items

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids (``logit_bias`` keys, ``stop_token_ids``) outside the model's vocabulary."""
        for tid in self.logit_bias or ():
            if tid >= vocab_size:
                raise InvalidSamplingParams(
                    "logit_bias", f"token id {tid} is out of the vocabulary (size {vocab_size})")
        for tid in self.stop_token_ids:
            if tid >= vocab_size:
                raise InvalidSamplingParams(
                    "stop_token_ids", f"token id {tid} is out of the vocabulary (size {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        """Deterministic argmax: temperature 0, or only the single most likely token kept."""
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a produced token and, if asked, of the most likely alternatives.

    ``top_logprobs`` is sorted most likely first and leaves out tokens the grammar
    forbids (their log-probability is ``-inf``), so it can be shorter than asked.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class SamplerOutput:
    """One step's result: ``token_ids[i]`` for row ``i``; ``logprobs[i]`` when the row asked."""

    token_ids: np.ndarray  # int32 [B]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


class SamplingState:
    """Per-choice sampling state, kept for the life of a request.

    Holds the random generator and the token statistics the penalties need. Created
    once per choice: with a ``seed``, choice ``i`` draws from a generator seeded by
    ``(seed, i)``, so the ``n`` choices differ from each other yet each is
    reproducible.

    ``Sampler.sample`` records the tokens it samples; tokens appended without
    sampling (grammar jump-forward) must be recorded with ``record_output`` so the
    penalties see them.
    """

    def __init__(self, params: SamplingParams, vocab_size: int,
                 prompt_token_ids: Sequence[int] = (), choice_index: int = 0) -> None:
        params.check_vocab(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        if params.seed is None:
            self.generator = np.random.default_rng()
        else:
            # SeedSequence wants non-negative entropy; OpenAI seeds may be negative.
            self.generator = np.random.default_rng([params.seed % 2**64, choice_index])
        self._bias_ids: np.ndarray | None = None
        self._bias_values: np.ndarray | None = None
        if params.logit_bias:
            self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            self._bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32)
        # Dense per-vocabulary arrays, only for requests that use penalties: one
        # vectorised pass a step instead of a Python loop over the distinct tokens.
        self._counts: np.ndarray | None = None
        if params.frequency_penalty or params.presence_penalty:
            self._counts = np.zeros(vocab_size, dtype=np.float32)
        self._seen: np.ndarray | None = None
        if params.repetition_penalty != 1.0:
            self._seen = np.zeros(vocab_size, dtype=bool)
            self._seen[np.asarray(prompt_token_ids, dtype=np.int64)] = True

    @property
    def modifies_logits(self) -> bool:
        """Whether bias or penalties change this row's logits (else the fast paths apply)."""
        return self._bias_ids is not None or self._counts is not None or self._seen is not None

    def record_output(self, token_ids: Iterable[int]) -> None:
        """Count generated tokens for the penalties."""
        if self._counts is None and self._seen is None:
            return
        ids = np.fromiter(token_ids, dtype=np.int64)
        if self._counts is not None:
            np.add.at(self._counts, ids, 1.0)
        if self._seen is not None:
            self._seen[ids] = True

    def apply(self, logits: np.ndarray) -> None:
        """Steps 1-3 of the module docstring, in place on one row of float32 logits."""
        if self._bias_ids is not None:
            logits[self._bias_ids] += self._bias_values
        if self._seen is not None:
            r = self.params.repetition_penalty
            seen = logits[self._seen]
            logits[self._seen] = np.where(seen > 0, seen / r, seen * r)
        if self._counts is not None:
            p = self.params
            logits -= self._counts * np.float32(p.frequency_penalty)
            if p.presence_penalty:
                logits -= (self._counts > 0) * np.float32(p.presence_penalty)


class Sampler:
    """Picks the next token of every row of a batch from host logits.

    Stateless apart from the vocabulary size; all per-request state lives in the
    ``SamplingState`` objects passed in, so one sampler serves the whole engine.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def sample(self, logits: np.ndarray, states: Sequence[SamplingState],
               masks: Sequence[np.ndarray | None] | None = None) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: float32 ``[B, V]`` host logits (not modified).
            states: ``B`` sampling states, one per row.
            masks: optional ``B`` entries, each ``None`` (unconstrained) or a bool
                ``[V]`` row of allowed tokens (``GrammarMatcher.fill_mask``).

        Returns token ids (int32 ``[B]``) and, for rows whose params ask for
        ``logprobs``, a ``TokenLogprob`` (else ``None``). Sampled tokens are
        recorded in their states for the penalties.

        Raises ``ValueError`` if a row allows no token at all (an empty grammar
        mask): the caller should have finished that request.
        """
        if logits.ndim != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits shape {logits.shape} does not match {len(states)} sampling states")
        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, the vocabulary has {self.vocab_size}")
        batch = len(states)
        masks = masks if masks is not None else [None] * batch
        token_ids = np.empty(batch, dtype=np.int32)
        logprobs: list[TokenLogprob | None] = [None] * batch

        # Fast path: plain greedy rows need neither a copy nor a softmax.
        plain = [i for i, s in enumerate(states)
                 if s.params.is_greedy and not s.params.logprobs and not s.modifies_logits
                 and masks[i] is None]
        if len(plain) == batch:
            token_ids[:] = np.argmax(logits, axis=1)
        elif plain:
            token_ids[plain] = np.argmax(logits[plain], axis=1)

        plain_set = set(plain)
        for i, state in enumerate(states):
            if i in plain_set:
                continue
            params = state.params
            row = np.array(logits[i], dtype=np.float32)  # a copy: penalties work in place
            state.apply(row)
            mask = masks[i]
            if mask is not None:
                row[~mask] = -np.inf
            peak = row.max()
            if not np.isfinite(peak):
                raise ValueError(f"row {i}: no token is allowed (every logit is -inf)")
            if params.is_greedy:
                token = int(np.argmax(row))
            else:
                token = self._sample_row(row, peak, params, state.generator)
            token_ids[i] = token
            if params.logprobs:
                logprobs[i] = self._logprobs(row, peak, token, params.top_logprobs)

        for i, state in enumerate(states):
            state.record_output((int(token_ids[i]),))
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _logprobs(row: np.ndarray, peak: np.float32, token: int, top: int) -> TokenLogprob:
        """Log-softmax of the processed row (before temperature) at ``token`` and its top-``top``."""
        lse = float(peak) + math.log(float(np.exp(row - peak).sum(dtype=np.float64)))
        alternatives: tuple[tuple[int, float], ...] = ()
        if top:
            k = min(top, row.size)
            idx = np.argpartition(-row, k - 1)[:k]
            # Most likely first; equal logits in id order so the output is stable.
            idx = idx[np.lexsort((idx, -row[idx]))]
            alternatives = tuple((int(t), float(row[t]) - lse) for t in idx if np.isfinite(row[t]))
        return TokenLogprob(token_id=token, logprob=float(row[token]) - lse, top_logprobs=alternatives)

    @staticmethod
    def _sample_row(row: np.ndarray, peak: np.float32, params: SamplingParams,
                    generator: np.random.Generator) -> int:
        """Temperature, top-k, top-p, then one inverse-CDF draw."""
        # Subtract the max before dividing: a tiny temperature must not overflow.
        probs = np.exp((row - peak) / np.float32(params.temperature))
        candidates: np.ndarray | None = None  # token ids still in play; None = all, in id order
        k = params.top_k
        if 0 < k < probs.size:
            candidates = np.argpartition(-probs, k - 1)[:k]
        if params.top_p < 1.0:
            candidates = Sampler._nucleus(probs, candidates, params.top_p)
        if candidates is None:
            weights = probs
        else:
            weights = probs[candidates]
        cdf = np.cumsum(weights, dtype=np.float64)
        u = generator.random() * cdf[-1]
        pick = min(int(np.searchsorted(cdf, u, side="right")), cdf.size - 1)
        return pick if candidates is None else int(candidates[pick])

    @staticmethod
    def _nucleus(probs: np.ndarray, candidates: np.ndarray | None, top_p: float) -> np.ndarray:
        """Smallest most-likely subset of ``candidates`` whose mass reaches ``top_p`` of theirs."""
        if candidates is None:
            total = probs.sum(dtype=np.float64)
            candidates = np.arange(probs.size)
            # Exact shortcut: if the h most likely tokens already hold top_p of the
            # mass, the nucleus lies among them, and sorting h tokens (after an O(V)
            # partition) is much cheaper than sorting the vocabulary. Grow h by 8x
            # until it holds; real models' nuclei rarely need more than the first try.
            head_size = _NUCLEUS_PREFILTER
            while head_size < probs.size:
                head = np.argpartition(-probs, head_size - 1)[:head_size]
                if probs[head].sum(dtype=np.float64) >= top_p * total:
                    candidates = head
                    break
                head_size *= 8
        else:
            total = probs[candidates].sum(dtype=np.float64)
        weights = probs[candidates]
        order = np.lexsort((candidates, -weights))  # most likely first, ties by id
        sorted_ids = candidates[order]
        cdf = np.cumsum(weights[order], dtype=np.float64)
        keep = int(np.searchsorted(cdf, top_p * total, side="left")) + 1
        return sorted_ids[:min(keep, sorted_ids.size)]

"""Structured output: OpenAI ``response_format`` compiled to llguidance grammars.

Three pieces, by lifetime:

- ``GrammarCompiler``: one per engine. Holds llguidance's view of the tokenizer and
  an LRU cache of compiled grammars keyed by the canonical schema, so a schema used
  by many requests is compiled once.
- ``CompiledGrammar``: a checked grammar, shared by every request using it. Its
  ``matcher()`` is a cheap copy of a pristine matcher (llguidance shares the
  compiled lexer and parser tables between copies).
- ``GrammarMatcher``: one per request (per choice), following the tokens it emits.

How the engine drives a matcher, per step of a constrained request:

1. ``fill_mask(row)`` into the bool row handed to ``Sampler.sample`` as its mask.
2. After sampling token ``t``: ``consume([t])``. If ``is_finished()``, the output is
   complete (the grammar allows nothing more): finish the request with ``"stop"``.
3. In ``jump_forward`` mode: ``forced = forced_tokens()``; if not empty,
   ``consume(forced)`` and append them to the output without sampling them; the
   next forward pass feeds ``[t] + forced`` (count them as jump-forward tokens, and
   record them in the ``SamplingState`` for penalties). In ``constraint`` mode skip
   this step: the mask alone keeps the output valid.

The EOS token is allowed by the mask exactly when the output so far is complete
(``is_accepting()``); sampling it ends the request as usual.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np

if TYPE_CHECKING:  # declared in llguidance's stub only
    from llguidance._lib import JsonCompileOptions

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarMatcher"]

# Compact JSON: no free whitespace between tokens. Small models otherwise tend to
# loop on whitespace, and fixed punctuation is what makes jump-forward pay
# (`{"name":"` is forced in one go). A schema's own "x-guidance" options win.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
# Short errors: the verbose form dumps parser state and the whole grammar into
# a message that ends up in an HTTP response.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_ANY_JSON_OBJECT: dict = {"type": "object"}


class GrammarError(ValueError):
    """A response_format that cannot be compiled, or a token the grammar rejects.

    The message is llguidance's own when it comes from llguidance (e.g. ``Invalid
    type: strin``), prefixed with what we were doing.
    """


class GrammarMatcher:
    """Tracks one request's output against its grammar; see the module docstring."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        # llguidance writes one bit per token in 32-bit words; kept per matcher so
        # fill_mask allocates nothing per step.
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (bool ``[vocab_size]``, overwritten)."""
        if out.shape != (self.vocab_size,) or out.dtype != np.bool_:
            raise ValueError(f"mask row must be bool [{self.vocab_size}], got {out.dtype} {out.shape}")
        self._raise_if_error("computing the token mask")
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        # Bit i of word j is token 32*j + i: on a little-endian host that is bit
        # (i % 8) of byte 4*j + i // 8, which is what bitorder="little" unpacks.
        out.view(np.uint8)[:] = np.unpackbits(self._words.view(np.uint8), bitorder="little",
                                               count=self.vocab_size)
        self._raise_if_error("computing the token mask")

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward); not consumed yet.

        Empty when the next token is a real choice. llguidance stops short of bytes
        that a longer token could still cover, so the tokenisation stays canonical.
        """
        self._raise_if_error("computing forced tokens")
        return list(self._matcher.compute_ff_tokens())

    def consume(self, token_ids: Sequence[int]) -> None:
        """Advance over emitted tokens; ``GrammarError`` if the grammar rejects one."""
        if not self._matcher.consume_tokens([int(t) for t in token_ids]):
            raise GrammarError(f"grammar rejected token(s) {list(token_ids)}: {self._matcher.get_error()}")

    def is_finished(self) -> bool:
        """The grammar allows no further token except EOS: the output is complete."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """llguidance's error once the matcher has failed (it never recovers), else ``None``."""
        return self._matcher.get_error() or None

    def _raise_if_error(self, doing: str) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"grammar error while {doing}: {self._matcher.get_error()}")


class CompiledGrammar:
    """A grammar checked against the tokenizer; ``matcher()`` starts a request on it."""

    def __init__(self, pristine: llguidance.LLMatcher, vocab_size: int, warnings: list[str]) -> None:
        self.warnings = warnings  # e.g. keywords ignored by a non-strict schema
        self._pristine = pristine
        self._vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (a copy: the pristine one never moves)."""
        return GrammarMatcher(self._pristine.deep_copy(), self._vocab_size)


class GrammarCompiler:
    """Compiles ``response_format`` for one engine's tokenizer, caching by schema.

    Args:
        tokenizer_json: the HF ``tokenizer.json`` contents (``Tokenizer.tokenizer_json``).
        vocab_size: the model's logits width; masks have this length (it may exceed
            the tokenizer's vocabulary when the embedding is padded: the extra ids
            are never allowed).
        eos_token_ids: the checkpoint's EOS ids, allowed once the output is complete.
        cache_size: compiled grammars kept (least recently used dropped first).

    Thread-safe: the server may compile (to reject a bad schema with a 400 before
    queueing) while the engine thread starts matchers.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 64) -> None:
        if not eos_token_ids:
            raise ValueError("structured output needs at least one EOS token id")
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos = [int(t) for t in eos_token_ids]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, response_format: Mapping | None) -> CompiledGrammar | None:
        """Grammar for an OpenAI ``response_format``; ``None`` when output is free text.

        - ``None`` or ``{"type": "text"}``: no grammar.
        - ``{"type": "json_object"}``: any JSON object.
        - ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
          "strict": ...}}``: JSON matching the schema. With ``strict: true`` a schema
          keyword llguidance does not implement is an error; otherwise it is ignored
          (and listed in ``CompiledGrammar.warnings``). A missing ``schema`` means any
          JSON object (OpenAI marks it optional).

        Raises ``GrammarError`` with a message for the user.
        """
        schema, strict = self._schema_of(response_format)
        if schema is None:
            return None
        key = json.dumps({"schema": schema, "strict": strict}, sort_keys=True, separators=(",", ":"))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(schema, strict)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use (about a second for a 128k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
                except ValueError as e:
                    raise ValueError(f"llguidance cannot use this tokenizer: {e}") from e
            return self._tokenizer

    def _compile(self, schema: Mapping, strict: bool) -> CompiledGrammar:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                dict(schema), defaults=_JSON_DEFAULTS, overrides={"lenient": not strict})
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from e
        try:
            tokenizer = self.tokenizer
        except ValueError as e:  # this model cannot serve any response_format: the request's error
            raise GrammarError(f"structured output is unavailable for this model: {e}") from e
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=_LIMITS)
        if is_error:
            raise GrammarError(f"invalid JSON schema: {messages[0]}")
        pristine = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_LIMITS)
        if pristine.is_error():
            raise GrammarError(f"invalid JSON schema: {pristine.get_error()}")
        return CompiledGrammar(pristine, self.vocab_size, list(messages))

    @staticmethod
    def _schema_of(response_format: Mapping | None) -> tuple[Mapping | None, bool]:
        """(JSON schema or None for free text, strict flag) of a response_format."""
        if response_format is None:
            return None, False
        if not isinstance(response_format, Mapping):
            raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None, False
        if kind == "json_object":
            return _ANY_JSON_OBJECT, False
        if kind != "json_schema":
            raise GrammarError(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", _ANY_JSON_OBJECT)
        if not isinstance(schema, Mapping):
            raise GrammarError(f"response_format.json_schema.schema must be an object, got {schema!r}")
        strict = spec.get("strict") or False
        if not isinstance(strict, bool):
            raise GrammarError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
        return schema, strict

"""Tokenizers of Hugging Face checkpoints: encode, decode, stream, and render chat templates.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` built from ``tokenizer.json`` and
reproduces what ``transformers`` (5.x) does on top of it for the same checkpoint: which
special tokens ``encode`` adds, the special-token strings of ``tokenizer_config.json``, and how
a chat template is rendered (the same sandboxed Jinja2 environment, globals and filters), so
prompts match token for token what the model was trained and evaluated with.
:class:`IncrementalDetokenizer` turns a stream of generated ids into text deltas for SSE.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from engines.runtime.model.config import CheckpointError

# Used when a checkpoint ships no chat template: ChatML is what most small chat models
# (Qwen2, SmolLM, the demo model) were trained on, and it renders any role readably.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The names transformers passes to a chat template for the special tokens it knows.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ChatTemplateError(ValueError):
    """A chat template failed to render (bad template, or ``raise_exception`` inside it)."""


@dataclass(frozen=True)
class TokenizerSettings:
    """What ``tokenizer_config.json`` adds to ``tokenizer.json``."""

    special_tokens: Mapping[str, str]  # "bos_token" -> "<s>", ... (only those that are set)
    add_bos_token: bool | None         # None: not set; used only if tokenizer.json has no post-processor
    add_eos_token: bool | None
    chat_template: str | None

    @classmethod
    def from_config_dict(cls, raw: Mapping[str, Any]) -> "TokenizerSettings":
        """Read the fields we use from a parsed ``tokenizer_config.json``."""
        special: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = raw.get(name)
            # Older configs store special tokens as serialized AddedToken dicts.
            if isinstance(value, Mapping):
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
        return cls(
            special_tokens=special,
            add_bos_token=_optional_bool(raw.get("add_bos_token")),
            add_eos_token=_optional_bool(raw.get("add_eos_token")),
            chat_template=_chat_template_source(raw.get("chat_template")),
        )


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _chat_template_source(value: Any) -> str | None:
    # A config may carry several named templates as [{"name": ..., "template": ...}];
    # transformers uses the one called "default" for plain chat.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json`` settings.

    Build it with :meth:`from_folder` or :meth:`from_json`; the server and the engine use
    :meth:`encode`, :meth:`decode`, :meth:`apply_chat_template`, :meth:`detokenizer` and,
    for logprobs, :meth:`token_bytes` / :meth:`id_to_token`.
    """

    def __init__(self, tokenizer_json: str, settings: TokenizerSettings) -> None:
        try:
            self._tk = HFTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception on a bad file
            raise CheckpointError(f"tokenizer.json cannot be parsed by the tokenizers library: {exc}") from None
        self.tokenizer_json = tokenizer_json
        self.settings = settings
        self.chat_template: str | None = settings.chat_template
        self.special_tokens: dict[str, str] = dict(settings.special_tokens)
        self.bos_token_id: int | None = self._special_id("bos_token")
        self.eos_token_id: int | None = self._special_id("eos_token")
        self._apply_bos_eos_settings()
        # Whether encode(text) starts with BOS, as the model expects of a raw prompt.
        self.add_bos: bool = self.bos_token_id is not None and self.encode("")[:1] == [self.bos_token_id]
        added = self._tk.get_added_tokens_decoder()
        # Ids that decode(skip_special_tokens=True) drops; the streaming detokenizer needs them.
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_token_text: dict[int, str] = {i: t.content for i, t in added.items()}
        # The decoder's own JSON, rather than re-parsing tokenizer.json (megabytes for big vocabularies).
        decoder = json.loads(self._tk.decoder.__getstate__()) if self._tk.decoder is not None else None
        self._byte_level = _decoder_uses(decoder, "ByteLevel")
        # SentencePiece byte-fallback tokens ("<0xE6>"): the ByteFallback decoder turns a whole run
        # of them into text at once, or into one U+FFFD per token if the run is not valid UTF-8.
        self.byte_fallback_ids: frozenset[int] = frozenset(
            i for t, i in self._tk.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(t)
        ) if _decoder_uses(decoder, "ByteFallback") else frozenset()
        self._token_bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_json(cls, tokenizer_json: str, tokenizer_config: Mapping[str, Any] | None = None,
                  chat_template: str | None = None) -> "Tokenizer":
        """Build from the text of ``tokenizer.json`` and a parsed ``tokenizer_config.json``.

        ``chat_template`` (the text of a ``chat_template.jinja`` file) wins over the config's.
        """
        settings = TokenizerSettings.from_config_dict(tokenizer_config or {})
        if chat_template is not None:
            settings = dataclasses.replace(settings, chat_template=chat_template)
        return cls(tokenizer_json, settings)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """Build from a checkpoint folder's ``tokenizer.json``, ``tokenizer_config.json`` and
        ``chat_template.jinja`` (the last two optional). For untrusted folders prefer
        ``load_checkpoint``, which turns every problem into a :class:`CheckpointError`."""
        folder = Path(folder)
        config_file, template_file = folder / "tokenizer_config.json", folder / "chat_template.jinja"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls.from_json((folder / "tokenizer.json").read_text(encoding="utf-8"), config, template)

    # -- special tokens -------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tk.token_to_id(token)

    def _apply_bos_eos_settings(self) -> None:
        # The post-processor in tokenizer.json decides which special tokens encode() adds (Llama 3
        # puts <|begin_of_text|> there); transformers 5 ignores tokenizer_config's add_bos_token /
        # add_eos_token whenever tokenizer.json exists, and transformers 4 wrote them into the
        # post-processor on save, so the two agree in files transformers saved. Only a tokenizer.json
        # without a post-processor takes them from tokenizer_config.json (default: add nothing).
        if self._tk.post_processor is not None:
            return
        s = self.settings
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        # (token, id) of each special token to add, None for one not added.
        first = (bos, self.bos_token_id) if s.add_bos_token and bos is not None and self.bos_token_id is not None \
            else None
        last = (eos, self.eos_token_id) if s.add_eos_token and eos is not None and self.eos_token_id is not None \
            else None
        if first is None and last is None:
            return
        single = f"{first[0] + ':0 ' if first else ''}$A:0{' ' + last[0] + ':0' if last else ''}"
        pair = f"{single}{' ' + first[0] + ':1' if first else ''} $B:1{' ' + last[0] + ':1' if last else ''}"
        special = [token for token in (first, last) if token is not None]
        self._tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    # -- encode / decode ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS/EOS the checkpoint wants.

        Special-token strings inside ``text`` (``<|im_start|>``) become their single ids, as in
        transformers. Encode a rendered chat template with ``add_special_tokens=False``: the
        template already wrote the BOS it wants.
        """
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ints or numpy integers). ``clean_up_tokenization_spaces`` is not
        applied: transformers ignores it for BPE tokenizers too, and every Llama-family
        tokenizer is BPE."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A fresh streaming detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- per-token views (logprobs) -------------------------------------------------------

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (``"Ġthe"``, ``"▁the"``, ``"<0x0A>"``), or None."""
        return self._tk.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self._tk.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes ``token_id`` contributes to the text (OpenAI logprobs ``bytes``).

        A token can hold part of a multi-byte character, so this is bytes, not str.
        """
        cached = self._token_bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_token_bytes(token_id)
            self._token_bytes_cache[token_id] = cached
        return cached

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_token_text:
            return self._added_token_text[token_id].encode("utf-8")
        token = self._tk.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level:
            table = _byte_level_decode_table()
            if all(ch in table for ch in token):
                return bytes(table[ch] for ch in token)
        # SentencePiece-style vocabularies: "▁" is a space and "<0xNN>" a byte-fallback byte.
        if _BYTE_TOKEN.fullmatch(token):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    # -- chat -----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` into a prompt string, as transformers' ``apply_chat_template``.

        Uses ``chat_template`` if given, else the checkpoint's, else ChatML. The template sees
        ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special tokens
        (``bos_token``, ``eos_token``, ...) and ``kwargs``. Raises :class:`ChatTemplateError`.
        """
        source = chat_template or self.chat_template or DEFAULT_CHAT_TEMPLATE
        try:
            template = _compile_chat_template(source)
            return template.render(
                messages=[_template_message(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except Exception as exc:  # noqa: BLE001 - why, below
            # Templates are code from the checkpoint: besides Jinja errors and raise_exception(),
            # a message they don't expect (content None, a list of parts) surfaces as a TypeError
            # or KeyError. All of these are a bad request, never a server crash.
            kind = "" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: "
            raise ChatTemplateError(f"chat template failed: {kind}{exc}") from None


# Names a message's reasoning goes by; templates (Qwen3, gpt-oss) read different ones, so
# transformers fills them all from whichever the caller set.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: Any) -> dict[str, Any]:
    """A plain-dict copy of one chat message, reasoning aliased as transformers does."""
    if callable(getattr(message, "model_dump", None)):  # a pydantic message from the API layer
        message = message.model_dump(exclude_none=True)
    plain = dict(message)
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _decoder_uses(decoder: Any, kind: str) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence) contains a ``kind`` step."""
    if not isinstance(decoder, Mapping):
        return False
    if decoder.get("type") == kind:
        return True
    return any(_decoder_uses(d, kind) for d in decoder.get("decoders") or ())


@lru_cache(maxsize=1)
def _byte_level_decode_table() -> dict[str, int]:
    """GPT-2's printable-character alias of every byte, inverted (char -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_chat_template(source: str) -> jinja2.Template:
    # Same environment as transformers: chat templates are untrusted code from the Hub, hence
    # the immutable sandbox; trim/lstrip_blocks change whitespace, so they must match exactly.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


#: Tokens a decode window holds past its start before it restarts (see ``IncrementalDetokenizer._step``).
_WINDOW_RESTART = 6


class IncrementalDetokenizer:
    """Turns generated ids, a few at a time, into text deltas for streaming.

    The concatenation of every delta (including the one from ``finish()``) equals
    ``tokenizer.decode(all_ids)``, and a delta never ends inside a UTF-8 character:

    * byte-level BPE: while the decoded tail is U+FFFD (the first bytes of an unfinished
      character, or bytes that are never valid and stay U+FFFD whatever follows), it is held
      back until a later token settles it or ``finish()`` flushes it;
    * SentencePiece byte fallback: a run of ``<0xNN>`` tokens decodes all at once or all as
      U+FFFD, so text is held while the run may still grow (one token of delay, for
      characters the vocabulary spells in bytes).

    Decoding re-runs the tokenizer's decoder on a short window of recent ids rather than on
    each token alone, because decoders are not per-token: ``▁`` decoders drop the leading space
    of the first token they see. The window starts at a token already emitted, so that effect
    lands on text we have already sent, and never inside a byte-fallback run.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._window_start = 0   # index into _ids where the decode window begins
        self._emitted = 0        # characters of decode(_ids[_window_start:]) already emitted

    @property
    def token_ids(self) -> list[int]:
        """Every id seen so far."""
        return list(self._ids)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Take the next generated id(s); return the text they complete (maybe "")."""
        # int() also takes numpy integers, which samplers hand out and tokenizers rejects. A plain
        # int first: the engine's case, and isinstance against the Iterable ABC is slow cold.
        if type(token_ids) is int:
            self._ids.append(token_ids)
        elif isinstance(token_ids, Iterable):
            self._ids.extend(int(t) for t in token_ids)
        else:
            self._ids.append(int(token_ids))
        return self._step(final=False)

    def finish(self) -> str:
        """Flush whatever is held back (an unfinished character decodes as U+FFFD, as in decode())."""
        return self._step(final=True)

    def _decoder_sees(self, token_id: int) -> bool:
        return not (self._skip_special and token_id in self._tokenizer.special_token_ids)

    def _last_visible(self) -> int:
        """Index of the last id the decoder sees (skipped specials are invisible), or -1."""
        i = len(self._ids) - 1
        while i >= self._window_start and not self._decoder_sees(self._ids[i]):
            i -= 1
        return i if i >= self._window_start else -1

    def _decode_window(self, start: int) -> str:
        return self._tokenizer.decode(self._ids[start:], skip_special_tokens=self._skip_special)

    def _step(self, final: bool) -> str:
        byte_ids = self._tokenizer.byte_fallback_ids
        last = self._last_visible()
        if not final and last >= 0 and self._ids[last] in byte_ids:
            return ""  # a byte-fallback run may still grow: its text is not known yet
        text = self._decode_window(self._window_start)
        end = len(text)
        if not final:
            while end > self._emitted and text[end - 1] == _REPLACEMENT_CHAR:
                end -= 1
        delta = text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if (end == len(text) and last >= self._window_start + _WINDOW_RESTART
                and self._ids[last] not in byte_ids):
            # Everything so far is emitted: restart the window at the last visible token,
            # keeping each decode O(1) instead of O(length of the output). Only every few tokens:
            # a restart costs a decode of its own, which every token used to pay (two calls into
            # the tokenizer a token, where one does).
            self._window_start = last
            self._emitted = len(self._decode_window(last))
        return delta

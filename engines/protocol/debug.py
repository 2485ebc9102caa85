"""``debug_config``: MLC LLM's per-request debug options (an extension of the OpenAI protocol).

Fields, types and defaults are MLC's (``mlc_llm.protocol.debug_protocol``), so a body
written for ``mlc_llm serve --enable-debug`` works here unchanged. Where MLC checks a
value only in C++ when the request reaches the engine (unknown kinds, undecodable
``kv_append_metadata``, impossible KV windows), we check it here, with MLC's messages
where it has them, so the client gets a 4xx before anything is queued.

Both models are closed: an unknown key is an error naming it, because a misspelt debug
option (``ignore_eso``) silently ignored is exactly the bug a debug surface must not
hide. Values are parsed strictly (``"true"`` is not a boolean), as MLC's C++ JSON parser does.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer, model_validator

from .errors import field_error

__all__ = ["DebugConfig", "DisaggConfig", "DisaggKind"]

DisaggKind = Literal["prepare_receive", "remote_send", "start_generation"]


class _ClosedModel(BaseModel):
    """Base of the debug models: unknown keys are refused with the list of accepted ones."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        # extra="forbid" alone reports "Extra inputs are not permitted"; naming the fields
        # that do exist turns a typo into a one-glance fix.
        if isinstance(data, dict):
            unknown = [str(key) for key in data if key not in cls.model_fields]
            if unknown:
                named = ", ".join(repr(key) for key in unknown)
                accepted = ", ".join(cls.model_fields)
                raise field_error(
                    f"unknown field{'s' if len(unknown) > 1 else ''} {named}; {cls.__name__} accepts: {accepted}",
                    param=unknown[0],
                )
        return data


class DisaggConfig(_ClosedModel):
    """Disaggregated (prefill/decode split) serving: which MicroServing step a request is.

    * ``prepare_receive``: the decode instance reserves KV pages for ``[0:kv_window_end]``
      and answers with their layout (``kv_append_metadata``).
    * ``remote_send``: the prefill instance computes ``[kv_window_begin:kv_window_end]``
      and sends the KV to the pages named by ``kv_append_metadata`` on group
      ``dst_group_offset``.
    * ``start_generation``: the decode instance prefills ``[kv_window_begin:]`` locally and
      generates.

    Window ends accept Python-style negative indices (counted from the prompt's end); the
    checks that need the prompt length are the engine's, everything else is checked here.
    """

    kind: DisaggKind | None = None
    #: Base64 of a JSON array of integers: per model ``[num_segments, pos, len, ...]``.
    kv_append_metadata: str | None = None
    kv_window_begin: int | None = None
    kv_window_end: int | None = None
    #: KV data destination group offset (the receiving rank).
    dst_group_offset: int | None = None

    @model_validator(mode="after")
    def _check_consistency(self) -> "DisaggConfig":
        if self.kv_append_metadata is not None:
            self.kv_append_metadata_segments()  # raises with MLC's message when malformed
        if self.dst_group_offset is not None and self.dst_group_offset < 0:
            raise field_error(
                f"dst_group_offset must be >= 0 (got {self.dst_group_offset})", param="dst_group_offset"
            )
        if self.kind is None:
            given = [name for name in type(self).model_fields if name != "kind" and getattr(self, name) is not None]
            if given:
                raise field_error(
                    f"{given[0]} has no meaning without kind; set kind to "
                    '"prepare_receive", "remote_send" or "start_generation"',
                    param="kind",
                )
        elif self.kind == "prepare_receive":
            self._check_prepare_receive()
        elif self.kind == "remote_send":
            self._check_remote_send()
        else:
            self._check_start_generation()
        return self

    def _check_prepare_receive(self) -> None:
        # The decode side always receives a prefix of the prompt, so the window starts at 0.
        if self.kv_window_begin not in (None, 0):
            raise field_error(
                f'kind "prepare_receive" requires kv_window_begin to be 0 or null '
                f"(got {self.kv_window_begin}): the received KV is always a prefix [0:kv_window_end]",
                param="kv_window_begin",
            )
        # No end means the whole prompt, which MLC refuses: the decode side must prefill
        # at least the last token itself to sample the first output token.
        if self.kv_window_end is None:
            raise field_error(
                'kind "prepare_receive" requires kv_window_end: '
                "Prefill the full input on the remote machine is not supported.",
                param="kv_window_end",
            )

    def _check_remote_send(self) -> None:
        begin = 0 if self.kv_window_begin is None else self.kv_window_begin
        if begin < 0:
            raise field_error(
                f'kind "remote_send" requires kv_window_begin >= 0 (got {begin})', param="kv_window_begin"
            )
        if self.kv_window_end is None:
            raise field_error(
                'kind "remote_send" requires kv_window_end: '
                "Prefill the full input on the remote machine is not supported.",
                param="kv_window_end",
            )
        # A negative end is resolved against the prompt length by the engine; only two
        # non-negative bounds can be compared here.
        if self.kv_window_end >= 0 and begin >= self.kv_window_end:
            raise field_error(
                f'"begin >= end" is not supported by remote prefill '
                f"(kv_window_begin={begin}, kv_window_end={self.kv_window_end})",
                param="kv_window_end",
            )
        if self.kv_append_metadata is None:
            raise field_error(
                'kind "remote_send" requires kv_append_metadata: the receiver\'s page layout '
                "returned by the prepare_receive step",
                param="kv_append_metadata",
            )
        if self.kv_window_end >= 0:
            expected = self.kv_window_end - begin
            for model_index, segments in enumerate(self.kv_append_metadata_segments()):
                sent = sum(length for _, length in segments)
                if sent != expected:
                    raise field_error(
                        f"kv_append_metadata of model {model_index} covers {sent} tokens but the window "
                        f"[{begin}:{self.kv_window_end}] holds {expected}",
                        param="kv_append_metadata",
                    )

    def _check_start_generation(self) -> None:
        if self.kv_window_begin is None:
            raise field_error(
                'kind "start_generation" requires kv_window_begin: where the local prefill starts '
                "(the kv_window_end of the prepare_receive step)",
                param="kv_window_begin",
            )
        if self.kv_window_end is not None:
            raise field_error(
                f'kind "start_generation" requires kv_window_end to be null (got {self.kv_window_end}): '
                "the decode side always prefills up to the end of the prompt",
                param="kv_window_end",
            )

    def kv_append_metadata_segments(self) -> list[list[tuple[int, int]]]:
        """Decode ``kv_append_metadata``: per model, its ``(position, length)`` segments.

        ``[]`` when there is no metadata. Validation runs this at construction, where a
        malformed value becomes a validation error with MLC's messages
        (``kv_append_metadata parse error: ...``, ``kv_append_metadata is not array of
        integer.``, ...); on a validated model it cannot fail.
        """
        if self.kv_append_metadata is None:
            return []
        try:
            raw = base64.b64decode(self.kv_append_metadata, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise field_error(
                f"kv_append_metadata parse error: not valid base64 ({exc})", param="kv_append_metadata"
            ) from None
        try:
            values = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            # RecursionError: arrays nested past the parser's depth limit (any client can send them).
            raise field_error(f"kv_append_metadata parse error: {exc}", param="kv_append_metadata") from None
        if isinstance(values, dict) and "receiver" in values:
            # Ours (``engines.protocol.microserving.KVAppendMetadata``): MLC's array plus the receiver's address.
            values = values.get("segments")
        if not isinstance(values, list):
            raise field_error("kv_append_metadata is not array of integer.", param="kv_append_metadata")
        # JSON true/false are ints to Python but not to MLC's parser.
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise field_error(
                "Invalid kv append metadata value in kv_append_metadata array", param="kv_append_metadata"
            )
        models: list[list[tuple[int, int]]] = []
        ptr = 0
        while ptr < len(values):
            num_segments = values[ptr]
            if num_segments < 0 or ptr + 2 * num_segments + 1 > len(values):
                raise field_error(
                    "Invalid kv append metadata compression in kv_append_metadata", param="kv_append_metadata"
                )
            flat = values[ptr + 1 : ptr + 1 + 2 * num_segments]
            models.append(list(zip(flat[0::2], flat[1::2], strict=True)))
            ptr += 2 * num_segments + 1
        return models

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Unset fields are left out, as MLC's C++ writer and reader treat absence and null alike.
        return {key: value for key, value in handler(self).items() if value is not None}


class DebugConfig(_ClosedModel):
    """Per-request debug options; honoured by the server only with ``--enable-debug``.

    * ``ignore_eos``: generate until ``max_tokens`` (or grammar end / context limit),
      ignoring EOS, stop tokens and stop strings. For benchmarks.
    * ``pinned_system_prompt``: keep this request's system prompt in the prefix cache,
      never evicted, until the engine is reset.
    * ``special_request``: ``"query_engine_metrics"`` answers at once, without a model
      step, with the engine metrics in ``usage.extra``. Needs ``stream=true`` and
      ``stream_options.include_usage`` (checked by the request models).
    * ``grammar_execution_mode``: with a ``response_format`` grammar, ``"constraint"``
      only masks logits; ``"jump_forward"`` also appends the tokens the grammar forces
      without running the model for them.
    * ``disagg_config``: the MicroServing step (see :class:`DisaggConfig`).
    """

    ignore_eos: bool = False
    pinned_system_prompt: bool = False
    special_request: Literal["query_engine_metrics"] | None = None
    grammar_execution_mode: Literal["constraint", "jump_forward"] = "jump_forward"
    disagg_config: DisaggConfig | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # MLC's serialised form leaves out an unset special request and a disagg config
        # without a kind (which carries nothing: see DisaggConfig's validation).
        data = handler(self)
        if self.special_request is None:
            data.pop("special_request", None)
        if self.disagg_config is None or self.disagg_config.kind is None:
            data.pop("disagg_config", None)
        return data

"""MLC's MicroServing calls (``/microserving/*``): their bodies, and our ``kv_append_metadata``.

Each body is a completion request (or, ours, a chat completion request) plus the window fields
MLC adds. The three calls of one request are tied by its ``user`` (the request id on both
engines), so ``user`` is required.

``kv_append_metadata`` is, in MLC, base64 of a flat int array ``[num_segments, pos, len, ...]``
naming the receiver's KV slots; MLC's transport is GPU to GPU inside one cluster and needs no
address. Ours crosses processes and machines, so it is base64 of a JSON *object*
(:class:`KVAppendMetadata`) that keeps MLC's array under ``segments`` and adds the receiver:
its URL, its server process, its engine, the request id and the reservation's ticket, and the
model identity the K/V must match. ``DisaggConfig`` reads the segments of either form.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ProtocolError
from .openai import ChatCompletionRequest, CompletionRequest, _GenerationRequest

__all__ = ["ChatPrepRecvRequest", "ChatRemoteSendRequest", "ChatStartGenerateRequest", "KVAppendMetadata",
           "KVReceiverAddress", "PrepRecvRequest", "RemoteSendRequest", "StartGenerateRequest"]


class _Tied(_GenerationRequest):
    """The field every MicroServing call shares: ``user`` names the request on both engines, so
    the generation request's optional ``user`` is required here. (Deriving from it tells a type
    checker that the calls' classes below, whose first base this is, narrow that field.) One
    prompt and no echo: a completion body's list of prompts or ``echo`` is refused."""

    takes_prompt_lists_and_echo: ClassVar[bool] = False

    user: str = Field(min_length=1)


class _PrepRecv(_Tied):
    #: Reserve the decode side's pages for ``prompt[0:end]`` (negative: from the prompt's end).
    end: int = Field(strict=True)


class _RemoteSend(_Tied):
    #: Prefill ``prompt[:end]`` here and send the K/V of ``[begin:end]`` to the receiver
    #: ``kv_addr_info`` (prep_recv's metadata) names.
    begin: int = Field(default=0, ge=0, strict=True)
    end: int = Field(strict=True)
    kv_addr_info: str
    #: MLC's destination group; one group here, so only 0 is meaningful (kept for compatibility).
    recv_rank: int = Field(default=0, ge=0, strict=True)


class _StartGenerate(_Tied):
    #: Prefill ``[begin:]`` on the received K/V (``begin`` = prep_recv's resolved end) and generate.
    begin: int = Field(ge=0, strict=True)


# Each call takes a completion body (``prompt``) as MLC's does, or a chat body (``messages``,
# rendered with the chat template on each server), so a router can serve both OpenAI routes.
class PrepRecvRequest(_PrepRecv, CompletionRequest):
    """``/microserving/prep_recv`` with a completion body."""


class ChatPrepRecvRequest(_PrepRecv, ChatCompletionRequest):
    """``/microserving/prep_recv`` with a chat body."""


class RemoteSendRequest(_RemoteSend, CompletionRequest):
    """``/microserving/remote_send`` with a completion body."""


class ChatRemoteSendRequest(_RemoteSend, ChatCompletionRequest):
    """``/microserving/remote_send`` with a chat body."""


class StartGenerateRequest(_StartGenerate, CompletionRequest):
    """``/microserving/start_generate`` with a completion body: a completion reply."""


class ChatStartGenerateRequest(_StartGenerate, ChatCompletionRequest):
    """``/microserving/start_generate`` with a chat body: a chat completion reply."""


class KVReceiverAddress(BaseModel):
    """Where a window's K/V goes: the decode server, its process, engine and reservation."""

    model_config = ConfigDict(extra="forbid")

    url: str
    server: str
    engine: str
    request_id: str
    ticket: str
    #: The receiving engine's K/V listener (``http://host:port``), where another server sends.
    kv_url: str | None = None


class KVAppendMetadata(BaseModel):
    """Our ``kv_append_metadata`` (version 1), carried as base64 of its JSON."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    segments: list[int]
    receiver: KVReceiverAddress
    identity: dict[str, Any]

    @classmethod
    def for_window(cls, segments: list[tuple[int, int]] | tuple[tuple[int, int], ...], receiver: KVReceiverAddress,
                   identity: dict[str, Any]) -> "KVAppendMetadata":
        """Metadata of one model's window: MLC's flat array of its slot runs, and where to send."""
        flat = [len(segments)] + [x for run in segments for x in run]
        return cls(segments=flat, receiver=receiver, identity=identity)

    def encode(self) -> str:
        """The base64 text clients pass from prep_recv to remote_send."""
        return base64.b64encode(orjson.dumps(self.model_dump())).decode("ascii")

    @classmethod
    def decode(cls, text: str, param: str = "kv_addr_info") -> "KVAppendMetadata":
        """Parse metadata from a client; a :class:`ProtocolError` (400) says what is wrong."""
        try:
            data = orjson.loads(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ProtocolError(400, f"{param} is not the kv_append_metadata prep_recv returned: {exc}",
                                param=param) from None
        if isinstance(data, list):
            raise ProtocolError(400, f"{param} is MLC's bare segment array, which names no receiver: pass the "
                                     "kv_append_metadata this server's prep_recv returned", param=param)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ProtocolError(400, f"{param} is not the kv_append_metadata prep_recv returned: "
                                     f"{exc.errors(include_url=False)[0]['msg']}", param=param) from None

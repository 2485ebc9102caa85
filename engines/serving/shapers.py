"""From the engine's outputs to OpenAI's objects: one shaper per request, for its stream chunks
or its one whole reply (``chat.completion`` / ``text_completion`` and their chunks)."""
from __future__ import annotations

import codecs
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from engines.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engines.registry import registry
from engines.runtime import AsyncEngine, ChoiceDelta, FinishReason, RequestOutput, TokenLogprob as EngineTokenLogprob

__all__ = ["ChatShaper", "CompletionPrompt", "CompletionShaper", "ResponseShaper"]


class ResponseShaper(ABC):
    """Turns one request's engine outputs into OpenAI objects (chunks, or one final response).

    Keeps what a reply needs across outputs: per-choice text and logprobs for the
    non-streaming reply, which choices already sent their role, the final usage, and for
    ``continuous_usage_stats`` the tokens so far (``prompt_tokens`` is set once the prompt is
    tokenized: ``engines.serving.generation.generate``).
    """

    def __init__(self, request_id: str, engine: AsyncEngine, body: ChatCompletionRequest | CompletionRequest) -> None:
        self.request_id = request_id
        self.model = engine.name
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        # Chat asks with logprobs=true; completions with logprobs=0..5 (0: the chosen token only).
        self.want_logprobs = body.logprobs is not None and body.logprobs is not False
        self.usage: Usage | None = None
        self.continuous_usage = body.continuous_usage
        self.prompt_tokens = 0
        self._completion_tokens = 0  # every choice's, so far
        self._cached_tokens: dict[str, int] = {}  # per engine request (a completion's prompts: several)
        self._texts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[EngineTokenLogprob]] = {}
        self._finish: dict[int, FinishReason | None] = {}

    # -- shared

    def _record_usage(self, output: RequestOutput) -> None:
        if output.usage is not None:
            usage = dict(output.usage)
            if not registry.options.enable_debug:
                usage.pop("extra", None)  # request metrics are a debug feature, as in MLC
            self.usage = Usage(**usage)

    def _usage_so_far(self, output: RequestOutput) -> Usage | None:
        """For ``continuous_usage_stats``: the tokens so far (every choice's, as the final usage
        counts them) after ``output``; None when not asked. The metrics (``extra``) stay on the
        final usage chunk."""
        self._completion_tokens += sum(len(delta.token_ids) for delta in output.choices)
        if not self.continuous_usage:
            return None
        if output.finished and self.usage is not None:
            return self.usage.model_copy(update={"extra": None})
        self._cached_tokens[output.request_id] = output.cached_prompt_tokens
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self._completion_tokens,
                     total_tokens=self.prompt_tokens + self._completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached_tokens.values())))

    def absorb(self, output: RequestOutput) -> None:
        """Accumulate an output for the non-streaming reply."""
        for delta in output.choices:
            index = self._index(output, delta)
            self._texts.setdefault(index, []).append(delta.text)
            if delta.logprobs:
                self._logprobs.setdefault(index, []).extend(delta.logprobs)
            if delta.finish_reason is not None or index not in self._finish:
                self._finish[index] = delta.finish_reason
        self._record_usage(output)

    def _index(self, output: RequestOutput, delta: ChoiceDelta) -> int:
        """The reply's index of ``delta``'s choice (the engine's, for a reply of one request)."""
        return delta.index

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs; OpenAI's ``bytes:\\xNN`` form for a partial UTF-8 character."""
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _skip(self, delta: ChoiceDelta) -> bool:
        # Text held back (a possible stop string, half a UTF-8 character) leaves an empty delta;
        # sending it would only cost the client a parse (MLC: "skip empty delta text").
        return not delta.text and delta.finish_reason is None and not delta.logprobs

    @abstractmethod
    def chunk(self, output: RequestOutput) -> BaseModel | None:
        """The stream chunk for one output, or None when it carries nothing to send."""

    @abstractmethod
    def usage_chunk(self, usage: Usage | None = None) -> BaseModel:
        """The closing chunk with ``choices: []`` and the usage (the request's, unless given)."""

    @abstractmethod
    def response(self) -> BaseModel:
        """The whole non-streaming reply, from everything :meth:`absorb` saw."""


class ChatShaper(ResponseShaper):
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, request_id: str, engine: AsyncEngine, body: ChatCompletionRequest) -> None:
        super().__init__(request_id, engine, body)
        self._role_sent: set[int] = set()

    def _logprobs_of(self, items: list[EngineTokenLogprob] | None) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        content = []
        for item in items or ():
            top = [
                TopLogprob(token=self.token_text(tid), logprob=lp, bytes=list(self.tokenizer.token_bytes(tid)))
                for tid, lp in item.top_logprobs
            ]
            content.append(
                TokenLogprob(
                    token=self.token_text(item.token_id),
                    logprob=item.logprob,
                    bytes=list(self.tokenizer.token_bytes(item.token_id)),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    def chunk(self, output: RequestOutput) -> ChatCompletionChunk | None:
        self._record_usage(output)
        usage = self._usage_so_far(output)
        choices = []
        for delta in output.choices:
            if self._skip(delta):
                continue
            role: Literal["assistant"] | None = None
            if delta.index not in self._role_sent:
                self._role_sent.add(delta.index)
                role = "assistant"
            choices.append(
                ChatStreamChoice(
                    index=delta.index,
                    delta=ChatDelta(role=role, content=delta.text or ("" if role else None)),
                    logprobs=self._logprobs_of(delta.logprobs),
                    finish_reason=delta.finish_reason,
                )
            )
        if not choices:
            return None
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def usage_chunk(self, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage or self.usage or Usage()
        )

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content="".join(self._texts[index])),
                logprobs=self._logprobs_of(self._logprobs.get(index)),
                finish_reason=self._finish.get(index),
            )
            for index in sorted(self._texts)
        ]
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage
        )


class TextOffsets:
    """Each token's ``text_offset`` in one choice's text: the characters its predecessors' bytes
    decode to. A token's own text in the logprobs (``token_text``) is no measure: a partial UTF-8
    character shows as ``bytes:\\xNN``. An offset never passes the text sent so far (a stop string
    or held-back text leaves it shorter than the tokens' bytes), so offsets only grow. ``start``:
    where the tokens' text begins (after an echoed prompt)."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = start  # characters the tokens' bytes so far decode to (an unfinished one not yet)

    def next(self, token_bytes: bytes, text_end: int) -> int:
        """The offset of the token whose bytes are ``token_bytes``, when the choice's text sent so
        far, this token's chunk included, is ``text_end`` characters long."""
        offset = min(self._chars, text_end)
        self._chars += len(self._decoder.decode(token_bytes))
        return offset


@dataclass
class CompletionPrompt:
    """One prompt of a completion request, as ``echo`` returns it: its text (as sent, or its
    token ids decoded, special tokens included) and its token ids. ``bos_added``: the tokenizer
    put a BOS before the text, which the text does not hold (it takes no characters)."""

    text: str
    token_ids: list[int]
    bos_added: bool = False


class CompletionShaper(ResponseShaper):
    """``text_completion`` objects, streamed or whole, for one prompt or several (each an engine
    request, :meth:`add_prompt`: prompt ``i``'s choice ``c`` is the reply's ``i * n + c``), with
    each prompt echoed before its choices' text when ``echo`` asks."""

    def __init__(self, request_id: str, engine: AsyncEngine, body: CompletionRequest) -> None:
        super().__init__(request_id, engine, body)
        self.echo = body.echo
        self.n = body.n
        # Per choice: the length of its text sent so far, and its tokens' offsets in it.
        self._sent: dict[int, int] = {}
        self._offsets: dict[int, TextOffsets] = {}
        # Per engine request: its prompt's place in the list; per prompt, what echo returns.
        self._prompt_index: dict[str, int] = {}
        self._prompts: list[CompletionPrompt] = []
        self._prompt_logprobs: dict[int, list[EngineTokenLogprob | None]] = {}
        self._echoed: set[int] = set()  # choices whose stream has sent their prompt

    def add_prompt(self, engine_request_id: str, prompt: str | list[int], token_ids: list[int]) -> None:
        """The next prompt of the request, served by the engine request ``engine_request_id``."""
        self._prompt_index[engine_request_id] = len(self._prompts)
        if not self.echo:
            self._prompts.append(CompletionPrompt("", token_ids))
            return
        if isinstance(prompt, str):
            bos = self.tokenizer.bos_token_id
            added = bool(token_ids) and token_ids[0] == bos and not prompt.startswith(self.token_text(token_ids[0]))
            self._prompts.append(CompletionPrompt(prompt, token_ids, added))
        else:
            self._prompts.append(CompletionPrompt(self.tokenizer.decode(token_ids, skip_special_tokens=False),
                                                  token_ids))

    def _index(self, output: RequestOutput, delta: ChoiceDelta) -> int:
        return self._prompt_index.get(output.request_id, 0) * self.n + delta.index

    def _take_prompt_logprobs(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[self._prompt_index.get(output.request_id, 0)] = output.prompt_logprobs

    def absorb(self, output: RequestOutput) -> None:
        self._take_prompt_logprobs(output)
        super().absorb(output)

    def _append(self, out: CompletionLogprobs, token_id: int, item: EngineTokenLogprob | None, offset: int) -> None:
        """One token's entry in each list; ``item`` None: a token nothing scores (the prompt's first)."""
        out.tokens.append(self.token_text(token_id))
        out.token_logprobs.append(None if item is None else item.logprob)
        out.top_logprobs.append(None if item is None else {self.token_text(tid): lp for tid, lp in item.top_logprobs})
        out.text_offset.append(offset)

    def _append_logprobs(self, out: CompletionLogprobs, items: list[EngineTokenLogprob] | None, offsets: TextOffsets,
                         text_end: int) -> None:
        for item in items or ():
            self._append(out, item.token_id, item, offsets.next(self.tokenizer.token_bytes(item.token_id), text_end))

    def _logprobs_of(self, items: list[EngineTokenLogprob] | None, offsets: TextOffsets,
                     text_end: int, prompt: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        out = prompt or CompletionLogprobs()
        self._append_logprobs(out, items, offsets, text_end)
        return out

    def _echo(self, choice: int) -> tuple[str, CompletionLogprobs | None]:
        """Choice ``choice``'s prompt as echo returns it: its text, and (with logprobs) its tokens'
        entries, the first's null; a prompt whose logprobs never came (its request was aborted
        before its prefill ended) has null for those it lacks."""
        prompt_index = choice // self.n
        prompt = self._prompts[prompt_index]
        if not self.want_logprobs:
            return prompt.text, None
        scores = self._prompt_logprobs.get(prompt_index, [])
        out = CompletionLogprobs()
        offsets = TextOffsets()
        for position, token in enumerate(prompt.token_ids):
            added = position == 0 and prompt.bos_added
            offset = 0 if added else offsets.next(self.tokenizer.token_bytes(token), len(prompt.text))
            self._append(out, token, scores[position] if position < len(scores) else None, offset)
        return prompt.text, out

    def chunk(self, output: RequestOutput) -> CompletionResponse | None:
        self._record_usage(output)
        usage = self._usage_so_far(output)
        self._take_prompt_logprobs(output)
        choices = []
        for delta in output.choices:
            index = self._index(output, delta)
            echo = self.echo and index not in self._echoed
            if self._skip(delta) and not echo:
                continue
            head, head_logprobs = "", None
            if echo:
                self._echoed.add(index)
                head, head_logprobs = self._echo(index)
                self._sent[index] = len(head)
                self._offsets[index] = TextOffsets(len(head))
            sent = self._sent.get(index, 0) + len(delta.text)
            self._sent[index] = sent
            choices.append(
                CompletionChoice(
                    index=index,
                    text=head + delta.text,
                    logprobs=self._logprobs_of(delta.logprobs, self._offsets.setdefault(index, TextOffsets()),
                                               sent, head_logprobs),
                    finish_reason=delta.finish_reason,
                )
            )
        if not choices:
            return None
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    def usage_chunk(self, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage or self.usage or Usage()
        )

    def response(self) -> CompletionResponse:
        choices = []
        for index in sorted(self._texts):
            head, head_logprobs = self._echo(index) if self.echo else ("", None)
            text = head + "".join(self._texts[index])
            choices.append(CompletionChoice(
                index=index,
                text=text,
                logprobs=self._logprobs_of(self._logprobs.get(index), TextOffsets(len(head)), len(text), head_logprobs),
                finish_reason=self._finish.get(index),
            ))
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage
        )

"""``text_offset`` in a completion's logprobs: each token's character offset in the text returned,
streamed or whole, when a token's bytes are half a UTF-8 character (its logprob text then reads
``bytes:\\xNN``, longer than what it adds to the text) and when the text is cut short of its tokens."""
from __future__ import annotations

from types import SimpleNamespace

from engines.protocol import CompletionRequest
from engines.runtime import ChoiceDelta, RequestOutput, TokenLogprob
from engines.serving.shapers import CompletionShaper, TextOffsets

# Token id -> bytes: "é" is two bytes, split over tokens 2 and 3.
TOKENS = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" au", 5: b" lait"}


class ByteTokenizer:
    def token_bytes(self, token_id: int) -> bytes:
        return TOKENS[token_id]


def shaper() -> CompletionShaper:
    engine = SimpleNamespace(name="m", tokenizer=ByteTokenizer())
    body = CompletionRequest(model="m", prompt="x", logprobs=0)
    return CompletionShaper("cmpl-1", engine, body)  # type: ignore[arg-type]


def output(text: str, token_ids: list[int], finish: str | None = None) -> RequestOutput:
    logprobs = [TokenLogprob(token_id=t, logprob=-1.0) for t in token_ids]
    return RequestOutput("cmpl-1", [ChoiceDelta(0, text, token_ids, logprobs, finish)])  # type: ignore[arg-type]


# The detokenizer holds "é" back until its second byte: the chunks' texts as an engine sends them.
STREAM = [("caf", [1, 2]), ("é", [3]), (" au", [4]), (" lait", [5])]


def test_streamed_offsets_count_characters_not_the_tokens_logprob_texts() -> None:
    s = shaper()
    chunks = [s.chunk(output(text, ids)) for text, ids in STREAM]
    texts = [c.choices[0].logprobs.tokens for c in chunks]  # type: ignore[union-attr]
    assert texts[0] == ["caf", "bytes:\\xc3"]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]  # type: ignore[union-attr]
    # "caf" at 0, the first byte of "é" at 3, its second at 3 too (it starts no character), " au" at 4.
    assert offsets == [0, 3, 3, 4, 7]


def test_whole_reply_offsets_match_the_streamed_ones() -> None:
    s = shaper()
    for text, ids in STREAM:
        s.absorb(output(text, ids))
    reply = s.response()
    assert reply.choices[0].text == "café au lait"
    assert reply.choices[0].logprobs.text_offset == [0, 3, 3, 4, 7]  # type: ignore[union-attr]


def test_offsets_never_pass_the_text_sent() -> None:
    # A stop string cut " lait" off: its token is still reported, at the end of the text.
    s = shaper()
    chunks = [s.chunk(output("caf", [1, 2])), s.chunk(output("é au", [3, 4])), s.chunk(output("", [5], "stop"))]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]  # type: ignore[union-attr]
    assert offsets == [0, 3, 3, 4, 7]
    held = TextOffsets()
    assert [held.next(b"abcdef", 2), held.next(b"gh", 2), held.next(b"i", 9)] == [0, 2, 8]
    assert offsets == sorted(offsets)


class EchoTokenizer(ByteTokenizer):
    bos_token_id = 9

    def token_bytes(self, token_id: int) -> bytes:
        return b"<s>" if token_id == self.bos_token_id else TOKENS[token_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode()


def echo_shaper(prompt: str | list[int], ids: list[int]) -> CompletionShaper:
    engine = SimpleNamespace(name="m", tokenizer=EchoTokenizer())
    body = CompletionRequest(model="m", prompt=prompt, logprobs=1, echo=True)
    s = CompletionShaper("cmpl-1", engine, body)  # type: ignore[arg-type]
    s.add_prompt("cmpl-1", prompt, ids)
    return s


SCORES = [None, TokenLogprob(2, -0.5, ((2, -0.5),)), TokenLogprob(3, -0.25, ((3, -0.25),))]


def test_echo_offsets_run_from_the_prompt_into_the_completion() -> None:
    """The prompt's tokens at their places in its text, the completion's after it, streamed and whole;
    the first prompt token's logprob and alternatives null."""
    streamed = echo_shaper([1, 2, 3], [1, 2, 3])
    first = output(" au", [4])
    first.prompt_logprobs = SCORES
    chunks = [streamed.chunk(first), streamed.chunk(output(" lait", [5], "length"))]
    whole = echo_shaper([1, 2, 3], [1, 2, 3])
    whole.absorb(first)
    whole.absorb(output(" lait", [5], "length"))
    reply = whole.response().choices[0]
    assert reply.text == "".join(c.choices[0].text for c in chunks) == "café au lait"  # type: ignore[union-attr]
    assert chunks[0].choices[0].text == "café au"  # type: ignore[union-attr]
    logprobs = reply.logprobs
    assert logprobs is not None
    assert logprobs.text_offset == [0, 3, 3, 4, 7]
    assert logprobs.token_logprobs == [None, -0.5, -0.25, -1.0, -1.0]
    assert logprobs.top_logprobs[:3] == [None, {"bytes:\\xc3": -0.5}, {"bytes:\\xa9": -0.25}]
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == logprobs.text_offset  # type: ignore


def test_echo_of_a_text_prompt_gives_the_added_bos_no_characters() -> None:
    s = echo_shaper("café", [9, 1, 2, 3])
    done = output("", [], "length")
    done.prompt_logprobs = [None, TokenLogprob(1, -2.0)]  # aborted mid-prefill: the rest never came
    s.absorb(done)
    reply = s.response().choices[0]
    assert reply.text == "café"
    assert reply.logprobs is not None
    assert reply.logprobs.tokens == ["<s>", "caf", "bytes:\\xc3", "bytes:\\xa9"]
    assert reply.logprobs.text_offset == [0, 0, 3, 3]
    assert reply.logprobs.token_logprobs == [None, -2.0, None, None]

"""Tokenizer against transformers on the same files: encode, decode, chat templates; and the
streaming detokenizer against a full decode, for byte-level BPE and SentencePiece-style ``▁``
tokenizers."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from engines.runtime.model.demo_model import CORPUS_FILE, DEMO_CHAT_TEMPLATE, train_demo_tokenizer
from engines.runtime.model.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world, serving 🙂 café",
    "  leading spaces and trailing ones  ",
    "line one\nline two\n\n\tindented",
    "日本語のテキストと中文，한국어",
    "Emoji sequences: 👩‍👩‍👧 🇫🇷 ✅🚀🎉 and a combining e\u0301",
    "JSON: {\"a\": [1, 2.5, null], \"b\": \"ünïcödé\"}",
    "<|im_start|>user\nhi<|im_end|> inline specials",
    "",
]

# Llama 3.1-like: system/tools handling, tojson with arguments, raise_exception, namespace,
# loop controls, and indentation that only trim_blocks/lstrip_blocks make disappear.
TOOL_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
<|system|>
{{ ns.system }}
{% if tools is not none %}
    Tools:
    {% for tool in tools %}
        {{ tool | tojson(indent=2) }}
    {% endfor %}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
<|{{ message['role'] }}|>
{{ message['content'] }}{{ eos_token if message['role'] == 'assistant' else '' }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there 🙂"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is a KV cache?"},
     {"role": "assistant", "content": "A cache of keys & values <b>."}, {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "STOP"}, {"role": "user", "content": "x"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city — « é »",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _sentencepiece_style(style: str) -> HFTokenizer:
    """A Llama 2-like tokenizer: BPE over ``▁``-joined text with byte fallback (``<0xNN>``)."""
    trainer_tok = HFTokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    # A small alphabet, so accented letters, CJK and emoji go through byte fallback.
    trainer = trainers.BpeTrainer(vocab_size=1500, limit_alphabet=80, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS_FILE.read_text(encoding="utf-8").splitlines(), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if style == "llama2":  # Llama 2's own tokenizer.json: normalizer + Strip decoder
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:  # newer conversions: Metaspace pre-tokenizer and decoder
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                         decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    return tok


KINDS = ("byte_level", "llama2", "metaspace")


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, object]:
    """Our Tokenizer and transformers' AutoTokenizer, loaded from the same saved folder."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "byte_level":
        backend, bos, eos = train_demo_tokenizer(), "<|begin_of_text|>", "<|im_end|>"
    else:
        backend, bos, eos = _sentencepiece_style(request.param), "<s>", "</s>"
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=DEMO_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)


def _ids_with_specials(ours: Tokenizer) -> list[int]:
    ids: list[int] = []
    for text in TEXTS:
        ids += ours.encode(text) + [ours.eos_token_id]
    return ids


# -- parity with transformers -------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair: tuple[Tokenizer, object], add_special_tokens: bool) -> None:
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == theirs.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair: tuple[Tokenizer, object], skip_special_tokens: bool) -> None:
    ours, theirs = pair
    ids = _ids_with_specials(ours)
    for chunk in (ids, *[ours.encode(t) for t in TEXTS]):
        assert ours.decode(chunk, skip_special_tokens) == theirs.decode(chunk, skip_special_tokens=skip_special_tokens)


def test_vocabulary_views_match_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    assert ours.vocab_size == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.add_bos
    ids = list(range(ours.vocab_size))
    assert [ours.id_to_token(i) for i in ids] == theirs.convert_ids_to_tokens(ids)
    assert ours.tokenizer_json == (Path(theirs.name_or_path) / "tokenizer.json").read_text(encoding="utf-8")


def test_token_bytes_spell_the_text(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    for text in TEXTS[:-2]:
        joined = b"".join(ours.token_bytes(i) for i in ours.encode(text, add_special_tokens=False))
        if ours.byte_fallback_ids:
            # SentencePiece-style tokenizers may encode a leading "▁" that the decoder strips again.
            assert joined in (text.encode(), b" " + text.encode()), text
        else:
            assert joined == text.encode(), text
    assert ours.token_bytes(ours.bos_token_id) == ours.special_tokens["bos_token"].encode()


@pytest.mark.parametrize("conversation", CONVERSATIONS[:2])
def test_chat_template_matches_transformers(pair: tuple[Tokenizer, object], conversation: list[dict]) -> None:
    ours, theirs = pair
    for add_generation_prompt in (True, False):
        expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rich_chat_template_matches_transformers(pair: tuple[Tokenizer, object], conversation: list[dict],
                                                 tools: list | None) -> None:
    ours, theirs = pair
    expected = theirs.apply_chat_template(conversation, chat_template=TOOL_TEMPLATE, tools=tools, tokenize=False,
                                          add_generation_prompt=True, custom_flag=True)
    got = ours.apply_chat_template(conversation, chat_template=TOOL_TEMPLATE, tools=tools, custom_flag=True)
    assert got == expected
    # Chat prompts are encoded without adding specials: the template wrote the BOS.
    assert ours.encode(got, add_special_tokens=False) == theirs.apply_chat_template(
        conversation, chat_template=TOOL_TEMPLATE, tools=tools, tokenize=True, add_generation_prompt=True,
        custom_flag=True, return_dict=False)


def test_default_chat_template_is_chatml(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    bare = Tokenizer.from_json(ours.tokenizer_json, {"bos_token": ours.special_tokens["bos_token"]})
    assert bare.chat_template is None
    rendered = bare.apply_chat_template(CONVERSATIONS[1])
    assert rendered == theirs.apply_chat_template(CONVERSATIONS[1], chat_template=DEFAULT_CHAT_TEMPLATE,
                                                  tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n  Be brief.  <|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n")


def test_raise_exception_in_template(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}], chat_template=TOOL_TEMPLATE)
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([], chat_template="{% if %}")


def test_template_sandbox_blocks_escapes(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        ours.apply_chat_template([], chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):  # the sandbox is immutable: no mutating the caller's data
        ours.apply_chat_template([{"role": "user", "content": "x"}],
                                 chat_template="{{ messages.append({'role': 'x'}) }}")


# -- add_bos / add_eos -----------------------------------------------------------------------


def test_config_add_bos_applies_without_post_processor() -> None:
    backend = train_demo_tokenizer()
    backend.post_processor = None
    text = backend.to_str()
    bos, eos = backend.token_to_id("<|begin_of_text|>"), backend.token_to_id("<|end_of_text|>")
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    body = Tokenizer.from_json(text, config).encode("hi", add_special_tokens=False)
    assert Tokenizer.from_json(text, config).encode("hi") == body
    both = Tokenizer.from_json(text, {**config, "add_bos_token": True, "add_eos_token": True})
    assert both.encode("hi") == [bos, *body, eos] and both.add_bos


def test_post_processor_wins_over_config(tmp_path: Path) -> None:
    # transformers 5 ignores add_bos_token when tokenizer.json exists: the post-processor decides.
    transformers.PreTrainedTokenizerFast(tokenizer_object=train_demo_tokenizer(), bos_token="<|begin_of_text|>",
                                         eos_token="<|im_end|>").save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "add_bos_token": False}))
    ours, theirs = Tokenizer.from_folder(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("hi") == theirs.encode("hi") and ours.encode("hi")[0] == ours.bos_token_id


def test_special_tokens_from_added_token_dicts() -> None:
    config = {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "special": True},
              "eos_token": "<|im_end|>", "chat_template": [{"name": "default", "template": "D"},
                                                           {"name": "tool_use", "template": "T"}]}
    tok = Tokenizer.from_json(train_demo_tokenizer().to_str(), config)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 3 and tok.chat_template == "D"


# -- streaming -------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip_special_tokens: bool) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[i:i + size]))
        i += size
    deltas.append(detok.finish())
    assert detok.token_ids == ids
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_one_token_at_a_time_equals_full_decode(pair: tuple[Tokenizer, object],
                                                       skip_special_tokens: bool) -> None:
    ours, _ = pair
    for text in TEXTS:
        ids = ours.encode(text)
        deltas = _stream(ours, ids, [1] * len(ids), skip_special_tokens)
        assert "".join(deltas) == ours.decode(ids, skip_special_tokens), text
        # Valid text never shows a replacement character, and nothing is left to flush
        # unless the text ends in a byte-fallback run (which a next byte could still extend).
        assert all("\ufffd" not in d for d in deltas)
        if ids and ids[-1] not in ours.byte_fallback_ids:
            assert deltas[-1] == ""
    ids = _ids_with_specials(ours)
    deltas = _stream(ours, ids, [1] * len(ids), skip_special_tokens)
    assert "".join(deltas) == ours.decode(ids, skip_special_tokens)
    assert all("\ufffd" not in d for d in deltas)


def test_stream_holds_back_partial_characters(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    ids = ours.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte tokens"
    detok = ours.detokenizer()
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    if ours.byte_fallback_ids:
        # The run of <0xNN> tokens could still grow, so the emoji waits for the next token.
        assert detok.add(ids[-1]) == ""
        follow = ours.encode(" ok", add_special_tokens=False)
        delta = detok.add(follow)
        assert delta.startswith("🙂") and delta == ours.decode(ids + follow)
    else:
        assert detok.add(ids[-1]).endswith("🙂")
    # An unfinished character at the very end is flushed by finish(), as decode() renders it.
    detok = ours.detokenizer()
    partial = "".join(detok.add(i) for i in ids[:-1]) + detok.finish()
    assert partial == ours.decode(ids[:-1]) and partial.endswith("\ufffd")


def test_stream_random_chunks_and_random_ids(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    rng = random.Random(1234)
    # Ids that make decoding hard: lone non-ASCII bytes (pieces of characters) and specials.
    hard = [i for i in range(ours.vocab_size)
            if len(ours.token_bytes(i)) == 1 and ours.token_bytes(i)[0] >= 0x80] + sorted(ours.special_token_ids)
    base = _ids_with_specials(ours)
    for _ in range(200):
        # Random ids make invalid byte sequences too; the stream must still equal decode().
        if rng.random() < 0.2:
            ids = base
        else:
            ids = [rng.choice(hard) if rng.random() < 0.6 else rng.randrange(ours.vocab_size)
                   for _ in range(rng.randrange(1, 40))]
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randrange(1, 5)))
            left -= chunks[-1]
        for skip in (True, False):
            assert "".join(_stream(ours, ids, chunks, skip)) == ours.decode(ids, skip), ids


def test_stream_decodes_a_short_window(pair: tuple[Tokenizer, object], monkeypatch: pytest.MonkeyPatch) -> None:
    # Each step must cost the same at token 10 and token 3000: the decode window stays short.
    ours, _ = pair
    ids = ours.encode(" ".join(TEXTS[:3]) * 40)
    assert len(ids) > 1000
    sizes: list[int] = []
    decode = ours.decode
    monkeypatch.setattr(ours, "decode", lambda chunk, skip_special_tokens=True: (
        sizes.append(len(chunk)), decode(chunk, skip_special_tokens))[1])
    deltas = _stream(ours, ids, [1] * len(ids), True)
    assert "".join(deltas) == decode(ids)
    assert max(sizes) <= 16  # a restart every few tokens, and a held-back character's few more
    # And it restarts every few tokens, not after each: a restart is a decode of its own, and
    # each is a call into the tokenizer (two a token before).
    assert len(sizes) < 1.3 * len(ids)


def test_numpy_ids_are_accepted(pair: tuple[Tokenizer, object]) -> None:
    np = pytest.importorskip("numpy")
    ours, _ = pair
    ids = np.array(ours.encode(TEXTS[0]), dtype=np.int32)
    detok = ours.detokenizer()
    text = "".join(detok.add(t) for t in ids[:3]) + detok.add(ids[3:]) + detok.finish()
    assert text == ours.decode(ids) == ours.decode(ids.tolist())

"""Structured output with llguidance on a tiny byte-level BPE tokenizer trained here.

The generation loop below is the engine's (mask -> sample -> consume, plus
jump-forward), driven by random logits through the real Sampler: whatever the
"model" prefers, the output must be JSON matching the schema.
"""
import json

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engines.runtime.core.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from engines.runtime.core.sampler import Sampler, SamplingParams, SamplingState

EOS = 0

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "score", "active"],
    "additionalProperties": False,
}
ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 4},
        "matrix": {"type": "array", "maxItems": 3,
                   "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    },
    "required": ["tags", "matrix"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["active", "inactive", 3, None]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}},
                        "required": ["lat"], "additionalProperties": False},
            },
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
        "note": {"type": "string", "maxLength": 8},  # optional
    },
    "required": ["id", "status", "address"],
    "additionalProperties": False,
}
FIXED_PREFIX = {
    "type": "object",
    "properties": {"color": {"type": "string", "maxLength": 6}},
    "required": ["color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf_tokenizer() -> Tokenizer:
    """A ~400-token byte-level BPE that knows JSON punctuation and our property names."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    samples = [
        json.dumps({"name": "Alice", "age": 30, "score": 1.5, "active": True}),
        json.dumps({"tags": ["red", "green", "blue"], "matrix": [[1, 2], [3]]}),
        json.dumps({"id": 7, "status": "inactive", "address": {"city": "Paris", "zip": "75001",
                                                                "geo": {"lat": -48.8}}, "note": None}),
        '{"color":"teal"} {"a":[true,false,null]} 0123456789 -1.5e+10 \\n \\" \\u00e9',
        "the quick brown fox jumps over the lazy dog",
    ]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(samples * 40, trainer)
    assert tok.token_to_id("<eos>") == EOS
    return tok


@pytest.fixture(scope="module")
def vocab_size(hf_tokenizer) -> int:
    # Padded like a model embedding: the ids past the tokenizer must never be allowed.
    return (hf_tokenizer.get_vocab_size() + 63) // 64 * 64 + 64


@pytest.fixture(scope="module")
def compiler(hf_tokenizer, vocab_size) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer.to_str(), vocab_size, eos_token_ids=[EOS])


def schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}


def generate(matcher: GrammarMatcher, vocab_size: int, seed: int, jump_forward: bool,
             closing_bias: np.ndarray | None = None, max_steps: int = 3000) -> tuple[list[int], int, int]:
    """Run the engine's constrained loop on random logits: (tokens, sampled count, forced count)."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(vocab_size)
    state = SamplingState(SamplingParams(seed=seed, temperature=1.0), vocab_size)
    mask = np.zeros(vocab_size, dtype=bool)
    out: list[int] = []
    sampled = forced = 0
    for _ in range(max_steps):
        if jump_forward:
            ff = matcher.forced_tokens()
            if ff:
                matcher.consume(ff)
                state.record_output(ff)
                out += ff
                forced += len(ff)
                if matcher.is_finished():
                    break
        logits = rng.normal(scale=2.0, size=(1, vocab_size)).astype(np.float32)
        if closing_bias is not None:
            logits[0] += closing_bias
        matcher.fill_mask(mask)
        token = int(sampler.sample(logits, [state], [mask]).token_ids[0])
        sampled += 1
        if token == EOS:
            assert matcher.is_accepting()
            break
        matcher.consume([token])
        out.append(token)
        if matcher.is_finished():
            break
    else:
        pytest.fail("generation did not finish")
    assert matcher.is_accepting()
    return out, sampled, forced


# ------------------------------------------------------------------ compile

def test_text_and_missing_formats_need_no_grammar(compiler):
    assert compiler.compile(None) is None
    assert compiler.compile({"type": "text"}) is None


def test_compiled_grammars_are_cached_by_canonical_schema(compiler):
    a = compiler.compile(schema_format(PERSON))
    reordered = json.loads(json.dumps(PERSON, sort_keys=True))
    assert list(reordered) != list(PERSON)
    b = compiler.compile({"type": "json_schema", "json_schema": {"name": "other", "schema": reordered,
                                                                  "strict": True}})
    assert a is b  # the name does not matter, key order does not matter
    assert compiler.compile(schema_format(PERSON, strict=False)) is not a
    assert compiler.compile({"type": "json_object"}) is compiler.compile({"type": "json_object"})


def test_grammar_cache_is_bounded_lru(hf_tokenizer, vocab_size):
    small = GrammarCompiler(hf_tokenizer.to_str(), vocab_size, [EOS], cache_size=2)
    first = small.compile(schema_format(PERSON))
    small.compile(schema_format(ARRAYS))
    assert small.compile(schema_format(PERSON)) is first  # refreshed
    small.compile(schema_format(NESTED))  # evicts ARRAYS, the least recently used
    assert small.compile(schema_format(PERSON)) is first
    assert len(small._cache) == 2


@pytest.mark.parametrize("response_format, message", [
    (schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (schema_format({"type": "string", "format": "no-such-format"}), "no-such-format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    ("json", "response_format must be an object"),
])
def test_invalid_formats_raise_grammar_error_with_the_reason(compiler, response_format, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(response_format)


def test_non_strict_schemas_ignore_unknown_keywords_with_a_warning(compiler):
    compiled = compiler.compile(schema_format({"type": "string", "format": "no-such-format"}, strict=False))
    assert any("no-such-format" in w for w in compiled.warnings)


def test_missing_schema_means_any_json_object(compiler):
    assert compiler.compile({"type": "json_schema", "json_schema": {"name": "x"}}) \
        is compiler.compile({"type": "json_object"})


def test_a_vocabulary_smaller_than_the_tokenizer_is_rejected(hf_tokenizer):
    """A GrammarError (the request's problem, a 400), not an error that stops the engine."""
    bad = GrammarCompiler(hf_tokenizer.to_str(), 10, [EOS])
    with pytest.raises(GrammarError, match="llguidance cannot use this tokenizer"):
        bad.compile({"type": "json_object"})


# ------------------------------------------------------------------ matcher

def test_mask_matches_what_the_grammar_accepts(compiler, hf_tokenizer, vocab_size):
    matcher = compiler.compile(schema_format(PERSON)).matcher()
    mask = np.zeros(vocab_size, dtype=bool)
    for prefix in ("", '{"name":"Al', '{"name":"Al","age":1', '{"name":"","age":1,"score":2,"active":'):
        m = compiler.compile(schema_format(PERSON)).matcher()
        m.consume(hf_tokenizer.encode(prefix).ids)
        m.fill_mask(mask)
        assert not mask[hf_tokenizer.get_vocab_size():].any()  # padding ids never allowed
        assert mask[EOS] == m.is_accepting() == False  # noqa: E712 - no prefix here is complete
        assert mask.any()
        for token in np.nonzero(mask)[0]:
            # every allowed token is grammar-valid (the mask may also leave out valid
            # but non-canonical tokenisations, e.g. "{" where "{\"" is forced)
            assert m._matcher.validate_tokens([int(token)]) == 1, (prefix, token)
    matcher.fill_mask(mask)
    assert {hf_tokenizer.decode([int(t)]) for t in np.nonzero(mask)[0]} <= {"{", '{"', '{"name', '{"name":"'}


def test_eos_is_allowed_exactly_when_complete_and_finished_after_the_object(compiler, hf_tokenizer, vocab_size):
    m = compiler.compile({"type": "json_object"}).matcher()
    mask = np.zeros(vocab_size, dtype=bool)
    m.consume(hf_tokenizer.encode('{"a":1').ids)
    m.fill_mask(mask)
    assert not mask[EOS] and not m.is_finished()
    assert mask[hf_tokenizer.token_to_id("}")]
    m.consume(hf_tokenizer.encode("}").ids)
    assert m.is_finished() and m.is_accepting()
    m.fill_mask(mask)
    assert np.nonzero(mask)[0].tolist() == [EOS]


def test_rejected_token_raises_and_the_matcher_stays_failed(compiler, hf_tokenizer):
    m = compiler.compile(schema_format(PERSON)).matcher()
    with pytest.raises(GrammarError, match="rejected"):
        m.consume(hf_tokenizer.encode("[").ids)
    assert m.error
    assert not m.is_finished()
    with pytest.raises(GrammarError):
        m.fill_mask(np.zeros(m.vocab_size, dtype=bool))
    # short message: no parser state dump or grammar source in it
    assert "<grammar>" not in m.error


def test_fill_mask_checks_the_row(compiler, vocab_size):
    m = compiler.compile({"type": "json_object"}).matcher()
    with pytest.raises(ValueError, match="mask row"):
        m.fill_mask(np.zeros(vocab_size - 1, dtype=bool))
    with pytest.raises(ValueError, match="mask row"):
        m.fill_mask(np.zeros(vocab_size, dtype=np.float32))


def test_matchers_of_one_grammar_are_independent(compiler, hf_tokenizer):
    compiled = compiler.compile(schema_format(PERSON))
    a, b = compiled.matcher(), compiled.matcher()
    a.consume(hf_tokenizer.encode('{"name":"x"').ids)
    assert b.forced_tokens() == compiled.matcher().forced_tokens()
    with pytest.raises(GrammarError):
        b.consume(hf_tokenizer.encode(',"age"').ids)  # b is still at the start


def test_fixed_prefix_is_forced_for_jump_forward(compiler, hf_tokenizer):
    m = compiler.compile(schema_format(FIXED_PREFIX)).matcher()
    forced = m.forced_tokens()
    text = hf_tokenizer.decode(forced)
    assert text.startswith('{"color') and '{"color":"'.startswith(text)
    m.consume(forced)
    # the rest of the fixed text may be left to sampling (a token could cover it and
    # the value's first characters), but nothing else is allowed
    rest = '{"color":"'[len(text):]
    mask = np.zeros(m.vocab_size, dtype=bool)
    m.fill_mask(mask)
    for token in np.nonzero(mask)[0]:
        piece = hf_tokenizer.decode([int(token)])
        assert piece.startswith(rest) or rest.startswith(piece), piece
    # after the value, the closing brace is forced too
    m2 = compiler.compile(schema_format(FIXED_PREFIX)).matcher()
    m2.consume(hf_tokenizer.encode('{"color":"teal"').ids)
    assert hf_tokenizer.decode(m2.forced_tokens()) == "}"


def test_no_tokens_are_forced_where_the_model_has_a_choice(compiler, hf_tokenizer):
    m = compiler.compile({"type": "json_object"}).matcher()
    assert m.forced_tokens() == []  # "{" then either "}" or a key
    m.consume(hf_tokenizer.encode('{"a":').ids)
    assert m.forced_tokens() == []


# -------------------------------------------------------------- generation

@pytest.mark.parametrize("jump_forward", [False, True], ids=["constraint", "jump_forward"])
@pytest.mark.parametrize("schema", [PERSON, ARRAYS, NESTED], ids=["person", "arrays", "nested"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_produce_schema_valid_json(compiler, hf_tokenizer, vocab_size, schema, jump_forward, seed):
    matcher = compiler.compile(schema_format(schema)).matcher()
    tokens, sampled, forced = generate(matcher, vocab_size, seed, jump_forward)
    text = hf_tokenizer.decode(tokens)
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert sampled + forced >= len(tokens)
    if jump_forward:
        assert forced > 0  # at least the opening '{"' and the first property name
    else:
        assert forced == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_mode_produces_a_json_object(compiler, hf_tokenizer, vocab_size, seed):
    # Free-form JSON can nest without bound under uniform noise; a mild preference for
    # closing brackets (a real model's habit) keeps the run short without helping validity.
    closing = np.zeros(vocab_size, dtype=np.float32)
    for token in range(hf_tokenizer.get_vocab_size()):
        if any(c in hf_tokenizer.decode([token]) for c in "}]\""):
            closing[token] = 3.0
    matcher = compiler.compile({"type": "json_object"}).matcher()
    tokens, _, _ = generate(matcher, vocab_size, seed, jump_forward=True, closing_bias=closing)
    assert isinstance(json.loads(hf_tokenizer.decode(tokens)), dict)


def test_jump_forward_samples_fewer_tokens_for_the_same_output(compiler, hf_tokenizer, vocab_size):
    """Replaying a constrained output with jump-forward needs fewer sampling steps."""
    matcher = compiler.compile(schema_format(NESTED)).matcher()
    tokens, sampled, _ = generate(matcher, vocab_size, seed=5, jump_forward=False)
    replay = compiler.compile(schema_format(NESTED)).matcher()
    steps = 0
    i = 0
    while i < len(tokens):
        ff = replay.forced_tokens()
        if ff and tokens[i:i + len(ff)] == ff:
            replay.consume(ff)
            i += len(ff)
            continue
        replay.consume([tokens[i]])
        steps += 1
        i += 1
    assert replay.is_finished()
    assert steps < sampled

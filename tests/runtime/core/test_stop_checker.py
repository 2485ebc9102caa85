"""StopChecker: stop strings across token boundaries, stop tokens, EOS, length, ignore_eos."""
import random

import pytest

from engines.runtime.core.sampler import SamplingParams
from engines.runtime.core.stop_checker import StopCheck, StopChecker

EOS = 2
TOK = 100  # an ordinary token id


def feed(checker: StopChecker, deltas, token_ids=None) -> tuple[str, list[str], StopCheck]:
    """Stream deltas until the checker finishes: (all streamed text, per-step text, last result)."""
    pieces = []
    result = None
    for i, delta in enumerate(deltas):
        result = checker.step(token_ids[i] if token_ids else TOK, delta)
        pieces.append(result.text)
        if result.finish_reason:
            break
    return "".join(pieces), pieces, result


def test_without_stops_text_streams_unchanged():
    text, pieces, last = feed(StopChecker(), ["Hel", "lo", " world"])
    assert pieces == ["Hel", "lo", " world"]
    assert last == StopCheck(" world")


def test_stop_string_inside_one_token_is_trimmed_with_everything_after_it():
    text, _, last = feed(StopChecker(stop=["###"]), ["Hello###world", "more"])
    assert text == "Hello"
    assert (last.finish_reason, last.stop_reason) == ("stop", "###")


def test_stop_string_spanning_tokens_is_held_back_then_trimmed():
    text, pieces, last = feed(StopChecker(stop=["###"]), ["Hel", "lo #", "#", "# more", "never"])
    assert pieces == ["Hel", "lo ", "", ""]
    assert text == "Hello "
    assert last.finish_reason == "stop"


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    _, pieces, last = feed(StopChecker(stop=["###"]), ["a#", "#b", "c"])
    assert pieces == ["a", "##b", "c"]
    assert last.finish_reason is None


def test_longest_possible_prefix_among_several_stops_is_held():
    checker = StopChecker(stop=["xyz", "yz!"])
    assert checker.step(TOK, "axy").text == "a"  # "xy" could start "xyz"
    assert checker.step(TOK, "z?").text == ""   # "xyz" complete: stop
    assert checker.finished


def test_the_stop_completed_first_wins_whatever_the_token_boundaries():
    for deltas in (["hello world"], ["hel", "lo w", "orld"], list("hello world")):
        streamed, _, last = feed(StopChecker(stop=["world", "lo w"]), deltas)
        assert (streamed, last.stop_reason) == ("hel", "lo w")
    # "b" is complete before "ab#" is, even when both arrive in one token
    for deltas in (["ab#"], ["a", "b#"], list("ab#")):
        streamed, _, last = feed(StopChecker(stop=["ab#", "b"]), deltas)
        assert (streamed, last.stop_reason) == ("a", "b")
    # two stops complete at the same character: the longer (earlier-starting) one
    streamed, _, last = feed(StopChecker(stop=["c", "bc"]), ["abcd"])
    assert (streamed, last.stop_reason) == ("a", "bc")


def test_stop_string_matching_only_with_earlier_held_text():
    # "ab" is held after the first token; "c" completes "abc" although no single delta has it
    text, _, last = feed(StopChecker(stop=["abc"]), ["xab", "c"])
    assert text == "x" and last.stop_reason == "abc"


def test_unicode_stop_string_across_tokens():
    text, _, last = feed(StopChecker(stop=["éé"]), ["caf", "é", "é au lait"])
    assert text == "caf" and last.finish_reason == "stop"


def test_stop_token_ends_without_its_text_but_with_held_text():
    checker = StopChecker(stop=["###"], stop_token_ids=[7])
    assert checker.step(TOK, "a#").text == "a"
    assert checker.is_stop_token(7) and not checker.is_stop_token(TOK)
    last = checker.step(7, "")  # the engine never passes the stop token's own text
    assert last == StopCheck("#", "stop", 7)


def test_stop_token_outputs_what_the_tokens_before_it_still_owed():
    """The detokenizer's final flush (a held byte-fallback character) comes with the stop token."""
    checker = StopChecker(stop=["###"], eos_token_ids=[EOS])
    assert checker.step(TOK, "ok #").text == "ok "
    assert checker.step(EOS, "日") == StopCheck("#日", "stop", None)
    # A stop string completed by that text still wins: it ends first.
    checker = StopChecker(stop=["日"], eos_token_ids=[EOS])
    assert checker.step(TOK, "ok ").text == "ok "
    assert checker.step(EOS, "日") == StopCheck("", "stop", "日")


def test_eos_ends_with_no_stop_reason():
    last = StopChecker(eos_token_ids=[EOS]).step(EOS, "")
    assert last == StopCheck("", "stop", None)


def test_length_limit_flushes_held_text():
    checker = StopChecker(stop=["###"], max_tokens=2)
    assert checker.step(TOK, "a").text == "a"
    last = checker.step(TOK, "b#")
    assert last == StopCheck("b#", "length", None)
    assert checker.num_tokens == 2


def test_stop_string_on_the_last_allowed_token_is_a_stop():
    checker = StopChecker(stop=["!"], max_tokens=2)
    checker.step(TOK, "a")
    assert checker.step(TOK, "b!").finish_reason == "stop"


def test_eos_on_the_last_allowed_token_is_a_stop():
    checker = StopChecker(eos_token_ids=[EOS], max_tokens=1)
    assert checker.step(EOS, "").finish_reason == "stop"


def test_ignore_eos_ignores_eos_stop_tokens_and_stop_strings():
    checker = StopChecker(stop=["###"], stop_token_ids=[7], eos_token_ids=[EOS], max_tokens=4, ignore_eos=True)
    results = [checker.step(EOS, ""), checker.step(7, "x"), checker.step(TOK, "###"), checker.step(TOK, "y")]
    assert [r.text for r in results] == ["", "x", "###", "y"]
    assert [r.finish_reason for r in results] == [None, None, None, "length"]


def test_step_after_finish_is_an_error():
    checker = StopChecker(eos_token_ids=[EOS])
    checker.step(EOS, "")
    with pytest.raises(RuntimeError, match="finished"):
        checker.step(TOK, "x")


def test_flush_releases_held_text_for_engine_side_finishes():
    checker = StopChecker(stop=["</json>"])
    assert checker.step(TOK, '{"a":1}</js').text == '{"a":1}'
    assert checker.flush() == "</js"
    assert checker.flush() == ""


def test_from_params_uses_the_smaller_limit_and_the_request_stops():
    params = SamplingParams(stop=["\n\n"], stop_token_ids=(9,), max_tokens=5)
    checker = StopChecker.from_params(params, eos_token_ids=[EOS], max_tokens_cap=3)
    assert [checker.step(TOK, "a").finish_reason for _ in range(3)] == [None, None, "length"]
    checker = StopChecker.from_params(params, eos_token_ids=[EOS], max_tokens_cap=None)
    assert checker.step(TOK, "x\n").text == "x"
    assert checker.step(TOK, "\ny").stop_reason == "\n\n"
    assert StopChecker.from_params(params, [EOS]).step(9, "").stop_reason == 9
    unlimited = StopChecker.from_params(SamplingParams(), [EOS])
    assert all(unlimited.step(TOK, "a").finish_reason is None for _ in range(1000))
    ignoring = StopChecker.from_params(SamplingParams(ignore_eos=True, stop=["a"], max_tokens=2), [EOS])
    assert [ignoring.step(EOS, "a").finish_reason for _ in range(2)] == [None, "length"]


def test_invalid_max_tokens():
    with pytest.raises(ValueError, match="max_tokens"):
        StopChecker(max_tokens=-1)


@pytest.mark.parametrize("seed", range(60))
def test_streamed_output_equals_the_text_before_the_first_completed_stop(seed):
    """Any split of any text into deltas streams exactly the text before the first stop to complete."""
    rng = random.Random(seed)
    alphabet = "ab#\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)], strict=True)] if text else []
    checker = StopChecker(stop=stops)
    streamed, _, last = feed(checker, deltas)
    # reference: the first character position at which some stop string is complete
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if ends:
        end, neg_len = min(ends)
        assert streamed == text[:end + neg_len]
        assert last.finish_reason == "stop"
        assert text.find(last.stop_reason) + len(last.stop_reason) == end
    else:
        assert streamed + checker.flush() == text
        assert not checker.finished


def test_min_tokens_holds_eos_and_stop_tokens_as_ordinary_tokens():
    checker = StopChecker(stop_token_ids=[7], eos_token_ids=[EOS], min_tokens=3)
    assert checker.banned_tokens() == {EOS, 7}
    assert not checker.is_stop_token(EOS)
    assert checker.step(EOS, "a") == StopCheck("a")  # the first 3 tokens never stop
    assert checker.step(7, "b") == StopCheck("b")
    assert checker.banned_tokens() == {EOS, 7}
    assert checker.step(TOK, "c") == StopCheck("c")
    assert checker.banned_tokens() == set()  # the 4th token may end the choice
    assert checker.is_stop_token(7)
    assert checker.step(7, "") == StopCheck("", "stop", 7)


def test_min_tokens_looks_for_stop_strings_only_after_its_tokens():
    # A stop string inside the first two tokens' text is output; from the third token on it stops.
    text, pieces, last = feed(StopChecker(stop=["#"], min_tokens=2), ["a#", "#b", "c#d", "never"])
    assert pieces == ["a#", "#b", "c"]
    assert (last.finish_reason, last.stop_reason) == ("stop", "#")
    # No match can begin inside the guaranteed text: "x#" + "#y" holds no "##" from token 2 on.
    text, _, last = feed(StopChecker(stop=["##"], min_tokens=1), ["x#", "#y", "z"])
    assert text == "x##yz" and last.finish_reason is None


def test_min_tokens_with_ignore_eos_bans_nothing_and_max_tokens_still_ends():
    checker = StopChecker(eos_token_ids=[EOS], ignore_eos=True, min_tokens=5, max_tokens=2)
    assert checker.banned_tokens() == set()
    checker.step(EOS, "")
    assert checker.step(EOS, "").finish_reason == "length"


def test_from_params_takes_min_tokens():
    checker = StopChecker.from_params(SamplingParams(min_tokens=2, stop_token_ids=(9,)), [EOS])
    assert checker.banned_tokens() == {EOS, 9}

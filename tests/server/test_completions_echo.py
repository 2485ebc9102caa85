"""``/v1/completions`` as lm-evaluation-harness's ``local-completions`` uses it: ``echo`` with
prompt logprobs, a list of prompts answered with a choice each (times ``n``), ``max_tokens: 0``,
streamed and whole, on the real demo engine; the logprobs against a plain reference computed
from the model's full-sequence forward (float32 logits, log-softmax in NumPy)."""
from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from engines.registry import registry
from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.demo_model import demo_checkpoint_path
from engines.runtime.model.llama import LlamaModel
from tests.runtime.demo_engine import full_forward_logprobs
from tests.server.conftest import SMALL_ENGINE, TRACED, assert_error, sse_payloads, wait_until

COMPLETIONS = "/v1/completions"
TOLERANCE = 1e-4  # float32 logits of other batches and chunkings: see tests/runtime/core/test_prompt_logprobs.py


@pytest.fixture(scope="module")
def reference_model() -> LlamaModel:
    """The served demo checkpoint in a model of its own (the engine's is its thread's)."""
    return LlamaModel.from_checkpoint(load_checkpoint(demo_checkpoint_path()), backend="cpu")


def ids(count: int, seed: int) -> list[int]:
    """Ordinary demo token ids (past the special ones)."""
    return [int(t) for t in np.random.default_rng(seed).integers(300, 4000, count)]


def token_text(tokenizer: Any, token: int) -> str:
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def assert_prompt_scores(logprobs: dict[str, Any], model: LlamaModel, prompt: list[int], top: int) -> None:
    """The first ``len(prompt)`` entries are the prompt's: null first, then the reference's."""
    tokenizer = registry.get(TRACED).tokenizer
    want = full_forward_logprobs(model, prompt)
    assert logprobs["tokens"][:len(prompt)] == [token_text(tokenizer, t) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for pos in range(1, len(prompt)):
        row = want[pos - 1]
        assert logprobs["token_logprobs"][pos] == pytest.approx(row[prompt[pos]], abs=TOLERANCE), pos
        best = np.argsort(-row, kind="stable")[:top]
        alternatives = logprobs["top_logprobs"][pos]
        assert list(alternatives) == [token_text(tokenizer, int(t)) for t in best]
        np.testing.assert_allclose(list(alternatives.values()), row[best], atol=TOLERANCE)


def lm_eval_score(choice: dict[str, Any], context_tokens: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions reads of a loglikelihood reply
    (``parse_logprobs``): the continuation's summed logprob (the last entry, the generated
    token, left out) and whether each continuation token was the most likely one."""
    scores = choice["logprobs"]["token_logprobs"][context_tokens:-1]
    tops = choice["logprobs"]["top_logprobs"][context_tokens:-1]
    return sum(scores), all(score == max(top.values()) for score, top in zip(scores, tops, strict=True))


async def test_echo_with_max_tokens_zero_scores_a_text_prompt(client: httpx.AsyncClient,
                                                              reference_model: LlamaModel) -> None:
    text = "Once upon a time there was a model"
    body = {"model": TRACED, "prompt": text, "echo": True, "logprobs": 3, "max_tokens": 0, "temperature": 0}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    prompt = registry.get(TRACED).tokenizer.encode(text)
    assert choice["text"] == text and choice["finish_reason"] == "length" and choice["index"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == len(prompt)
    assert_prompt_scores(logprobs, reference_model, prompt, 3)
    # The BOS the tokenizer added is not in the text: it takes no characters.
    offsets = logprobs["text_offset"]
    assert offsets[0] == offsets[1] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(prompt), 0, len(prompt))


async def test_lm_eval_loglikelihood_batch(client: httpx.AsyncClient, reference_model: LlamaModel) -> None:
    """lm-eval's request (token ids, a list of them, temperature 0, max_tokens 1, logprobs 1, echo):
    a choice per prompt in order, the prompt's logprobs and then the generated token's, and the
    continuation's score as the reference gives it."""
    context = ids(12, 1)
    prompts = [context + ids(3, 2), context + ids(4, 3), ids(20, 4)]
    body = {"model": TRACED, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    choices = reply["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    tokenizer = registry.get(TRACED).tokenizer
    for prompt, choice in zip(prompts, choices, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1  # the generated token last
        assert_prompt_scores(logprobs, reference_model, prompt, 1)
        want = full_forward_logprobs(reference_model, prompt)
        score, greedy = lm_eval_score(choice, len(context))
        expected = sum(want[p - 1][prompt[p]] for p in range(len(context), len(prompt)))
        assert score == pytest.approx(expected, abs=len(prompt) * TOLERANCE)
        assert greedy == all(int(np.argmax(want[p - 1])) == prompt[p] for p in range(len(context), len(prompt)))
        # The text is the prompt (its ids decoded) and the completion.
        assert choice["text"].startswith(tokenizer.decode(prompt, skip_special_tokens=False))
    # A continuation the model would write itself is greedy by that test.
    greedy_ids = list(context)
    for _ in range(3):
        greedy_ids.append(int(np.argmax(full_forward_logprobs(reference_model, greedy_ids)[-1])))
    response = await client.post(COMPLETIONS, json={**body, "prompt": [greedy_ids]})
    assert lm_eval_score(response.json()["choices"][0], len(context))[1] is True
    usage = reply["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3


async def test_echo_then_completion_equals_the_request_without_echo(client: httpx.AsyncClient) -> None:
    """With max_tokens > 0 the echoed reply is the prompt, then what the plain request generates
    (its logprobs too), offsets running on past the prompt."""
    prompt = ids(10, 5)
    plain = (await client.post(COMPLETIONS, json={"model": TRACED, "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "logprobs": 2,
                                                   "debug_config": {"ignore_eos": True}})).json()["choices"][0]
    echoed = (await client.post(COMPLETIONS, json={"model": TRACED, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0, "logprobs": 2, "echo": True,
                                                    "debug_config": {"ignore_eos": True}})).json()["choices"][0]
    head = registry.get(TRACED).tokenizer.decode(prompt, skip_special_tokens=False)
    assert echoed["text"] == head + plain["text"]
    tail = {key: values[len(prompt):] for key, values in echoed["logprobs"].items()}
    assert tail["tokens"] == plain["logprobs"]["tokens"]
    np.testing.assert_allclose(tail["token_logprobs"], plain["logprobs"]["token_logprobs"], atol=TOLERANCE)
    assert [list(t) for t in tail["top_logprobs"]] == [list(t) for t in plain["logprobs"]["top_logprobs"]]
    assert tail["text_offset"] == [len(head) + o for o in plain["logprobs"]["text_offset"]]
    # echo without logprobs: the texts alone.
    bare = (await client.post(COMPLETIONS, json={"model": TRACED, "prompt": prompt, "max_tokens": 4, "echo": True,
                                                  "temperature": 0, "debug_config": {"ignore_eos": True}})).json()
    assert bare["choices"][0]["text"] == head + plain["text"] and bare["choices"][0]["logprobs"] is None


async def test_a_list_of_prompts_with_n_orders_choices_prompt_first(client: httpx.AsyncClient) -> None:
    texts = ["The sky is", "Numbers:", "Once"]
    body = {"model": TRACED, "prompt": texts, "n": 2, "max_tokens": 3, "temperature": 0,
            "debug_config": {"ignore_eos": True}}
    reply = (await client.post(COMPLETIONS, json=body)).json()
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    singles = []
    for text in texts:
        single = (await client.post(COMPLETIONS, json={**body, "prompt": text})).json()
        singles.append(single)
    for i, choice in enumerate(reply["choices"]):
        assert choice["text"] == singles[i // 2]["choices"][i % 2]["text"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert reply["usage"][key] == sum(s["usage"][key] for s in singles)
    assert "extra" not in reply["usage"]  # one request's metrics; a list has several
    assert reply["id"].startswith("cmpl-")


async def test_streamed_echo_is_the_whole_reply_in_pieces(client: httpx.AsyncClient) -> None:
    """Streaming echo: each choice's first chunk carries its prompt (and the prompt's logprobs);
    joined, the chunks are the whole reply; one usage chunk sums the prompts'."""
    prompts = [ids(9, 6), ids(5, 7)]
    body = {"model": TRACED, "prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 3,
            "logprobs": 2, "echo": True, "debug_config": {"ignore_eos": True}}
    whole = (await client.post(COMPLETIONS, json=body)).json()
    events = sse_payloads((await client.post(COMPLETIONS, json={**body, "stream": True,
                                                                 "stream_options": {"include_usage": True}})).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    joined: dict[int, dict[str, Any]] = {}
    for event in events[:-2]:
        for piece in event["choices"]:
            into = joined.setdefault(piece["index"], {"text": "", "finish_reason": None,
                                                      "logprobs": {k: [] for k in whole["choices"][0]["logprobs"]}})
            if not into["text"]:
                prompt = prompts[piece["index"] // 2]
                assert len(piece["logprobs"]["tokens"]) >= len(prompt)  # the prompt, whole, first
                assert piece["logprobs"]["token_logprobs"][0] is None
            into["text"] += piece["text"]
            into["finish_reason"] = piece["finish_reason"] or into["finish_reason"]
            for key, values in piece["logprobs"].items():
                into["logprobs"][key] += values
    assert sorted(joined) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        got = joined[choice["index"]]
        assert got["text"] == choice["text"] and got["finish_reason"] == choice["finish_reason"]
        assert got["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
        assert got["logprobs"]["text_offset"] == choice["logprobs"]["text_offset"]
        np.testing.assert_allclose(got["logprobs"]["token_logprobs"][1:], choice["logprobs"]["token_logprobs"][1:],
                                   atol=TOLERANCE)


async def test_streamed_max_tokens_zero_sends_the_prompt_and_its_end(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": "Hello there", "echo": True, "logprobs": 0, "max_tokens": 0, "stream": True}
    events = sse_payloads((await client.post(COMPLETIONS, json=body)).text)
    assert events[-1] == "[DONE]"
    (chunk,) = events[:-1]
    (choice,) = chunk["choices"]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["top_logprobs"][1] == {}  # logprobs 0: the token's own, no alternatives


async def test_long_and_cached_prompts_are_scored_whole(client: httpx.AsyncClient,
                                                        reference_model: LlamaModel) -> None:
    """A prompt past the engine's prefill chunk, then one whose prefix the cache holds (the same
    prompt again, and a longer one): every position scored, as the reference."""
    prompt = ids(SMALL_ENGINE["prefill_chunk_size"] + 70, 8)
    body = {"model": TRACED, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0}
    first = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["logprobs"]
    assert_prompt_scores(first, reference_model, prompt, 2)
    engine = registry.get(TRACED).engine
    assert engine.kv_pool.match_prefix(prompt + [5]) >= 128  # the cache holds it now
    again = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["logprobs"]
    assert again["tokens"] == first["tokens"]
    np.testing.assert_allclose(again["token_logprobs"][1:], first["token_logprobs"][1:], atol=TOLERANCE)
    longer = prompt + ids(10, 9)
    extended = (await client.post(COMPLETIONS, json={**body, "prompt": longer})).json()["choices"][0]["logprobs"]
    assert_prompt_scores(extended, reference_model, longer, 2)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be a positive integer, got 0 (0, no completion, goes with echo"),
    ({"prompt": ["a"] * 65}, "prompt", "prompt: holds 65 prompts; a request takes at most 64"),
    ({"echo": "yes"}, "echo", "echo: Input should be a valid boolean"),
])
async def test_refusals_name_the_field(client: httpx.AsyncClient, fields: dict, param: str, message: str) -> None:
    response = await client.post(COMPLETIONS, json={"model": TRACED, "prompt": "Hi", **fields})
    body = assert_error(response, 400)
    assert body["message"].startswith(message) and body["param"] == param


async def test_a_refused_prompt_of_a_list_refuses_the_request_and_runs_none(client: httpx.AsyncClient) -> None:
    engine = registry.get(TRACED)
    long_prompt = ids(1900, 10)  # more than the context holds with max_tokens: the engine refuses it
    body = {"model": TRACED, "prompt": [ids(5, 11), long_prompt], "max_tokens": 200, "echo": True, "logprobs": 1}
    response = await client.post(COMPLETIONS, json=body)
    assert_error(response, 400)
    assert "context" in response.json()["message"]
    await wait_until(lambda: engine.num_streams == 0 and not engine.engine.has_work)

"""The built-in real model over the OpenAI API: answers that make sense, that end on their own,
structured output that closes, stop strings on real text, and what /stats says of it.

Most tests run the float32 path (the GGUF dequantized at load, ``--weights-dtype float32``), whose
greedy answers are transformers' on the same file (tests/runtime/model/test_smollm2_parity.py);
the last runs the default, the file's types kept."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import jsonschema
import pytest

from engines.startup import ModelSpec, build_engines
from engines.runtime.frontend.async_engine import AsyncEngine
from engines.runtime.core.engine import EngineConfig
from tests.server.conftest import sse_payloads

CHAT = "/v1/chat/completions"
MODEL = "smollm2"


@pytest.fixture(scope="module")
def smollm2_engine() -> Iterator[AsyncEngine]:
    """SmolLM2 on the float32 path (``--weights-dtype float32``: not the default)."""
    (engine,) = build_engines([ModelSpec.parse(MODEL)], EngineConfig(max_num_seqs=4, prefill_chunk_size=256),
                              backend="cpu", keep_quantized=False)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
async def api(serve: Callable[..., httpx.AsyncClient], smollm2_engine: AsyncEngine):
    async with serve(enable_debug=True, serving=[smollm2_engine]) as http:
        yield http


def ask(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


async def test_it_answers_the_question_and_stops_on_its_own(api: httpx.AsyncClient) -> None:
    reply = (await api.post(CHAT, json=ask("What is the capital of France?", max_tokens=64))).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"  # on <|im_end|>, long before max_tokens
    assert reply["usage"]["completion_tokens"] < 64


async def test_a_stream_ends_with_stop_and_done(api: httpx.AsyncClient) -> None:
    response = await api.post(CHAT, json=ask("What is the capital of France?", max_tokens=64, stream=True))
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "The capital of France is Paris."


async def test_ignore_eos_runs_past_the_end_of_the_answer(api: httpx.AsyncClient) -> None:
    body = ask("What is the capital of France?", max_tokens=16, debug_config={"ignore_eos": True})
    choice = (await api.post(CHAT, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("The capital of France is Paris.")


@pytest.mark.parametrize("mode", ["constraint", "jump_forward"])
async def test_json_object_parses_and_closes(api: httpx.AsyncClient, mode: str) -> None:
    body = ask("Describe a cat as a JSON object with its name and age.", max_tokens=96,
               response_format={"type": "json_object"}, debug_config={"grammar_execution_mode": mode})
    choice = (await api.post(CHAT, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("mode", ["constraint", "jump_forward"])
async def test_json_schema_parses_closes_and_validates(api: httpx.AsyncClient, mode: str) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
              "properties": {"city": {"type": "string", "maxLength": 40},
                             "country": {"type": "string", "maxLength": 40},
                             "population": {"type": "integer", "minimum": 0}}}
    body = ask("Give the capital of France, its country and its population.", max_tokens=96,
               response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
               debug_config={"grammar_execution_mode": mode})
    choice = (await api.post(CHAT, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"


async def test_stop_strings_cut_real_text_where_they_start(api: httpx.AsyncClient) -> None:
    question = "Name the four seasons of the year, one per line."
    full = (await api.post(CHAT, json=ask(question, max_tokens=60))).json()["choices"][0]["message"]["content"]
    words = full.split()
    assert len(words) > 4, full
    stop = " " + words[3]  # a word well inside the answer, with the space before it
    cut = full.index(stop)
    for stream in (False, True):
        response = await api.post(CHAT, json=ask(question, max_tokens=60, stop=[stop, "never-there"], stream=stream))
        if stream:
            events = sse_payloads(response.text)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
            finish = events[-2]["choices"][0]["finish_reason"]
        else:
            choice = response.json()["choices"][0]
            text, finish = choice["message"]["content"], choice["finish_reason"]
        assert (text, finish) == (full[:cut], "stop")


async def test_stats_and_models_name_the_real_model(api: httpx.AsyncClient, smollm2_engine: AsyncEngine) -> None:
    stats = (await api.get("/stats")).json()["engines"][MODEL]
    assert stats["weights"] == "GGUF F32 x61, Q4_1 x210, Q8_0 x1"
    assert stats["weights_in_memory"] == "float32"  # this module's engine: dequantized (--weights-dtype float32)
    kv = stats["kv_cache"]
    # Sized for the model: as many bytes as its float32 weights, far below a fixed 65,536 tokens.
    assert kv["rule"] == "auto" and kv["tokens"] >= 8192 and kv["bytes"] < 1 << 30
    assert kv["bytes"] == kv["tokens"] * 2 * 30 * 3 * 64 * 4
    models = (await api.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == [MODEL]


async def test_by_default_an_engine_process_keeps_the_files_types_and_answers_as_llama_cpp_does(serve) -> None:
    """The default (``--weights-dtype gguf``, build_engines' default too): the engine process loads
    the file's Q4_1 and Q8_0 matrices as they are, /stats says so, and the answer begins as
    llama.cpp's on the same file (llama-cpp-python 0.3.36, greedy: "L'Étoile, la Cité, la Nation,
    ..."): its int8 activations, llama.cpp's too, part from the float32 path's "Paris"
    (tests/runtime/model/test_quantized_model.py says why only the first word is asserted)."""
    (engine,) = build_engines([ModelSpec.parse(f"{MODEL}:{MODEL}-q")],
                              EngineConfig(max_num_seqs=2, prefill_chunk_size=256),
                              backend="cpu", process=True)
    engine.start()
    try:
        async with serve(enable_debug=True, serving=[engine]) as http:
            stats = (await http.get("/stats")).json()["engines"][f"{MODEL}-q"]
            assert stats["weights_in_memory"] == "Q4_1 x210, Q8_0 x1"
            reply = (await http.post(CHAT, json={**ask("What is the capital of France?", max_tokens=64),
                                                 "model": f"{MODEL}-q"})).json()
            assert reply["choices"][0]["message"]["content"].startswith("L'Étoile")
    finally:
        engine.shutdown()

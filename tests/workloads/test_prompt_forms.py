"""A replay's prompts: the recorded ids where the workload holds them, ids of the recorded length
otherwise, and text of about that many tokens for a server that takes text only."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from engines.runtime.model.builtin_models import SMOLLM2, builtin_model_path
from engines.runtime.model.checkpoint import load_checkpoint
from engines.workloads.replay import WorkloadError, _body, prompt_for, replay

ROW = {"offset_s": 0.0, "prompt_tokens": 40, "completion_tokens": 3}


def test_ids_are_the_recorded_ones_or_of_the_recorded_length() -> None:
    assert _body(2, ROW, "m")["prompt"] == prompt_for(2, 40) and len(prompt_for(2, 40)) == 40
    assert _body(2, {**ROW, "prompt_token_ids": [5, 6, 7]}, "m")["prompt"] == [5, 6, 7]


def test_text_is_about_as_many_tokens_of_a_llama_tokenizer() -> None:
    text = _body(3, ROW, "m", "text")["prompt"]
    assert isinstance(text, str) and text.startswith("3:")
    tokenizer = load_checkpoint(builtin_model_path(SMOLLM2), load_weights=False).tokenizer
    tokens = len(tokenizer.encode(text))
    assert abs(tokens - ROW["prompt_tokens"]) <= 3, tokens


def test_the_recorded_output_length_is_asked_for_with_and_without_ignore_eos() -> None:
    body = _body(0, ROW, "m", "text")
    assert body["max_tokens"] == body["min_tokens"] == 3 and body["ignore_eos"] is True


def test_an_unknown_prompt_form_is_refused() -> None:
    workload = {"format": "llm-debugsite.workload", "version": 1, "requests": [ROW]}
    with pytest.raises(WorkloadError, match="prompt_form"):
        asyncio.run(replay(workload, httpx.AsyncClient(), "m", "t", prompt_form="words"))

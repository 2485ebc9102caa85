"""The built-in real model against transformers on the same GGUF file: tokenizer, chat template,
and greedy generation through the chat template, token for token.

transformers reads a GGUF itself (``from_pretrained(folder, gguf_file=...)``: its own dequantizer
and tokenizer conversion), so nothing of ours is on its side of the comparison.

The model tests check the float32 path: the file dequantized at load (``keep_quantized=False``,
``serve --weights-dtype float32``), as transformers dequantizes it. ``serve``'s default keeps the
file's types, with int8 activations: tests/runtime/model/test_quantized_model.py bounds how far it
is from this path.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.model.gguf.container import read_gguf
from engines.runtime.model.gguf.vocabulary import tokenizer_files_from_gguf
from engines.runtime.model.llama import LlamaModel
from engines.runtime.model.tokenizer import Tokenizer
from tests.runtime.demo_engine import request, run_all

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Tell me about lighthouses."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "What is 12 times 7?"}, {"role": "assistant", "content": "12 times 7 is 84."},
     {"role": "user", "content": "And 13 times 7?"}],
]
TEXTS = ["Hello, world!", "In 2024, 12345 apples cost $3.99.", "  two  spaces,\ttabs\n\n\nand newlines \n",
         "unicode: café naïve 日本語 한국어 emoji 🎉🚀👍🏽", "def f(x):\n    return x ** 2  # square",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "don't won't I'll we've THEY'RE"]


@pytest.fixture(scope="module")
def smollm2(smollm2_file: Path) -> Checkpoint:
    """The file dequantized to float32: the path these tests hold to transformers'."""
    return load_checkpoint(smollm2_file, keep_quantized=False)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_file: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)


def test_the_tokenizer_encodes_and_decodes_as_transformers(smollm2: Checkpoint, hf_tokenizer) -> None:
    tok = smollm2.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        assert tok.encode(text, add_special_tokens=False) == hf_tokenizer(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), text


def test_numbers_are_split_one_by_one_as_llama_cpp_does(smollm2: Checkpoint, hf_tokenizer) -> None:
    """The file's pre-tokenizer is 'smollm': every number character (\\p{N}) alone, then GPT-2's
    split, as llama.cpp and SmolLM2's own tokenizer.json (``Digits(individual_digits=True)``) do.
    transformers' GGUF conversion knows no 'smollm' and keeps GPT-2's split alone: ASCII digits come
    out the same (the vocabulary has no merges of them), other number characters do not."""
    tok = smollm2.tokenizer
    assert [tok.decode([i]) for i in tok.encode("year 2024")] == ["year", " ", "2", "0", "2", "4"]
    pieces = [tok.decode([i]) for i in tok.encode("x² ½ Ⅻ")]
    assert pieces[:2] == ["x", "²"] and "½" in pieces and " ½" not in pieces
    assert tok.encode("x² ½ Ⅻ") != hf_tokenizer("x² ½ Ⅻ").input_ids  # transformers joins " " and "½"


def test_the_chat_template_renders_as_transformers(smollm2: Checkpoint, hf_tokenizer) -> None:
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            ours = smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours == theirs
    # The file's template writes a default system turn when there is none.
    assert smollm2.tokenizer.apply_chat_template(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful")


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_other_pre_tokenizers_split_as_transformers_splits_them(smollm2_file: Path, pre: str) -> None:
    """The same vocabulary under Llama 3's and Qwen2's splitting rules, against transformers' own
    conversion of a GGUF that names them."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    with read_gguf(smollm2_file) as file:
        metadata = {**file.metadata, "tokenizer.ggml.pre": pre}
    tokenizer_json, config = tokenizer_files_from_gguf(metadata)
    ours = Tokenizer.from_json(tokenizer_json, config)
    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(smollm2_file))
    backend, _ = convert_gguf_tokenizer(arch, {**tokenizer_dict, "pre_tokenizer_type": pre})
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == backend.encode(text, add_special_tokens=False).ids, text


@pytest.fixture(scope="module")
def hf_model(smollm2_file: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.mark.slow
def test_float32_greedy_chat_answers_equal_transformers_token_for_token(smollm2: Checkpoint, hf_tokenizer,
                                                                       hf_model) -> None:
    """The float32 path (``smollm2``: dequantized at load), greedy through the chat template."""
    new_tokens = 32
    prompts = []
    for chat in CHATS:
        text = smollm2.tokenizer.apply_chat_template(chat)
        ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
        assert ids == hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
        prompts.append(ids)
    engine = Engine(LlamaModel.from_checkpoint(smollm2, backend="cpu"), smollm2,
                    EngineConfig(max_num_seqs=4, num_pages=128, prefill_chunk_size=256))
    # Both stop at <|im_end|> (id 2) and keep it as the last token.
    ours = run_all(engine, [request(f"c{i}", ids, max_tokens=new_tokens) for i, ids in enumerate(prompts)])
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                    eos_token_id=2, pad_token_id=2)
            theirs = out[0, len(ids):].tolist()
            assert ours[f"c{i}"].tokens == theirs, (CHATS[i], smollm2.tokenizer.decode(ours[f"c{i}"].tokens),
                                                     smollm2.tokenizer.decode(theirs))
    assert ours["c0"].text == "The capital of France is Paris." and ours["c0"].finish_reason == "stop"


def test_float32_first_step_logits_are_close_to_transformers(smollm2: Checkpoint, hf_model) -> None:
    """The float32 path's logits after a chat prompt's prefill."""
    from engines.runtime.model.forward_batch import ForwardBatch

    model = LlamaModel.from_checkpoint(smollm2, backend="cpu")
    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(CHATS[1]), add_special_tokens=False)
    kv = model.new_kv_cache(8, 16)
    pages = -(-len(ids) // 16)
    batch = ForwardBatch(np.array(ids, np.int32), np.array([0, len(ids)], np.int32), np.zeros(1, np.int32),
                         np.arange(pages, dtype=np.int32)[None, :])
    ours = model.forward(batch, kv)[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(ours - theirs).max() < 2e-3 * np.abs(theirs).max()


def test_float32_prompt_logprobs_are_close_to_transformers(smollm2: Checkpoint, hf_model) -> None:
    """Prompt logprobs (what echo returns, lm-eval's loglikelihood reads) of a prompt in several
    prefill chunks, against log-softmax of transformers' logits at every position."""
    text = ("The lighthouse stood at the edge of the cliff, its lamp turning slowly through the night. "
            "Sailors far out at sea watched for its light, and every ship that saw it found the harbour.")
    ids = smollm2.tokenizer.encode(text)
    top = 5
    engine = Engine(LlamaModel.from_checkpoint(smollm2, backend="cpu"), smollm2,
                    EngineConfig(max_num_seqs=2, num_pages=16, prefill_chunk_size=16))
    assert len(ids) > 2 * 16
    engine.add_request(request("score", ids, max_tokens=0, prompt_logprobs=top))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    (scores,) = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    with torch.no_grad():
        want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    assert scores[0] is None and len(scores) == len(ids)
    got = np.array([s.logprob for s in scores[1:]])
    expected = want[np.arange(len(ids) - 1), ids[1:]]
    assert np.abs(got - expected).max() < 1e-3, np.abs(got - expected).max()  # 2.8e-5 measured
    for pos, entry in enumerate(scores[1:]):
        row = want[pos]
        ranked = np.argsort(-row)[:top + 1]
        gaps = -np.diff(row[ranked])  # each rank's lead over the next
        # The same token at each rank transformers' own ranking does not nearly tie.
        clear = [i for i in range(top) if gaps[i] > 1e-2 and (i == 0 or gaps[i - 1] > 1e-2)]
        assert [entry.top_logprobs[i][0] for i in clear] == [int(ranked[i]) for i in clear], pos
        np.testing.assert_allclose([v for _, v in entry.top_logprobs], row[ranked[:top]], atol=1e-3)

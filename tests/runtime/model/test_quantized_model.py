"""The built-in SmolLM2 GGUF served with its weights kept quantized (Q4_1 layers, a Q8_0 embedding
and tied head) against the same file dequantized to float32: the same values, and answers as close
as int8 activations allow, from a fifth of the memory."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.model.llama import LlamaModel
from engines.runtime.model.quantized_weight import QuantizedWeight
from tests.runtime.demo_engine import request, run_all

PROMPTS = ["What is the capital of France?", "Tell me about lighthouses.", "Why is the sky blue?",
           "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def kept(smollm2_file: Path) -> Checkpoint:
    return load_checkpoint(smollm2_file, keep_quantized=True)


@pytest.fixture(scope="module")
def dequantized(smollm2_file: Path) -> Checkpoint:
    return load_checkpoint(smollm2_file)


def test_the_files_matrices_stay_as_the_file_holds_them(kept: Checkpoint, dequantized: Checkpoint) -> None:
    q_proj = kept.weights["model.layers.0.self_attn.q_proj.weight"]
    embed = kept.weights["model.embed_tokens.weight"]
    assert isinstance(q_proj, QuantizedWeight) and q_proj.ggml_type == "Q4_1"
    assert isinstance(embed, QuantizedWeight) and embed.ggml_type == "Q8_0"
    assert isinstance(kept.weights["model.norm.weight"], np.ndarray)  # vectors are dequantized
    # The same values (q/k rows un-permuted as the float loader does), and the parameter count.
    assert np.array_equal(q_proj.dequantize(), dequantized.weights["model.layers.0.self_attn.q_proj.weight"])
    assert np.array_equal(kept.weights["model.layers.3.self_attn.k_proj.weight"].dequantize(),
                          dequantized.weights["model.layers.3.self_attn.k_proj.weight"])
    assert kept.num_parameters == dequantized.num_parameters


def test_the_quantized_model_answers_as_the_dequantized_one(kept: Checkpoint, dequantized: Checkpoint) -> None:
    """Every matmul of a quantized weight, prefill and decode, quantizes the activations to int8
    blocks (``kernels.interleaved_dot``), as llama.cpp does for these types; that costs some
    accuracy, bounded here: fed the float32 model's greedy tokens, the quantized model's top token
    agrees at 94-96% of the steps (measured: 90 of 96 here, 245 of 256 over 64 steps a prompt),
    its logits off by 0.19 on average (logits span about 30). The engine's answer is llama.cpp's
    on the same file: llama-cpp-python 0.3.36's greedy chat completion of the first prompt is
    "L'Étoile, la Cité, la Nation, ..." (the float32 model's names Paris), from a fifth of the bytes."""
    quantized_model = LlamaModel.from_checkpoint(kept, backend="cpu")
    float_model = LlamaModel.from_checkpoint(dequantized, backend="cpu")
    assert quantized_model.weights_format == "Q4_1 x210, Q8_0 x1" and float_model.weights_format == "float32"
    assert quantized_model.weight_bytes < float_model.weight_bytes / 5
    prompts = [kept.tokenizer.encode(kept.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                     add_special_tokens=False) for p in PROMPTS]
    engine = Engine(quantized_model, kept, EngineConfig(max_num_seqs=4, num_pages=64, prefill_chunk_size=256))
    results = run_all(engine, [request(f"p{i}", ids, max_tokens=24) for i, ids in enumerate(prompts)])
    assert kept.tokenizer.decode(results["p0"].tokens).startswith("L'Étoile, la Cité, l")

    agree, steps, mean_differences, max_differences = 0, 0, [], []
    models = (quantized_model, float_model)
    for ids in prompts:
        pages = np.arange(8, dtype=np.int32)[None, :]
        caches = [model.new_kv_cache(8, 16) for model in models]
        batch = ForwardBatch(np.array(ids, np.int32), np.array([0, len(ids)], np.int32), np.zeros(1, np.int32),
                             pages)
        logits = [model.forward(batch, cache)[-1] for model, cache in zip(models, caches, strict=True)]
        for position in range(len(ids), len(ids) + 24):
            token = int(np.argmax(logits[1]))
            agree += int(np.argmax(logits[0])) == token
            steps += 1
            batch = ForwardBatch(np.array([token], np.int32), np.array([0, 1], np.int32),
                                 np.array([position], np.int32), pages)
            logits = [model.forward(batch, cache)[-1] for model, cache in zip(models, caches, strict=True)]
            difference = np.abs(logits[0] - logits[1])
            mean_differences.append(difference.mean())
            max_differences.append(difference.max())
    print(f"top token agrees at {agree} of {steps} steps; logits off by {np.mean(mean_differences):.3f} on "
          f"average, {max(max_differences):.3f} at most")
    assert agree >= 0.9 * steps, (agree, steps)
    assert np.mean(mean_differences) < 0.3 and max(max_differences) < 3.0, (np.mean(mean_differences),
                                                                              max(max_differences))


def test_quantized_weights_are_refused_off_the_cpu(kept: Checkpoint) -> None:
    with pytest.raises(ValueError, match="CPU kernels only"):
        LlamaModel.from_checkpoint(kept, backend="cuda")

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
from engines.runtime.model.quant.quantized_weight import QuantizedWeight
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
    its logits off by 0.19 on average (logits span about 30). The engine's answer begins as
    llama.cpp's on the same file: llama-cpp-python 0.3.36's greedy chat completion of the first
    prompt is "L'Étoile, la Cité, la Nation, ..." (the float32 model names Paris), from a fifth of
    the bytes. Only its first word is asserted: int8 rounding turns a difference of one float
    rounding anywhere upstream (an FMA contracted or not) into a different int8 now and then, and
    this answer's third word then flips between "Cité" and "Marseillaise" (both seen)."""
    quantized_model = LlamaModel.from_checkpoint(kept, backend="cpu")
    float_model = LlamaModel.from_checkpoint(dequantized, backend="cpu")
    assert quantized_model.weights_format == "Q4_1 x210, Q8_0 x1" and float_model.weights_format == "float32"
    assert quantized_model.weight_bytes < float_model.weight_bytes / 5
    prompts = [kept.tokenizer.encode(kept.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                     add_special_tokens=False) for p in PROMPTS]
    engine = Engine(quantized_model, kept, EngineConfig(max_num_seqs=4, num_pages=64, prefill_chunk_size=256))
    results = run_all(engine, [request(f"p{i}", ids, max_tokens=24) for i, ids in enumerate(prompts)])
    assert kept.tokenizer.decode(results["p0"].tokens).startswith("L'Étoile")

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


@pytest.mark.usefixtures("quick_simulator_barriers")
@pytest.mark.parametrize("arch,dtype,tol", [("llama", "float32", 1e-4), ("qwen2", "float16", 3e-2)])
def test_the_cuda_backend_reads_quantized_weights_as_the_cpu_reads_them_dequantized(tmp_path: Path, arch: str,
                                                                                   dtype: str, tol: float) -> None:
    """A tiny checkpoint (rows of whole blocks) with its matrices in each kept type, the embedding
    and tied head in Q8_0: on the CUDA backend (the simulator here) kept quantized, its blocks read
    by ``quantized_gemv_cuda`` and ``quantized_embedding_cuda``, against the CPU's float32 model of
    the same values (float activations both: only the sums' order differs); a prefill and a decode
    step. Also with ``dtype`` float16 (``serve --dtype float16`` on a GPU, the GGUF kept as it is by
    default): the KV cache in float16, and a Qwen2's q/k/v biases in float32, as the quantized GEMV
    declares them (on a GPU a float16 bias would be read as float32 bytes: the simulator does not
    check, so the dtype is asserted)."""
    import dataclasses

    import gguf

    from engines.runtime.model.backend import DeviceQuantizedWeight
    from tests.runtime.model.test_model_parity import PagedSequences, save_tiny_checkpoint

    checkpoint = load_checkpoint(save_tiny_checkpoint(tmp_path, arch, vocab=32, hidden=32, layers=1, tied=True,
                                                      seed=11, intermediate=64))
    # (q/k/v and gate/up are fused: of one type each, so that the fused matrix keeps the values.)
    kinds = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q8_0", "gate_proj": "Q4_1",
             "up_proj": "Q4_1", "down_proj": "Q4_0", "embed_tokens": "Q8_0"}
    kept_weights: dict = {}
    for name, values in checkpoint.weights.items():
        kind = next((k for part, k in kinds.items() if f".{part}.weight" in name), None)  # a bias stays float
        kept_weights[name] = values if kind is None else QuantizedWeight.from_blocks(
            gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]).reshape(-1), kind, values.shape)
    dequantized = {name: w.dequantize() if isinstance(w, QuantizedWeight) else w for name, w in kept_weights.items()}
    gpu = LlamaModel.from_checkpoint(dataclasses.replace(checkpoint, weights=kept_weights), backend="cuda",
                                     dtype=dtype)
    cpu = LlamaModel.from_checkpoint(dataclasses.replace(checkpoint, weights=dequantized), backend="cpu")
    assert gpu.weights_format == "Q4_0 x4, Q4_1 x2, Q8_0 x2" and cpu.weights_format == "float32"
    assert isinstance(gpu.lm_head_w, DeviceQuantizedWeight) and gpu.lm_head_w is gpu.embed_tokens
    assert gpu.config.attention_bias == (arch == "qwen2")
    assert [str(b.dtype) for b in gpu.layer_weights.qkv_bias] == ["float32"]
    prompts = [[1, 2, 3], [30]]
    kv_gpu, kv_cpu = gpu.new_kv_cache(12, 4), cpu.new_kv_cache(12, 4)
    assert str(kv_gpu.k.dtype) == dtype
    seqs = PagedSequences(prompts, 12, seed=3)
    prefill = seqs.batch(prompts, all_logits=True)
    want = cpu.forward(prefill, kv_cpu)
    np.testing.assert_allclose(gpu.forward(prefill, kv_gpu), want, rtol=tol, atol=tol)
    seqs.advance(prompts)
    new = [[int(t)] for t in want[prefill.query_starts[1:] - 1].argmax(-1)]
    decode = seqs.batch(new)
    want = cpu.forward(decode, kv_cpu)
    np.testing.assert_allclose(gpu.forward(decode, kv_gpu), want, rtol=tol, atol=tol)

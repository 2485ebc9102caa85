"""load_checkpoint against checkpoints written by transformers' save_pretrained, and every way
a checkpoint folder can be broken."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engines.runtime.model.llama import LlamaModel  # noqa: E402
from engines.runtime.model.checkpoint import Checkpoint, expected_tensor_shapes, load_checkpoint  # noqa: E402
from engines.runtime.model.config import CheckpointError  # noqa: E402
from engines.runtime.model.demo_model import train_demo_tokenizer  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def _save_tokenizer(folder: Path, **config_extra: object) -> int:
    """Give ``folder`` a real tokenizer (the demo's BPE) the way transformers saves one."""
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_demo_tokenizer(), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        chat_template=CHAT_TEMPLATE, **config_extra,
    )
    tok.save_pretrained(folder)
    return len(tok)


def _save_model(folder: Path, arch: str, dtype: torch.dtype = torch.float32, shard: str | None = None,
                **config_extra: object) -> dict[str, np.ndarray]:
    """save_pretrained a tiny random model into ``folder``; return torch's weights as float32 numpy."""
    vocab = _save_tokenizer(folder)
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, **TINY, **config_extra)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(vocab_size=vocab, **TINY, **config_extra)
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(dtype)
    model.generation_config.eos_token_id = [1, 3]
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, _save_model(folder, "llama")


@pytest.fixture()
def broken(llama_dir: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Path:
    """A fresh copy of the good Llama checkpoint for a test to break."""
    folder = tmp_path / "broken"
    shutil.copytree(llama_dir[0], folder)
    return folder


def _assert_weights_equal(ckpt: Checkpoint, reference: dict[str, np.ndarray]) -> None:
    expected = expected_tensor_shapes(ckpt.config)
    assert set(ckpt.weights) == set(expected)
    for name, shape in expected.items():
        ours = ckpt.weights[name]
        assert ours.shape == shape, name
        np.testing.assert_array_equal(ours.astype(np.float32), reference[name], err_msg=name)


def test_llama_single_file(llama_dir: tuple[Path, dict[str, np.ndarray]]) -> None:
    folder, reference = llama_dir
    ckpt = load_checkpoint(str(folder))
    assert ckpt.name == folder.name and ckpt.path == folder.resolve()
    cfg = ckpt.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (
        "llama", 64, 2, 2, 16)
    assert not cfg.attention_bias
    _assert_weights_equal(ckpt, reference)
    assert all(w.dtype == np.float32 and w.flags.c_contiguous and w.flags.writeable for w in ckpt.weights.values())
    # generation_config's list first, then the tokenizer's eos (<|end_of_text|> is id 1, already there).
    assert ckpt.eos_token_ids == (1, 3)
    assert ckpt.chat_template == CHAT_TEMPLATE
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_qwen2_sharded_with_bias(tmp_path: Path) -> None:
    reference = _save_model(tmp_path, "qwen2", shard="60KB", tie_word_embeddings=False)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.model_type == "qwen2" and ckpt.config.attention_bias
    assert "model.layers.1.self_attn.k_proj.bias" in ckpt.weights
    assert "lm_head.weight" in ckpt.weights
    _assert_weights_equal(ckpt, reference)


def test_bfloat16_widened_to_float32(tmp_path: Path) -> None:
    reference = _save_model(tmp_path, "llama", dtype=torch.bfloat16)
    header_len = struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])[0]
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8:8 + header_len])
    assert header["model.norm.weight"]["dtype"] == "BF16"
    ckpt = load_checkpoint(tmp_path)
    assert all(w.dtype == np.float32 for w in ckpt.weights.values())
    _assert_weights_equal(ckpt, reference)


def test_float16_kept(tmp_path: Path) -> None:
    reference = _save_model(tmp_path, "llama", dtype=torch.float16)
    ckpt = load_checkpoint(tmp_path)
    assert all(w.dtype == np.float16 for w in ckpt.weights.values())
    _assert_weights_equal(ckpt, reference)


def test_tied_embeddings_need_no_lm_head(tmp_path: Path) -> None:
    reference = _save_model(tmp_path, "llama", tie_word_embeddings=True)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.tie_word_embeddings and "lm_head.weight" not in ckpt.weights
    _assert_weights_equal(ckpt, reference)
    # Both backends keep linear weights [out, in], the embedding table's layout: a tied head is
    # the table itself, one copy in memory.
    for backend in ("cpu", "cuda"):
        model = LlamaModel.from_checkpoint(ckpt, backend=backend)
        assert model.lm_head_w is model.embed_tokens, backend


def test_eos_ids_from_every_source(broken: Path) -> None:
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    config = json.loads((broken / "config.json").read_text())
    config["eos_token_id"] = [8, 7]
    (broken / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(broken).eos_token_ids == (7, 1)
    (broken / "generation_config.json").unlink()
    assert load_checkpoint(broken).eos_token_ids == (8, 7, 1)


# -- every broken checkpoint is one CheckpointError with a message that says what to fix ----------


def _error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    return str(info.value)


def _write_safetensors(file: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_missing_folder(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path / "nope")


def test_path_is_a_file(broken: Path) -> None:
    assert "neither a checkpoint folder (one that holds config.json) nor a GGUF file" in _error(broken / "config.json")


@pytest.mark.parametrize("filename", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(broken: Path, filename: str) -> None:
    (broken / filename).unlink()
    message = _error(broken)
    assert filename in message and str(broken) in message


def test_pytorch_bin_only(broken: Path) -> None:
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
    assert "convert them to safetensors" in _error(broken)


def test_missing_shard(tmp_path: Path) -> None:
    _save_model(tmp_path, "llama", shard="60KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    message = _error(tmp_path)
    assert shard.name in message and "model.safetensors.index.json" in message


@pytest.mark.parametrize("filename", ["config.json", "tokenizer_config.json", "generation_config.json"])
def test_invalid_json(broken: Path, filename: str) -> None:
    (broken / filename).write_text('{"model_type": "llama",')
    message = _error(broken)
    assert filename in message and "not valid JSON" in message


def test_invalid_tokenizer_json(broken: Path) -> None:
    (broken / "tokenizer.json").write_text('{"model": 3}')
    assert "tokenizer.json" in _error(broken)


def test_unsupported_model_type(broken: Path) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "gpt2"
    (broken / "config.json").write_text(json.dumps(config))
    message = _error(broken)
    assert "'gpt2'" in message and "llama" in message


def test_shape_mismatch(broken: Path) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 128
    (broken / "config.json").write_text(json.dumps(config))
    message = _error(broken)
    assert "model.layers.0.mlp.gate_proj.weight" in message
    assert "[96, 64]" in message and "[128, 64]" in message


def test_missing_tensor(broken: Path, llama_dir: tuple[Path, dict[str, np.ndarray]]) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the file holds layers 0 and 1 only
    (broken / "config.json").write_text(json.dumps(config))
    message = _error(broken)
    assert "model.layers.2.input_layernorm.weight" in message and "3 layers" in message


def test_tokenizer_larger_than_vocab(broken: Path) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["vocab_size"] = 100
    (broken / "config.json").write_text(json.dumps(config))
    assert "tokenizer" in _error(broken)


@pytest.mark.parametrize("dtype", ["I8", "F8_E4M3", "U8"])
def test_unsupported_dtype(broken: Path, dtype: str) -> None:
    ckpt = load_checkpoint(broken)
    header: dict = {}
    data = b""
    for name, value in sorted(ckpt.weights.items()):
        raw = value.astype(np.int8).tobytes() if name == "model.norm.weight" else value.tobytes()
        header[name] = {"dtype": dtype if name == "model.norm.weight" else "F32", "shape": list(value.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    _write_safetensors(broken / "model.safetensors", header, data)
    message = _error(broken)
    assert "model.norm.weight" in message and dtype in message and "cannot run" in message


def test_truncated_safetensors(broken: Path) -> None:
    file = broken / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    message = _error(broken)
    assert "corrupt or truncated" in message and "re-download" in message


@pytest.mark.parametrize("payload", [b"", b"\x01\x02", struct.pack("<Q", 10**12) + b"{}",
                                     struct.pack("<Q", 5) + b"nope!", struct.pack("<Q", 2) + b"[]"])
def test_garbage_safetensors(broken: Path, payload: bytes) -> None:
    (broken / "model.safetensors").write_bytes(payload)
    assert "model.safetensors" in _error(broken)


def test_bad_offsets(broken: Path) -> None:
    shape = [64]
    header = {name: {"dtype": "F32", "shape": list(s), "data_offsets": [0, int(np.prod(s)) * 4]}
              for name, s in expected_tensor_shapes(load_checkpoint(broken).config).items()}
    header["model.norm.weight"] = {"dtype": "F32", "shape": shape, "data_offsets": [0, 12]}
    _write_safetensors(broken / "model.safetensors", header, b"\0" * 4 * 10**6)
    message = _error(broken)
    assert "model.norm.weight" in message and "corrupt" in message


def test_bad_shard_index(broken: Path) -> None:
    (broken / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in _error(broken)


@pytest.mark.parametrize("field,value", [("hidden_size", "wide"), ("num_attention_heads", 0),
                                         ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                         ("num_key_value_heads", 3)])
def test_invalid_config_values(broken: Path, field: str, value: object) -> None:
    config = json.loads((broken / "config.json").read_text())
    config[field] = value
    (broken / "config.json").write_text(json.dumps(config))
    _error(broken)


def test_chat_template_files(broken: Path) -> None:
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    (broken / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert load_checkpoint(broken).chat_template == "from json"
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "from config"}))
    assert load_checkpoint(broken).chat_template == "from config"
    (broken / "chat_template.jinja").write_text("from jinja")
    assert load_checkpoint(broken).chat_template == "from jinja"

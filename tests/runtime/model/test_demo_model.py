"""The demo checkpoint: deterministic, cached atomically, loadable by us and by transformers."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.demo_model import DEMO_VERSION, IM_END, EOS_TOKEN, demo_checkpoint_path

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_checkpoint_path(tmp_path_factory.mktemp("cache"))


def test_two_builds_are_byte_identical(demo_dir: Path, tmp_path: Path) -> None:
    # The second build runs in another process with another hash seed: the tokenizer trainer's
    # and Python's hash tables must not leak iteration order into the files.
    code = "import sys; from engines.runtime.model.demo_model import demo_checkpoint_path as p; print(p(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[3], check=True)
    other = Path(out.stdout.strip())
    assert other != demo_dir and other.name == demo_dir.name == f"demo-{DEMO_VERSION}"
    assert sorted(_hashes(other)) == sorted(FILES)
    assert _hashes(other) == _hashes(demo_dir)


def test_demo_loads_with_the_promised_shape(demo_dir: Path) -> None:
    ckpt = load_checkpoint(demo_dir)
    cfg = ckpt.config
    assert ckpt.name == "demo"
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == ("llama", 512, 8, 8, 4, 64, 1408)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (10000.0, 2048)
    assert cfg.vocab_size == ckpt.tokenizer.vocab_size and 4096 <= cfg.vocab_size <= 8192
    assert 20e6 <= ckpt.num_parameters <= 30e6
    tok = ckpt.tokenizer
    assert ckpt.eos_token_ids == (tok.token_to_id(IM_END), tok.token_to_id(EOS_TOKEN))
    for name, w in ckpt.weights.items():
        assert w.dtype == np.float32 and np.isfinite(w).all(), name
        if name.endswith("norm.weight"):
            assert (w == 1).all()
        else:
            assert 0.018 < float(w.std()) < 0.022, name


def test_demo_tokenizer_and_chat_template(demo_dir: Path) -> None:
    tok = load_checkpoint(demo_dir).tokenizer
    text = "Serving a model: the KV cache holds 16 tokens per page. Café 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    # A trained BPE, not bytes: ordinary English takes well under one token per character.
    assert len(ids) < len(text) / 2.5
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [tok.bos_token_id, tok.token_to_id("<|im_start|>")] and ids.count(tok.bos_token_id) == 1


def test_cached_build_is_reused(demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()}
    assert demo_checkpoint_path(demo_dir.parent) == demo_dir
    assert {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()} == before
    monkeypatch.setenv("ENGINES_CACHE_DIR", str(demo_dir.parent))
    assert demo_checkpoint_path() == demo_dir


def test_concurrent_builds_leave_one_complete_checkpoint(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(demo_checkpoint_path(tmp_path))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    # Only the finished checkpoint remains: no half-written staging folders.
    assert [p.name for p in tmp_path.iterdir()] == [f"demo-{DEMO_VERSION}"]
    assert sorted(p.name for p in results[0].iterdir()) == sorted(FILES)
    load_checkpoint(results[0])


def test_abandoned_staging_folders_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f".demo-{DEMO_VERSION}-build-crashed"
    fresh = tmp_path / f".demo-{DEMO_VERSION}-build-running"
    stale.mkdir()
    fresh.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    demo_checkpoint_path(tmp_path)
    assert not stale.exists() and fresh.exists()  # a recent one may belong to a live build


def test_transformers_reads_the_same_model(demo_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ckpt = load_checkpoint(demo_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    state = model.state_dict()
    for name, w in ckpt.weights.items():
        np.testing.assert_array_equal(state[name].numpy(), w, err_msg=name)
    hf_tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    text = "The scheduler adds new requests at every step 🙂"
    assert hf_tok.encode(text) == ckpt.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ckpt.tokenizer.apply_chat_template(messages)
    with torch.no_grad():
        logits = model(torch.tensor([ckpt.tokenizer.encode(text)])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == ckpt.config.vocab_size
    # Random weights, but not degenerate: the scores still vary across the vocabulary.
    assert float(logits[0, -1].std()) > 0.05

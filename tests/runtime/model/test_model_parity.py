"""The model against Hugging Face transformers on tiny random checkpoints, and the CUDA backend
(simulator) against the CPU backend.

Checkpoints are made by transformers itself (``save_pretrained``, safetensors) and loaded
through our loader, so config parsing, weight fusion and the kernels are all on the path.
Every parameter is randomised (transformers initialises biases to zero and norms to one,
which would hide a missing bias or norm weight).

The float32 path: a Hugging Face folder's weights are floats whatever ``--weights-dtype`` says (it
concerns GGUF files); the kept-quantized path is tests/runtime/model/test_quantized_model.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.config import CheckpointError
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.model.llama import LlamaModel
from engines.runtime.model.kernels import run_attention

pytestmark = pytest.mark.usefixtures("quick_simulator_barriers")

PAGE_SIZE = 4
DECODE_STEPS = 8


def save_tiny_checkpoint(folder: Path, arch: str, vocab: int, hidden: int, layers: int, tied: bool,
                         seed: int, intermediate: int | None = None) -> Path:
    """A random ``arch`` checkpoint (GQA: 4 q heads, 2 kv heads, head_dim hidden/4; MLP width
    ``intermediate``, by default 1.5x ``hidden``) plus a word-level tokenizer."""
    intermediate = hidden * 3 // 2 if intermediate is None else intermediate
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=5000.0, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1e6, **common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + 0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    return folder


@dataclass
class Reference:
    """A tiny checkpoint, the transformers model that made it, and our model of it."""

    path: Path
    hf: torch.nn.Module
    ours: LlamaModel

    def hf_logits(self, tokens: list[int]) -> np.ndarray:
        """Logits of every position of ``tokens`` (one sequence, no cache)."""
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0].double().numpy()


CASES = {
    "llama-gqa": dict(arch="llama", tied=False),
    "llama-tied": dict(arch="llama", tied=True),
    "qwen2-bias": dict(arch="qwen2", tied=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    torch.manual_seed(0)
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), vocab=96, hidden=64, layers=2,
                                  seed=len(request.param), **CASES[request.param])
    hf_class = LlamaForCausalLM if CASES[request.param]["arch"] == "llama" else Qwen2ForCausalLM
    hf = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
    return Reference(folder, hf, LlamaModel.from_checkpoint(load_checkpoint(folder), backend="cpu"))


class PagedSequences:
    """Sequences of a ragged batch with pages handed out from a shuffled pool, as an engine's
    page allocator would leave them: not contiguous, not in order."""

    def __init__(self, prompts: list[list[int]], num_pages: int, seed: int = 0) -> None:
        self.tokens = [list(p) for p in prompts]
        self.cached = [0] * len(prompts)
        self.free = list(np.random.default_rng(seed).permutation(num_pages))
        self.pages: list[list[int]] = [[] for _ in prompts]

    def batch(self, new: list[list[int]], all_logits: bool = False,
              seq_all_logits: list[bool] | None = None) -> ForwardBatch:
        """The step feeding ``new[i]`` to sequence i (pages reserved for them first)."""
        for i, chunk in enumerate(new):
            while len(self.pages[i]) * PAGE_SIZE < self.cached[i] + len(chunk):
                self.pages[i].append(self.free.pop())
        width = max(len(p) for p in self.pages) + 1  # -1 padding past every sequence's pages
        table = np.full((len(new), width), -1, np.int32)
        for i, pages in enumerate(self.pages):
            table[i, :len(pages)] = pages
        lens = [len(c) for c in new]
        return ForwardBatch(
            token_ids=np.array([t for c in new for t in c], np.int32),
            query_starts=np.cumsum([0] + lens).astype(np.int32),
            cached_lens=np.array(self.cached, np.int32),
            page_table=table,
            all_logits=all_logits,
            seq_all_logits=None if seq_all_logits is None else np.array(seq_all_logits, np.bool_),
        )

    def advance(self, new: list[list[int]]) -> None:
        """Record that the step with ``new`` ran (its tokens are now cached)."""
        for i, chunk in enumerate(new):
            self.cached[i] += len(chunk)


PROMPTS = [[5, 17, 3, 88, 41], list(range(20, 42)), [9, 9, 1]]  # 5, 22 and 3 tokens: several pages each


def test_prefill_and_greedy_decode_match_transformers(reference: Reference) -> None:
    model = reference.ours
    kv = model.new_kv_cache(num_pages=40, page_size=PAGE_SIZE)
    seqs = PagedSequences(PROMPTS, kv.num_pages)
    new = [list(p) for p in PROMPTS]
    for step in range(DECODE_STEPS + 1):
        logits = model.forward(seqs.batch(new), kv)
        seqs.advance(new)
        assert logits.shape == (len(PROMPTS), model.config.vocab_size) and logits.dtype == np.float32
        for i, context in enumerate(seqs.tokens):
            want = reference.hf_logits(context)[-1]
            np.testing.assert_allclose(logits[i], want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}, sequence {i}")
            assert int(np.argmax(logits[i])) == int(np.argmax(want)), f"greedy token differs at step {step}"
        new = [[int(np.argmax(row))] for row in logits]
        for context, token in zip(seqs.tokens, new, strict=True):
            context.extend(token)


def test_forward_greedy_matches_forward(reference: Reference) -> None:
    model = reference.ours
    kv_a, kv_b = model.new_kv_cache(40, PAGE_SIZE), model.new_kv_cache(40, PAGE_SIZE)
    seqs = PagedSequences(PROMPTS, 40, seed=1)
    new = [list(p) for p in PROMPTS]
    for _ in range(3):
        batch = seqs.batch(new)
        ids = model.forward_greedy(batch, kv_a)
        logits = model.forward(batch, kv_b)
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, logits.argmax(-1))
        seqs.advance(new)
        new = [[int(t)] for t in ids]


def test_all_logits_and_chunked_prefill(reference: Reference) -> None:
    model = reference.ours
    prompt = PROMPTS[1]
    want = reference.hf_logits(prompt)

    whole = PagedSequences([prompt], 40, seed=2)
    kv = model.new_kv_cache(40, PAGE_SIZE)
    one_chunk = model.forward(whole.batch([prompt], all_logits=True), kv)
    assert one_chunk.shape == (len(prompt), model.config.vocab_size)
    np.testing.assert_allclose(one_chunk, want, rtol=1e-4, atol=1e-4)

    # The same prompt in two chunks; the split falls inside a page.
    split = 9
    chunked = PagedSequences([prompt], 40, seed=3)
    kv = model.new_kv_cache(40, PAGE_SIZE)
    first = model.forward(chunked.batch([prompt[:split]], all_logits=True), kv)
    chunked.advance([prompt[:split]])
    second = model.forward(chunked.batch([prompt[split:]], all_logits=True), kv)
    np.testing.assert_allclose(np.concatenate([first, second]), one_chunk, rtol=1e-5, atol=1e-5)

    # Mixed step: one sequence's second chunk next to another's decode token.
    mixed = PagedSequences([prompt, PROMPTS[0]], 40, seed=4)
    kv = model.new_kv_cache(40, PAGE_SIZE)
    model.forward(mixed.batch([prompt[:split], PROMPTS[0]]), kv)
    mixed.advance([prompt[:split], PROMPTS[0]])
    last = model.forward(mixed.batch([prompt[split:], [7]]), kv)
    np.testing.assert_allclose(last[0], want[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(last[1], reference.hf_logits(PROMPTS[0] + [7])[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled_step", [True, False])
def test_seq_all_logits_gives_every_row_of_the_flagged_sequences(reference: Reference, compiled_step: bool) -> None:
    """A prefill chunk whose every row returns logits (what prompt logprobs read) beside a decode
    and another chunk that return their last row alone: each row as transformers computes it,
    on the small-step path and kernel by kernel (no compiled step)."""
    model = reference.ours
    cpu_step = model.cpu_step
    if not compiled_step:
        model.cpu_step = None
    try:
        prompt, other = PROMPTS[1], PROMPTS[0]
        split = 9
        seqs = PagedSequences([prompt, other, PROMPTS[2]], 40, seed=8)
        kv = model.new_kv_cache(40, PAGE_SIZE)
        first = [prompt[:split], other, PROMPTS[2]]
        head = model.forward(seqs.batch(first, seq_all_logits=[True, False, True]), kv)
        seqs.advance(first)
        rest = [prompt[split:], [7], [4, 4]]
        tail = model.forward(seqs.batch(rest, seq_all_logits=[True, False, False]), kv)
    finally:
        model.cpu_step = cpu_step
    want = reference.hf_logits(prompt)
    assert head.shape == (split + 1 + len(PROMPTS[2]), model.config.vocab_size)
    np.testing.assert_allclose(head[:split], want[:split], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(head[split], reference.hf_logits(other)[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(head[split + 1:], reference.hf_logits(PROMPTS[2]), rtol=1e-4, atol=1e-4)
    assert tail.shape == (len(prompt) - split + 2, model.config.vocab_size)
    np.testing.assert_allclose(tail[:-2], want[split:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tail[-2], reference.hf_logits(other + [7])[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tail[-1], reference.hf_logits(PROMPTS[2] + [4, 4])[-1], rtol=1e-4, atol=1e-4)


def test_long_prefill_runs_take_the_blas_path_and_still_match_transformers(reference: Reference) -> None:
    """Runs of ``run_attention.MIN_RUN`` tokens or more (whole, and as a second chunk beside a
    decode) go through the CPU backend's BLAS attention."""
    model = reference.ours
    prompt = [(7 * i) % 90 + 3 for i in range(120)]
    assert len(prompt) // 2 >= run_attention.MIN_RUN
    want = reference.hf_logits(prompt)
    whole = PagedSequences([prompt], 40, seed=6)
    kv = model.new_kv_cache(40, PAGE_SIZE)
    np.testing.assert_allclose(model.forward(whole.batch([prompt], all_logits=True), kv), want, rtol=1e-4, atol=1e-4)

    mixed = PagedSequences([prompt, PROMPTS[0]], 48, seed=7)
    kv = model.new_kv_cache(48, PAGE_SIZE)
    model.forward(mixed.batch([prompt[:60], PROMPTS[0]]), kv)
    mixed.advance([prompt[:60], PROMPTS[0]])
    last = model.forward(mixed.batch([prompt[60:], [7]], all_logits=True), kv)
    np.testing.assert_allclose(last[:60], want[60:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(last[60], reference.hf_logits(PROMPTS[0] + [7])[-1], rtol=1e-4, atol=1e-4)


def test_shape_mismatch_names_the_tensor(reference: Reference) -> None:
    ckpt = load_checkpoint(reference.path)
    weights = dict(ckpt.weights)
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name][:, :-1]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel(ckpt.config, weights, backend="cpu")
    del weights[name]
    with pytest.raises(CheckpointError, match=r"lack tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel(ckpt.config, weights, backend="cpu")


def test_bad_batches_are_refused(reference: Reference) -> None:
    model = reference.ours
    kv = model.new_kv_cache(8, PAGE_SIZE)
    ok = dict(token_ids=np.array([1, 2, 3], np.int32), query_starts=np.array([0, 3], np.int32),
              cached_lens=np.array([0], np.int32), page_table=np.array([[2]], np.int32))
    model.forward(ForwardBatch(**ok), kv)
    for field, value, message in [
        ("page_table", np.array([[-1]], np.int32), "page ids"),
        ("page_table", np.array([[8]], np.int32), "page ids"),
        ("cached_lens", np.array([2], np.int32), "fewer pages"),
        ("token_ids", np.array([1, 2, 96], np.int32), "token ids"),
        ("query_starts", np.array([0, 2], np.int32), "query_starts"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.forward(ForwardBatch(**{**ok, field: value}), kv)


@pytest.fixture(scope="module")
def smallest_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiniest checkpoint with every feature (bias, GQA, separate head): the simulator runs
    one Python thread per CUDA thread and costs about a microsecond per multiply-add."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("smallest"), "qwen2", vocab=32, hidden=16, layers=2,
                                tied=False, seed=7)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 3e-2)])
def test_cuda_backend_matches_cpu(smallest_qwen2: Path, dtype: str, tol: float) -> None:
    ckpt = load_checkpoint(smallest_qwen2)
    cpu = LlamaModel.from_checkpoint(ckpt, backend="cpu")
    gpu = LlamaModel.from_checkpoint(ckpt, backend="cuda", dtype=dtype)
    assert gpu.backend_name == "cuda" and gpu.dtype == dtype
    prompts = [[1, 2, 3, 4], [6, 7], [9]]
    kv_cpu, kv_gpu = cpu.new_kv_cache(8, PAGE_SIZE), gpu.new_kv_cache(8, PAGE_SIZE)
    seqs = PagedSequences(prompts, 8, seed=5)
    # Prefill with all logits (7 rows: the tiled matmul), a decode step (3 rows: GEMV), then
    # a greedy decode step (argmax on the device).
    prefill = seqs.batch(prompts, all_logits=True)
    want = cpu.forward(prefill, kv_cpu)
    np.testing.assert_allclose(gpu.forward(prefill, kv_gpu), want, rtol=tol, atol=tol)
    seqs.advance(prompts)
    new = [[int(t)] for t in want[prefill.query_starts[1:] - 1].argmax(-1)]
    decode = seqs.batch(new)
    want = cpu.forward(decode, kv_cpu)
    np.testing.assert_allclose(gpu.forward(decode, kv_gpu), want, rtol=tol, atol=tol)
    seqs.advance(new)
    new = [[int(t)] for t in want.argmax(-1)]
    greedy = seqs.batch(new)
    np.testing.assert_array_equal(gpu.forward_greedy(greedy, kv_gpu), cpu.forward(greedy, kv_cpu).argmax(-1))
    seqs.advance(new)
    # Two tokens each, every row of the first sequence's (prompt logprobs), the others' last.
    new = [[int(t), 5] for t in want.argmax(-1)]
    mixed = seqs.batch(new, seq_all_logits=[True, False, False])
    want = cpu.forward(mixed, kv_cpu)
    assert want.shape == (4, cpu.config.vocab_size)
    np.testing.assert_allclose(gpu.forward(mixed, kv_gpu), want, rtol=tol, atol=tol)

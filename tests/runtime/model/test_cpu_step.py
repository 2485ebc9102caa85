"""The compiled CPU step (``cpu_step``) against the per-kernel path it replaces: the same logits,
greedy ids and KV cache (to float32 rounding) on every model shape of the parity tests, which
steps it takes, its cache key, and a fresh process that loads it from numba's cache."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from engines.runtime.model import cpu_step, step_inputs, thread_team
from engines.runtime.model.kernels import attention, matmul, run_attention
from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.model.llama import LlamaModel
from tests.runtime.model.test_model_parity import (  # noqa: F401 - fixture
    PagedSequences, Reference, reference, save_tiny_checkpoint)

REPO = Path(__file__).resolve().parents[3]


class CountedStep:
    """``cpu_step.decode_step_cpu`` that counts its calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        compiled = cpu_step.decode_step_cpu

        def counted(*args: Any) -> bool:
            self.calls += 1
            return compiled(*args)
        monkeypatch.setattr(cpu_step, "decode_step_cpu", counted)


class TeamSteps:
    """The model's one-token steps run as a thread team, and teams called off, from now on (any
    wait after an earlier call-off cleared: the next step tries a team)."""

    def __init__(self, model: LlamaModel) -> None:
        self.step = model.cpu_step
        self.step.team_state[thread_team.SKIPS_LEFT] = self.step.team_state[thread_team.BACKOFF] = 0
        self.before = self.step.team_steps

    def ran(self) -> tuple[int, int]:
        now = self.step.team_steps
        return now[0] - self.before[0], now[1] - self.before[1]


#: Tries of :func:`run_both_as_team`.
TEAM_TRIES = 5


def run_both_as_team(model: LlamaModel, steps: list[tuple[list[list[int]], str]], **kwargs: Any) -> tuple[int, int]:
    """:func:`run_both` until no rendezvous was called off in a try (by design when a member's thread
    does not start within the wait: a stalled vCPU under a loaded suite; the step then runs kernel by
    kernel), up to ``TEAM_TRIES``: the one-token steps that ran as a team in that try, and the tries."""
    for tries in range(1, TEAM_TRIES + 1):
        team = TeamSteps(model)
        run_both(model, steps, **kwargs)
        ran, called_off = team.ran()
        if not called_off:
            return ran, tries
    raise AssertionError(f"a rendezvous was called off in each of {TEAM_TRIES} tries")


def one_token_steps(vocab: int, seed: int, prompt: int, count: int) -> list[tuple[list[list[int]], str]]:
    """A prompt of ``prompt`` random tokens, then ``count`` steps of one token, logits and greedy in turn."""
    rng = np.random.default_rng(seed)
    steps = [([rng.integers(0, vocab, prompt).tolist()], "logits")]
    return steps + [([rng.integers(0, vocab, 1).tolist()], "greedy" if i % 2 else "logits") for i in range(count)]


def run_both(model: LlamaModel, steps: list[tuple[list[list[int]], str]], num_pages: int = 40) -> None:
    """Feed ``steps`` (each sequence's new tokens, and "logits", "greedy" or "all") to two KV
    caches, one through the compiled step and one kernel by kernel: the same greedy ids, logits
    and, at the end, caches. Not bit for bit: LLVM optimises the kernels again inside the step and
    sums some reassociated reductions in another order (differences ~1e-6 of a logit after one
    step, ~1e-5 after ten)."""
    prompts = [chunk for chunk in steps[0][0]]
    compiled_seqs, plain_seqs = PagedSequences(prompts, num_pages), PagedSequences(prompts, num_pages)
    compiled_kv, plain_kv = model.new_kv_cache(num_pages, 4), model.new_kv_cache(num_pages, 4)
    for kv in (compiled_kv, plain_kv):  # allocated uninitialised: slots no step writes must agree too
        kv.k[...] = 0
        kv.v[...] = 0
    step_runner = model.cpu_step
    for new, kind in steps:
        results = []
        for seqs, kv, runner in ((compiled_seqs, compiled_kv, step_runner), (plain_seqs, plain_kv, None)):
            model.cpu_step = runner
            try:
                batch = seqs.batch(new, all_logits=kind == "all")
                results.append(model.forward_greedy(batch, kv) if kind == "greedy" else model.forward(batch, kv))
            finally:
                model.cpu_step = step_runner
            seqs.advance(new)
        assert results[0].dtype == results[1].dtype and results[0].shape == results[1].shape
        if kind == "greedy":
            np.testing.assert_array_equal(results[0], results[1], err_msg=f"greedy step {new}")
        else:
            np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-4, err_msg=f"{kind} step {new}")
    np.testing.assert_allclose(compiled_kv.k, plain_kv.k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(compiled_kv.v, plain_kv.v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threaded_attention", [False, True], ids=["serial-attention", "split-attention"])
def test_compiled_step_equals_the_per_kernel_path(reference: Reference, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                  threaded_attention: bool) -> None:
    model = reference.ours
    if threaded_attention:  # every step's attention on numba's threads, heads split
        monkeypatch.setattr(model.cpu_step.backend, "parallel_attention_min_work", 0)
    counted = CountedStep(monkeypatch)
    rng = np.random.default_rng(7)
    vocab = model.config.vocab_size

    def tokens(*lens: int) -> list[list[int]]:
        return [rng.integers(0, vocab, n).tolist() for n in lens]

    steps = [(tokens(5, 22, 3), "logits")]  # a 30-token prefill: the compiled step too
    steps += [(tokens(1, 1, 1), "greedy" if i % 2 else "logits") for i in range(6)]
    steps += [(tokens(3, 1, 4), "all"), (tokens(2, 2, 2), "greedy"), (tokens(1, 1, 1), "all")]
    run_both(model, steps)
    assert counted.calls == len(steps)


def test_compiled_steps_of_one_token_equal_the_per_kernel_path(reference: Reference,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-1 decode: the steps where the compiled step fuses the MLP's gate/up projection and
    SwiGLU (``matmul_swiglu_cpu``; the parity models' intermediate size, 96, is even), against
    the per-kernel path's matmul then ``silu_mul``."""
    model = reference.ours
    assert model.layer_weights.gate_up_w.shape[1] % 4 == 0  # whole (gate, up) pairs: the fused kernel runs
    counted = CountedStep(monkeypatch)
    steps = one_token_steps(model.config.vocab_size, seed=11, prompt=9, count=8)
    ran, tries = run_both_as_team(model, steps)
    assert counted.calls == tries * len(steps)
    assert ran == 8  # each step of one token ran as a thread team


def test_compiled_steps_of_one_token_over_long_contexts_split_its_keys(reference: Reference,  # noqa: F811
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 1 on two threads with contexts of eight whole pages and more: attention cuts the
    token's keys in halves and merges them by their maxima and sums (``cpu_attention_splits``
    says (1, 2) for every step here), compiled step against the per-kernel path."""
    model = reference.ours
    backend = model.cpu_step.backend
    monkeypatch.setattr(backend, "parallel_attention_min_work", 0)
    monkeypatch.setattr(backend, "numba_threads", 2)
    counted = CountedStep(monkeypatch)
    steps = one_token_steps(model.config.vocab_size, seed=17, prompt=32, count=6)  # the most the step takes
    config = model.config
    for position in range(32, 38):  # the decode steps' positions, pages of 4
        assert attention.cpu_attention_splits(np.array([position], np.int32), config.num_attention_heads,
                                              config.num_key_value_heads, 4, config.head_dim, 0, 2) == (1, 2)
    ran, tries = run_both_as_team(model, steps)
    assert counted.calls == tries * len(steps)
    assert ran == 6


@pytest.mark.parametrize("threads", [1, 2])
def test_one_token_steps_of_a_team_of_each_size_equal_the_per_kernel_path(reference: Reference,  # noqa: F811
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        threads: int) -> None:
    """The thread team at one member and at two, heads cut (the team cuts the heads of a small
    attention that the omp step runs on one thread)."""
    if numba.get_num_threads() < threads:
        pytest.fail(f"numba has {numba.get_num_threads()} threads; this test needs {threads}")
    model = reference.ours
    monkeypatch.setattr(model.cpu_step.backend, "numba_threads", threads)
    steps = one_token_steps(model.config.vocab_size, seed=19, prompt=6, count=5)
    assert run_both_as_team(model, steps)[0] == 5


def test_a_team_step_with_many_chunks_a_run_and_a_vocabulary_of_4k_plus_2_equals_the_per_kernel_path(
        tmp_path: Path) -> None:
    """Weights big enough that each member's run of a matmul is many chunks (the LM head: 1,024
    blocks of four 1 KB rows, 32 chunks), and a vocabulary whose last two columns the blocks leave
    to the last member (``matmul.row_last_columns``)."""
    folder = save_tiny_checkpoint(tmp_path, arch="llama", vocab=4098, hidden=256, layers=2, tied=False, seed=7,
                                  intermediate=512)
    model = LlamaModel.from_checkpoint(load_checkpoint(folder), backend="cpu")
    assert run_both_as_team(model, one_token_steps(4098, seed=37, prompt=7, count=6))[0] == 6


def test_a_team_that_cannot_meet_is_called_off_and_its_steps_run_without_one(
        reference: Reference, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """numba's pool cut to one thread under a backend that counted two: both members of the team
    land on one thread. The first step's team is called off before any work, the step runs the
    omp way (the same results as the per-kernel path), and the next 64 steps do not try a team;
    with the pool whole again, the step after them runs as a team."""
    model = reference.ours
    monkeypatch.setattr(model.cpu_step, "team_state", thread_team.new_state(2))
    monkeypatch.setattr(model.cpu_step.backend, "numba_threads", 2)
    steps = one_token_steps(model.config.vocab_size, seed=23, prompt=5, count=4)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        run_both(model, steps)
    finally:
        numba.set_num_threads(threads)
    assert model.cpu_step.team_steps == (0, 1) and not model.cpu_step.team
    run_both(model, one_token_steps(model.config.vocab_size, seed=31, prompt=2, count=62))  # 3 + 61 skipped
    assert model.cpu_step.team_steps == (1, 1) and model.cpu_step.team


def test_a_team_switched_off_runs_its_steps_forking_per_kernel(reference: Reference,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model = reference.ours
    monkeypatch.setattr(model.cpu_step, "team_state", thread_team.new_state(2))
    model.cpu_step.team = False
    steps = one_token_steps(model.config.vocab_size, seed=29, prompt=5, count=3)
    run_both(model, steps)
    assert model.cpu_step.team_steps == (0, 0) and not model.cpu_step.team
    model.cpu_step.team = True
    run_both(model, steps[:1] + steps[1:2])
    assert model.cpu_step.team_steps == (1, 0) and model.cpu_step.team


def test_one_token_steps_of_an_odd_intermediate_size_run_matmul_then_silu_mul(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An odd intermediate size leaves no whole (gate, up) pairs in the fused kernel's blocks: the
    compiled step keeps the matmul then ``silu_mul`` there (the fused kernel would refuse)."""
    folder = save_tiny_checkpoint(tmp_path, arch="llama", vocab=96, hidden=64, layers=2, tied=False, seed=5,
                                  intermediate=97)
    model = LlamaModel.from_checkpoint(load_checkpoint(folder), backend="cpu")
    assert model.layer_weights.gate_up_w.shape[1] % 4 == 2
    counted = CountedStep(monkeypatch)
    rng = np.random.default_rng(13)
    steps = [([rng.integers(0, 96, 5).tolist()], "logits")]
    steps += [([rng.integers(0, 96, 1).tolist()], "greedy" if i % 2 else "logits") for i in range(4)]
    run_both(model, steps)
    assert counted.calls == len(steps)


def test_steps_past_the_rows_kernel_run_kernel_by_kernel(reference: Reference,  # noqa: F811
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = reference.ours
    counted = CountedStep(monkeypatch)
    rng = np.random.default_rng(3)
    long_prompt = rng.integers(0, model.config.vocab_size, 40).tolist()  # past CPU_ROWS_KERNEL_MAX_ROWS
    seqs = PagedSequences([long_prompt], 20)
    kv = model.new_kv_cache(20, 4)
    model.forward(seqs.batch([long_prompt]), kv)
    assert counted.calls == 0
    seqs.advance([long_prompt])
    model.forward(seqs.batch([[1]]), kv)
    assert counted.calls == 1


def test_the_compiled_step_never_meets_a_blas_attention_run() -> None:
    """The compiled step takes up to ``CPU_ROWS_KERNEL_MAX_ROWS`` tokens without asking attention's
    split, because no such step holds a prefill run long enough for BLAS attention."""
    assert matmul.CPU_ROWS_KERNEL_MAX_ROWS < run_attention.MIN_RUN
    positions = np.arange(matmul.CPU_ROWS_KERNEL_MAX_ROWS, dtype=np.int32)
    split = run_attention.split_step(positions, np.zeros_like(positions))
    assert split.runs == () and split.other_rows is None


def _invalid_small_batches(model: LlamaModel, kv: Any) -> dict[str, ForwardBatch]:
    """Batches of a few tokens, each wrong in one way, for ``model`` and ``kv`` (pages of 4)."""
    def batch(**change: Any) -> ForwardBatch:
        base = ForwardBatch(token_ids=np.array([5, 6, 7, 8], np.int32), query_starts=np.array([0, 3, 4], np.int32),
                            cached_lens=np.array([0, 6], np.int32), page_table=np.array([[0, -1], [1, 2]], np.int32))
        return replace(base, **{k: np.asarray(v, np.int32) for k, v in change.items()})

    vocab, positions = model.config.vocab_size, model.config.max_position_embeddings
    return {
        "starts short of the tokens": batch(query_starts=[0, 3, 3]),
        "a sequence with no token": batch(query_starts=[0, 0, 4]),
        "negative cached": batch(cached_lens=[0, -1]),
        "token past the vocab": batch(token_ids=[5, 6, 7, vocab]),
        "position past the model's": batch(cached_lens=[0, positions]),
        "table too narrow": batch(cached_lens=[0, 8]),
        "negative page where a token lives": batch(page_table=[[0, -1], [1, -1]]),
        "page past the cache": batch(page_table=[[kv.num_pages, -1], [1, 2]]),
        "more sequences than tokens": batch(query_starts=[0, 1, 2, 3, 4, 4, 4], cached_lens=[0] * 6,
                                            page_table=[[0]] * 6),
    }


@pytest.mark.parametrize("case", ["starts short of the tokens", "a sequence with no token", "negative cached",
                                  "token past the vocab", "position past the model's", "table too narrow",
                                  "negative page where a token lives", "page past the cache",
                                  "more sequences than tokens"])
def test_an_invalid_small_batch_runs_nothing_and_raises_the_references_error(
        reference: Reference, monkeypatch: pytest.MonkeyPatch, case: str) -> None:  # noqa: F811
    """The compiled step checks the batch itself: an invalid one writes nothing (the KV cache is as
    it was) and the per-kernel path's NumPy reference raises the error that names the fault. A
    batch of more sequences than tokens is refused before buffers are sized for its rows."""
    model = reference.ours
    kv = model.new_kv_cache(8, 4)
    kv.k[...] = 1
    kv.v[...] = 2
    batch = _invalid_small_batches(model, kv)[case]
    with pytest.raises(ValueError) as expected:
        step_inputs.step_inputs_reference(batch, kv, model.config, step_inputs.IdentityRows())
    counted = CountedStep(monkeypatch)
    for run in (model.forward, model.forward_greedy):
        with pytest.raises(ValueError) as raised:
            run(batch, kv)
        assert str(raised.value) == str(expected.value)
    assert counted.calls == (0 if case == "more sequences than tokens" else 2)
    assert (kv.k == 1).all() and (kv.v == 2).all()


def test_batches_of_other_integer_types_run_kernel_by_kernel_alike(reference: Reference,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """int64 arrays are not what the compiled step takes (numba would compile it again for them):
    such a batch runs kernel by kernel, with the int32 batch's results."""
    model = reference.ours
    counted = CountedStep(monkeypatch)
    results = []
    for form in (np.int32, np.int64, list):
        seqs = PagedSequences([[5, 17, 3], [9]], 10)
        kv = model.new_kv_cache(10, 4)
        batch = seqs.batch([[5, 17, 3], [9]])
        batch = replace(batch, **{name: (getattr(batch, name).tolist() if form is list
                                         else getattr(batch, name).astype(form))
                                  for name in ("token_ids", "query_starts", "cached_lens", "page_table")})
        results.append(model.forward(batch, kv))
    assert counted.calls == 1
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(results[0], results[2], rtol=1e-4, atol=1e-4)


def test_the_compiled_step_refuses_buffers_of_another_size(reference: Reference) -> None:  # noqa: F811
    """``CpuDecodeStep.run`` is public and its kernels check no bound: buffers sized for another
    batch run nothing (False), the KV cache untouched."""
    model = reference.ours
    kv = model.new_kv_cache(8, 4)
    kv.k[...] = 1
    batch = PagedSequences([[5, 17, 3], [9]], 8).batch([[5, 17, 3], [9]])
    for tokens, rows in ((1, 1), (4, 1), (2, 2), (4, 4)):  # the batch needs 4 tokens and 2 rows
        assert not model.cpu_step.run(batch, model.workspace.activations(tokens, rows), kv, True)
    assert (kv.k == 1).all()
    assert model.cpu_step.run(batch, model.workspace.activations(4, 2), kv, True)


def test_a_kv_cache_of_another_geometry_is_refused(reference: Reference, tmp_path: Path) -> None:  # noqa: F811
    """The kernels take heads, head size and page size from the cache's own shape: a cache with
    this model's layer count but another model's geometry would be read out of bounds."""
    model = reference.ours
    c = model.config
    other = save_tiny_checkpoint(tmp_path, arch="llama", vocab=c.vocab_size, hidden=2 * c.hidden_size,
                                 layers=c.num_hidden_layers, tied=False, seed=3)
    foreign = LlamaModel.from_checkpoint(load_checkpoint(other), backend="cpu").new_kv_cache(8, 4)
    assert foreign.num_layers == c.num_hidden_layers and foreign.k.shape != model.new_kv_cache(8, 4).k.shape
    batch = PagedSequences([[5, 17, 3]], 8).batch([[5, 17, 3]])
    with pytest.raises(ValueError, match="not made by this model"):
        model.forward(batch, foreign)


def test_profiling_backend_launches_kernel_by_kernel(reference: Reference,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler swaps in a timed backend (``use_backend``): the compiled step would hide its kernels."""
    model = reference.ours
    counted = CountedStep(monkeypatch)
    launched: list[str] = []
    own = model.backend
    timed = types.SimpleNamespace(**{name: getattr(own, name)
                                     for name in ("upload_step", "run_step", "to_host", "compacts_last_layer")})
    for name in ("embedding", "add_rmsnorm", "matmul", "rope_kv_append", "attention", "silu_mul", "argmax",
                 "gather_rows"):
        def launch(*args: Any, _name: str = name) -> None:
            launched.append(_name)
            getattr(own, _name)(*args)
        setattr(timed, name, launch)
    seqs = PagedSequences([[3, 4, 5]], 8)
    kv = model.new_kv_cache(8, 4)
    model.use_backend(timed)
    try:
        model.forward_greedy(seqs.batch([[3, 4, 5]]), kv)
    finally:
        model.use_backend(own)
    assert counted.calls == 0
    assert launched.count("matmul") == 4 * model.config.num_hidden_layers + 1 and launched[-1] == "argmax"
    model.forward_greedy(seqs.batch([[3, 4, 5]]), kv)  # the model's own backend again: compiled
    assert counted.calls == 1


def test_a_process_whose_first_call_is_the_cached_step(reference: Reference) -> None:  # noqa: F811
    """Loaded from numba's cache before any parallel kernel ran, the step once segfaulted: numba's
    thread pool (which registers the parallel launch symbol) had not started. And it is loaded:
    a second process does not compile it again."""
    script = textwrap.dedent(f"""
        import numpy as np
        from engines.runtime.model.checkpoint import load_checkpoint
        from engines.runtime.model.forward_batch import ForwardBatch
        from engines.runtime.model.llama import LlamaModel
        model = LlamaModel.from_checkpoint(load_checkpoint({str(reference.path)!r}), backend="cpu")
        kv = model.new_kv_cache(4, 4)
        batch = ForwardBatch(np.array([1, 2], np.int32), np.array([0, 2], np.int32), np.array([0], np.int32),
                             np.array([[0]], np.int32))
        first = int(model.forward_greedy(batch, kv)[0])
        one = ForwardBatch(np.array([first], np.int32), np.array([0, 1], np.int32), np.array([2], np.int32),
                           np.array([[0]], np.int32))
        print(first, int(model.forward_greedy(one, kv)[0]), model.cpu_step.team_steps)
        from engines.runtime.model import cpu_step
        print("cache hits", sum(cpu_step.decode_step_cpu.stats.cache_hits.values()),
              "team compiled here", len(cpu_step.one_token_team_step.overloads))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outputs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
               for _ in range(2)]  # the first may compile; the second loads the step from the cache
    for done in outputs:
        assert done.returncode == 0, done.stderr[-2000:]
    assert outputs[0].stdout.splitlines()[0] == outputs[1].stdout.splitlines()[0]
    assert outputs[1].stdout.splitlines()[0].endswith("(1, 0)")  # the one-token step ran as a team
    # The second really loaded the step (a step numba cannot cache, e.g. one that reads a ctypes
    # pointer, compiles anew in every process and warns), the team's code within it: the team's
    # own dispatcher compiled nothing there.
    assert outputs[1].stdout.strip().endswith("cache hits 1 team compiled here 0"), \
        outputs[1].stdout + outputs[1].stderr[-2000:]
    assert "Cannot cache" not in outputs[1].stderr

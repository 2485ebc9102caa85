"""The compiled CPU step (``cpu_step``) on a model whose weights are kept quantized, interleaved:
the same step as for float weights (``kernels.step_weights`` picks each op's kernel by the
weight's storage), against the per-kernel path, with layers of different types as a Q4_K_M file's
are, one-token steps as a thread team of each size, and batches that fork per kernel."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numba
import numpy as np
import pytest
from numba.typed import List

from engines.runtime.model import thread_team
from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.model.quant.interleaved_weight import InterleavedWeight
from engines.runtime.model.kernels import step_weights
from engines.runtime.model.llama import LlamaModel
from engines.runtime.model.quant.quantized_weight import QuantizedWeight
from tests.runtime.model.test_cpu_step import CountedStep, one_token_steps, run_both, run_both_as_team
from tests.runtime.model.test_model_parity import save_tiny_checkpoint

VOCAB = 96
# Each layer's types, as a GGUF file might hold them (layer 1's like Q4_K_M's V and down in Q6_K,
# which the loader converts to Q8_0); q/k/v and gate/up are fused, so of one type each.
LAYER_KINDS = [
    {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q4_1", "gate_proj": "Q4_1",
     "up_proj": "Q4_1", "down_proj": "Q4_1"},
    {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_0",
     "up_proj": "Q4_0", "down_proj": "Q8_0"},
]


def kind_of(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "Q8_0"
    if not name.startswith("model.layers.") or not name.endswith("_proj.weight"):
        return None
    layer, part = int(name.split(".")[2]), name.split(".")[-2]
    return LAYER_KINDS[layer][part]


def quantized_model(folder: Path) -> LlamaModel:
    """The checkpoint's matrices quantized by the gguf package to their ``kind_of``, kept so."""
    checkpoint = load_checkpoint(folder)
    weights = {}
    for name, values in checkpoint.weights.items():
        kind = kind_of(name)
        weights[name] = values if kind is None else QuantizedWeight.from_blocks(
            gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]).reshape(-1), kind, values.shape)
    return LlamaModel.from_checkpoint(dataclasses.replace(checkpoint, weights=weights), backend="cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    # Rows in whole groups of 16 everywhere (the vocabulary, q/k/v's 128, the MLP's 2 x 96).
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("quantized-step"), arch="llama", vocab=VOCAB, hidden=64,
                                  layers=2, tied=True, seed=17, intermediate=96)
    return quantized_model(folder)


def test_the_step_takes_interleaved_weights_of_several_types_as_a_typed_list(model: LlamaModel) -> None:
    assert model.weights_format == "Q4_0 x3, Q4_1 x7, Q8_0 x5"  # the matrices as the file holds them
    assert model.cpu_step is not None
    assert all(isinstance(w, InterleavedWeight) for w in model.layer_weights.qkv_w)
    qkv = model.cpu_step.weights[2]
    assert isinstance(qkv, List) and len(qkv) == 2
    assert [layer[0].dtype for layer in qkv] == [np.uint8, np.uint8]  # Q8_0's int8 quants as a uint8 view
    assert qkv[1][0].ctypes.data == model.layer_weights.qkv_w[1].quants.ctypes.data  # a view, not a copy


def test_layers_of_arrays_of_other_flags_are_listed_too(model: LlamaModel) -> None:
    """The typed list is made in compiled code from a tuple of like layers (its methods then load
    from the cache); layers whose arrays differ in their flags (one read-only here) are no such
    tuple, and are listed from Python, the same arrays either way."""
    layers = list(model.layer_weights.qkv_w)
    for listed in (step_weights.step_layers(layers), step_weights.step_layers([read_only(layers[0]), layers[1]])):
        assert isinstance(listed, List) and len(listed) == 2
        for got, weight in zip(listed, layers, strict=True):
            assert got[0].ctypes.data == weight.quants.ctypes.data
            assert got[1].ctypes.data == weight.scales.ctypes.data
    # one table of halves for them all (dequantize.half_table is made once)
    assert listed[0][3].ctypes.data == listed[1][3].ctypes.data == step_weights.step_form(layers[0])[3].ctypes.data


def read_only(weight: InterleavedWeight) -> InterleavedWeight:
    quants = weight.quants.view()
    quants.flags.writeable = False
    return dataclasses.replace(weight, quants=quants)


def test_compiled_steps_equal_the_per_kernel_path(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill, one-token steps (a team), batches of three and rows for every token: the forking
    step's kernels and the team's quantized matmuls, against ``CpuBackend``'s kernel by kernel."""
    counted = CountedStep(monkeypatch)
    rng = np.random.default_rng(5)

    def tokens(*lens: int) -> list[list[int]]:
        return [rng.integers(0, VOCAB, n).tolist() for n in lens]

    steps = [(tokens(6), "logits")] + [(tokens(1), "greedy" if i % 2 else "logits") for i in range(5)]
    assert run_both_as_team(model, steps)[0] == 5
    steps = [(tokens(5, 9, 3), "logits"), (tokens(1, 1, 1), "greedy"), (tokens(1, 1, 1), "logits"),
             (tokens(2, 1, 3), "all")]
    counted.calls = 0
    run_both(model, steps)
    assert counted.calls == len(steps)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_token_steps_of_a_team_of_each_size_equal_the_per_kernel_path(
        model: LlamaModel, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    if numba.get_num_threads() < threads:
        pytest.fail(f"numba has {numba.get_num_threads()} threads; this test needs {threads}")
    monkeypatch.setattr(model.cpu_step.backend, "numba_threads", threads)
    assert run_both_as_team(model, one_token_steps(VOCAB, seed=41, prompt=4, count=6))[0] == 6


def test_one_token_steps_with_the_team_switched_off_fork_per_kernel_alike(
        model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a team a step of one token takes gate/up through ``step_weights.swiglu_matmul``:
    the interleaved product, then ``silu_mul_cpu``."""
    monkeypatch.setattr(model.cpu_step, "team_state", thread_team.new_state(2))
    model.cpu_step.team = False
    counted = CountedStep(monkeypatch)
    steps = one_token_steps(VOCAB, seed=43, prompt=3, count=4)
    run_both(model, steps)
    assert counted.calls == len(steps) and model.cpu_step.team_steps == (0, 0)


def test_a_matrix_of_rows_in_no_whole_groups_leaves_the_model_kernel_by_kernel(tmp_path: Path) -> None:
    """A vocabulary of 100: the quantized embedding's rows make no whole groups of 16, so it stays
    row-major, which the step does not read; the model then runs kernel by kernel."""
    folder = save_tiny_checkpoint(tmp_path, arch="llama", vocab=100, hidden=64, layers=1, tied=True, seed=3,
                                  intermediate=96)
    model = quantized_model(folder)
    assert isinstance(model.embed_tokens, QuantizedWeight) and model.cpu_step is None
    assert model.forward(ForwardBatch(np.array([1, 2, 3], np.int32), np.array([0, 3], np.int32),
                                      np.zeros(1, np.int32), np.zeros((1, 1), np.int32)),
                         model.new_kv_cache(1, 4)).shape == (1, 100)

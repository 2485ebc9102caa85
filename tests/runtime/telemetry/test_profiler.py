"""The built-in profiler: kernel call counts that follow the model's arithmetic, a step
breakdown that adds up, stopping by itself, clear state errors, the stack sampler, and the
CUDA path's kernels under the simulator."""
from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.core.request import GenerationRequest
from engines.runtime.core.sampler import SamplingParams
from engines.runtime.core.warm_up import warm_up
from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.llama import LlamaModel
from engines.runtime.telemetry.profiler import (PHASES, ProfilerStateError, StepProfiler, measure_host_bandwidth,
                                               streams_sum)
from engines.runtime.telemetry.stack_sampler import StackSampler

STEPS = 12


def request(engine: Engine, rid: str, greedy: bool, max_tokens: int = 8) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if greedy else 1.0)
    return GenerationRequest(rid, engine.tokenizer.encode(f"profile {rid} " * 6), params, None, None)


def profile(engine: Engine, requests: list[GenerationRequest], **start) -> dict:
    warm_up(engine)
    engine.start_profile(**start)
    for req in requests:
        engine.add_request(req)
    while engine.has_work and engine.profiling.running is not None:
        engine.step()
    return engine.stop_profile("demo").to_json()


def calls(result: dict) -> dict[str, int]:
    return {k["name"]: k["calls"] for k in result["kernels"]}


@pytest.mark.parametrize("greedy", [True, False])
def test_every_kernel_is_counted_as_the_model_computes_it(make_engine, greedy: bool) -> None:
    engine = make_engine()
    c = engine.model.config
    result = profile(engine, [request(engine, f"r{i}", greedy, max_tokens=20) for i in range(3)], max_steps=STEPS)
    steps, layers = result["steps"], c.num_hidden_layers
    assert steps == STEPS and result["stopped_by"] == "max_steps"
    qkv = c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim
    want = {
        "embedding": steps,
        "add_rmsnorm": (2 * layers + 1) * steps,  # two per layer and the final norm
        "rope_kv_append": layers * steps,
        "attention": layers * steps,
        "silu_mul": layers * steps,
        f"matmul {c.hidden_size}x{qkv}": layers * steps,
        f"matmul {c.num_attention_heads * c.head_dim}x{c.hidden_size}": layers * steps,
        f"matmul {c.hidden_size}x{2 * c.intermediate_size}": layers * steps,
        f"matmul {c.intermediate_size}x{c.hidden_size}": layers * steps,
        f"matmul {c.hidden_size}x{c.vocab_size}": steps,  # the LM head
    }
    if greedy:
        want["argmax"] = steps  # on the device: every row greedy
    # A step with rows that return no logits (a prefill's) runs its last layer past the K/V for the
    # logit rows alone, gathered first (their q and their residual rows).
    fields = result["step_rows"]["fields"]
    steps = [dict(zip(fields, row, strict=True)) for row in result["step_rows"]["rows"]]
    compacted = sum(1 for step in steps if step["tokens"] > step["batch_size"])
    assert compacted >= 1
    want["gather_rows"] = 2 * compacted
    assert calls(result) == want
    for kernel in result["kernels"]:
        assert kernel["total_us"] > 0 and kernel["p50_us"] <= kernel["p99_us"]
        if kernel["name"].startswith("matmul"):
            assert kernel["gflops"] > 0 and kernel["gbs"] > 0
    assert result["peak"]["source"] == "measured" and result["peak"]["bandwidth_gbs"] > 0
    assert engine.model.backend is engine.profiling.plain_backend  # the timed wrapper is gone


def test_the_step_breakdown_adds_up_to_the_step_time(make_engine) -> None:
    engine = make_engine()
    result = profile(engine, [request(engine, f"r{i}", greedy=i % 2 == 0) for i in range(4)], max_steps=STEPS)
    fields = result["step_rows"]["fields"]
    assert result["phases"] == list(PHASES)
    for row in result["step_rows"]["rows"]:
        step = dict(zip(fields, row, strict=True))
        parts = sum(step[p] for p in PHASES)
        assert abs(parts - step["total_us"]) <= 0.05 * step["total_us"], step
        assert step["kernels"] > 0 and step["batch_size"] >= 1 and step["tokens"] >= step["batch_size"]
    # The kernel table's totals are the steps' kernel phases.
    kernel_total = sum(k["total_us"] for k in result["kernels"])
    phase_total = sum(dict(zip(fields, row, strict=True))["kernels"] for row in result["step_rows"]["rows"])
    assert kernel_total == pytest.approx(phase_total, rel=0.01)
    # Spans on three lanes, on the trace's clock (µs since the epoch), inside the profile.
    spans = [e for e in result["trace"]["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2}
    assert all(result["started_at_us"] <= e["ts"] <= result["started_at_us"] + result["duration_us"] for e in spans)
    assert sum(1 for e in spans if e["tid"] == 2) == sum(k["calls"] for k in result["kernels"])


def test_a_profile_stops_by_itself_and_waits_to_be_taken(make_engine) -> None:
    engine = make_engine()
    warm_up(engine)
    engine.start_profile(max_steps=3)
    engine.add_request(request(engine, "long", greedy=True, max_tokens=30))
    for _ in range(6):
        engine.step()
    status = engine.profiling.status()
    assert status.finished and not status.running and status.steps == 3
    assert engine.profiling.running is None and engine.model.backend is engine.profiling.plain_backend
    with pytest.raises(ProfilerStateError, match="not been taken"):
        engine.start_profile()
    result = engine.stop_profile("demo")
    assert result.stopped_by == "max_steps" and len(result.steps) == 3
    assert not engine.profiling.status().running and not engine.profiling.status().finished


def test_the_step_is_watched_only_while_a_profile_runs_or_tracing_is_on(make_engine) -> None:
    """An unwatched step pays one ``is None`` a seam: the observer exists only while needed."""
    engine = make_engine(tracing=False)
    assert engine.observer is None
    engine.start_profile(max_steps=2)
    assert engine.observer is not None and engine.observer.tracer is None
    engine.add_request(request(engine, "r", greedy=True, max_tokens=8))
    for _ in range(3):
        engine.step()
    assert engine.observer is None  # the profile ended at its limit
    engine.stop_profile()
    traced = make_engine(tracing=True)
    assert traced.observer is not None and traced.observer.profiler is None
    traced.start_profile()
    assert traced.observer.profiler is traced.profiling.running
    traced.stop_profile()
    assert traced.observer.tracer is traced.tracer and traced.observer.profiler is None


def test_state_errors_are_clear(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(ProfilerStateError, match="no profile is running"):
        engine.stop_profile()
    engine.start_profile()
    with pytest.raises(ProfilerStateError, match="already running"):
        engine.start_profile()
    result = engine.stop_profile()
    assert result.stopped_by == "request" and result.steps == []
    with pytest.raises(ValueError, match="max_steps"):
        StepProfiler(max_steps=0)


def test_the_stack_sampler_names_the_engine_step(make_engine) -> None:
    engine = make_engine()
    result = profile(engine, [request(engine, f"r{i}", greedy=False, max_tokens=30) for i in range(4)],
                     max_steps=40, stack_sampling=True)
    stacks = result["stacks"]
    assert stacks["samples"] == sum(count for _, count in stacks["folded"]) > 0
    assert any("engine:step" in stack.split(";") for stack, _ in stacks["folded"])


def test_the_stack_sampler_alone() -> None:
    import threading
    import time

    sampler = StackSampler(0.001)
    done = threading.Event()

    def busy_wait_here() -> None:
        while not done.is_set():
            sum(range(1000))

    worker = threading.Thread(target=busy_wait_here)
    worker.start()
    sampler.start(worker.ident)
    time.sleep(0.1)
    done.set()
    worker.join()
    out = sampler.stop()
    assert out["samples"] > 5 and out["folded"][0][0].endswith("test_profiler:busy_wait_here")


def test_the_bandwidth_yardstick_reads_every_value() -> None:
    streams = np.random.default_rng(0).integers(0, 4, 8 * 1001).astype(np.float32).reshape(8, -1)
    assert streams_sum(streams) == streams.sum(dtype=np.float64)  # small integers: exact in float32
    gbs = measure_host_bandwidth(nbytes=8 << 20, repeats=2)
    assert np.isfinite(gbs) and gbs > 0


def test_cuda_kernels_are_profiled_under_the_simulator(smallest_checkpoint: Path, quick_simulator_barriers) -> None:
    ckpt = load_checkpoint(smallest_checkpoint)
    model = LlamaModel.from_checkpoint(ckpt, backend="cuda")
    engine = Engine(model, ckpt, EngineConfig(max_num_seqs=2, num_pages=8, page_size=4, prefill_chunk_size=16))
    engine.start_profile(max_steps=2)
    engine.add_request(GenerationRequest("sim", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True), None, None))
    while engine.profiling.running is not None:
        engine.step()
    result = engine.stop_profile("tiny").to_json()
    layers = model.config.num_hidden_layers
    assert result["backend"] == "cuda" and result["steps"] == 2
    assert calls(result)["attention"] == 2 * layers and calls(result)["argmax"] == 2
    assert all(k["total_us"] > 0 for k in result["kernels"])
    assert engine.model.backend is engine.profiling.plain_backend


@pytest.fixture(scope="module")
def smallest_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.runtime.model.test_model_parity import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("smallest"), "llama", vocab=32, hidden=16, layers=2,
                                tied=True, seed=3)


def test_attention_work_follows_the_batch(make_engine) -> None:
    """One prefill of P tokens: each layer's attention reads P positions' keys and values and
    pairs P(P+1)/2 (query, position)s; the last layer's, for the logit row alone, P pairs."""
    engine = make_engine()
    c = engine.model.config
    prompt = engine.tokenizer.encode("one two three four five six seven eight nine ten")
    warm_up(engine)
    engine.start_profile(max_steps=1)
    engine.add_request(GenerationRequest("p", prompt, SamplingParams(max_tokens=1), None, None))
    engine.step()
    [attention] = [k for k in engine.stop_profile().kernels if k["name"] == "attention"]
    p = len(prompt)
    assert attention["calls"] == c.num_hidden_layers
    pairs = (c.num_hidden_layers - 1) * (p * (p + 1) // 2) + p
    assert attention["flops"] == 4 * pairs * c.num_attention_heads * c.head_dim
    qkv_width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim

    def layer_bytes(rows: int) -> int:  # the keys and values read, q in, the output out
        kv_read = 2 * p * c.num_key_value_heads * c.head_dim * 4
        return kv_read + rows * qkv_width * 4 + rows * c.num_attention_heads * c.head_dim * 4
    assert attention["bytes"] == (c.num_hidden_layers - 1) * layer_bytes(p) + layer_bytes(1)


class FakeEvent:
    """A CUDA event on a made-up device clock: each record() advances it by 250 µs."""

    clock_ms = 0.0

    def record(self) -> None:
        FakeEvent.clock_ms += 0.25
        self.at = FakeEvent.clock_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.at - self.at


def test_on_a_gpu_launches_are_timed_by_cuda_events(smallest_checkpoint: Path, quick_simulator_barriers) -> None:
    """The event path (real GPUs only) with events that keep a known clock: every launch gets its
    events' time, laid end to end from the first launch."""
    from engines.runtime.telemetry.profiler import ProfiledBackend

    ckpt = load_checkpoint(smallest_checkpoint)
    model = LlamaModel.from_checkpoint(ckpt, backend="cuda")
    engine = Engine(model, ckpt, EngineConfig(max_num_seqs=2, num_pages=8, page_size=4, prefill_chunk_size=16))
    profiler = StepProfiler()
    model.use_backend(ProfiledBackend(engine.profiling.plain_backend, profiler, events=FakeEvent))
    try:
        engine.add_request(GenerationRequest("ev", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0),
                                             None, None))
        engine.step()
    finally:
        model.use_backend(engine.profiling.plain_backend)
    kernels = [span for span in profiler.spans if span[1] == 2]
    launches = sum(len(stats.durations) for stats in profiler.kernels.values())
    # Per layer: two norms, four matmuls, rope, attention, silu_mul; then embedding, final norm, LM head, argmax.
    assert len(kernels) == launches == 9 * model.config.num_hidden_layers + 4
    assert all(stats.durations == [250_000] * len(stats.durations) for stats in profiler.kernels.values())
    starts = [span[2] for span in kernels]
    assert all(b - a == 500 for a, b in pairwise(starts))  # two records (500 µs) a launch

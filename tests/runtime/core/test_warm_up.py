"""The warm-up: after it, nothing an engine serves compiles; and it leaves no trace behind."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core.registry import CPUDispatcher

from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.core.request import GrammarMode
from engines.runtime.core.warm_up import PARTS, warm_up
from engines.runtime.model.llama import LlamaModel
from engines.runtime.telemetry.trace_recorder import TraceRecorder
from tests.runtime.demo_engine import prompts, request, run_all

REPO = Path(__file__).resolve().parents[3]
# Sized as a server's engine is, so that every path (steps past 32 rows, long prefills) is open.
SERVER_LIKE = EngineConfig(max_num_seqs=48, num_pages=512, prefill_chunk_size=512)


def compiled_signatures() -> dict[str, set]:
    """Every numba function of ours with the argument types it has been compiled (or loaded) for."""
    found: dict[str, set] = {}
    for obj in gc.get_objects():
        if isinstance(obj, CPUDispatcher) and obj.py_func.__module__.startswith("engines."):
            name = f"{obj.py_func.__module__}.{obj.py_func.__qualname__}"
            found.setdefault(name, set()).update(obj.overloads)
    return found


def serve_everything_after_warm_up() -> dict[str, list[str]]:
    """In a fresh interpreter (numba's dispatchers are process-wide: what other tests compiled
    would hide a path the warm-up missed): a warmed-up demo engine, then a server's variety of
    work. Returns what that work reached that the warm-up had not, by function."""
    from engines.runtime.model.checkpoint import load_checkpoint
    from engines.runtime.model.demo_model import demo_checkpoint_path

    demo = load_checkpoint(demo_checkpoint_path())
    model = LlamaModel.from_checkpoint(demo, backend="cpu")
    engine = Engine(model, demo, SERVER_LIKE, TraceRecorder(engine="demo", model="demo", backend="cpu"))
    warm_up(engine)
    before = compiled_signatures()
    ps = prompts(demo, 48, length=20, seed=3)
    long_prompt = prompts(demo, 1, length=300, seed=4)[0]
    requests = [request(f"g{i}", p, max_tokens=12, ignore_eos=True) for i, p in enumerate(ps[:40])]
    requests += [request("long", long_prompt, max_tokens=4, ignore_eos=True),
                 request("n3", ps[40], max_tokens=6, n=3, temperature=1.0, seed=2, logprobs=True, top_logprobs=3),
                 request("pen", ps[41], max_tokens=6, temperature=0.7, top_p=0.8, top_k=5, seed=1,
                         frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2),
                 request("json", ps[42], max_tokens=10, response_format={"type": "json_object"}),
                 request("json-c", ps[43], max_tokens=10, response_format={"type": "json_object"},
                         grammar_mode=GrammarMode.CONSTRAINT)]
    run_all(engine, requests)
    run_all(engine, [request("alone", ps[44], max_tokens=8, ignore_eos=True)])  # batch 1: the team step
    # Prompt logprobs: a short prompt's every row (a small step kernel by kernel), a long one's.
    run_all(engine, [request("echo", ps[46], max_tokens=2, logprobs=True, prompt_logprobs=1)])
    run_all(engine, [request("echo-long", long_prompt, max_tokens=0, prompt_logprobs=5),
                     request("beside", ps[47], max_tokens=3)])
    engine.start_profile(max_steps=50)
    run_all(engine, [request("p1", ps[45], max_tokens=5, ignore_eos=True),
                     request("p2", long_prompt[:100], max_tokens=3, logprobs=True)])
    engine.stop_profile("demo")
    engine.tracer.dump_json(clear=True)
    k, v = engine.kv.read_tokens((0, 1), 3, 20)
    engine.kv.write_tokens((2, 3), 3, k, v)
    after = compiled_signatures()
    return {name: sorted(map(str, sigs - before.get(name, set()))) for name, sigs in after.items()
            if sigs - before.get(name, set())}


def test_after_warm_up_no_request_profile_or_export_compiles_anything() -> None:
    code = ("import json; from tests.runtime.core.test_warm_up import serve_everything_after_warm_up as run; "
            "print(json.dumps(run()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    new = json.loads(out.stdout.strip().splitlines()[-1])
    assert new == {}, f"compiled after the warm-up: {new}"


def test_warm_up_leaves_the_engine_as_it_found_it(make_engine, demo) -> None:
    engine = make_engine(tracing=True, max_num_seqs=40, num_pages=200, prefill_chunk_size=128)
    heard: list[str] = []
    warm_up(engine, progress=lambda done, total, name: heard.append(f"{done}/{total} {name}"))
    cpu_parts = [part for part in PARTS if "cpu" in part.backends]
    assert heard[0] == f"0/{len(cpu_parts)} {cpu_parts[0].name}" and len(heard) == len(cpu_parts)
    assert engine.kv_pool.num_used_pages == 0 and not engine.requests and not engine.has_work
    assert engine.tracer.event_count == 0 and engine.num_steps == 0
    m = engine.metrics.as_dict()
    assert m["num_finished_requests"] == 0 and m["prompt_tokens_sum"] == 0 and m["num_prefill_steps"] == 0
    assert engine.profiling.status().running is False
    # The prefix cache holds nothing of the warm-up's prompts: a request prefills all of its own.
    p = prompts(demo, 1)[0]
    run_all(engine, [request("a", p, max_tokens=3)])
    assert engine.metrics.as_dict()["prefill_tokens_sum"] == len(p)


def test_warm_up_refuses_an_engine_with_requests(make_engine, demo) -> None:
    engine = make_engine()
    engine.add_request(request("a", prompts(demo, 1)[0], max_tokens=3))
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        warm_up(engine)

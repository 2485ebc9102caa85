"""What the built-in profiler costs an engine when no profile runs, and when one does.

Two engine worker processes on the demo model, one importing the runtime from ``--after`` (a
commit with the profiler) and one from ``--before`` (without it), each a git worktree, take turns
running the same offline workload (one at a time, order alternated), so the ratio compares
throughput with the profiler compiled in but off against before it existed (goal >= 0.99).
The current worker also runs the workload with a profile on, for the record.

    .venv/bin/python bench/profiler_overhead.py                  # before = the commit before the profiler
    .venv/bin/python bench/profiler_overhead.py --rounds 9 --requests 48
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_file import add_results_option, ResultsFile  # bench/ is the script's folder, first on sys.path

REPO = Path(__file__).resolve().parents[1]
#: Seconds between two runs.
PAUSE_S = 2.0
#: The last commit without the profiler (the timeline's benchmark).
DEFAULT_BEFORE = "64d6d28d5e00fbb68acb400f4ade53b5d69e1bdd"


def worker(tree: str, requests: int, seed: int) -> None:
    """Serve ``run off`` / ``run on`` lines on stdin: one workload each, its total tok/s on stdout."""
    sys.path.insert(0, tree)
    import numpy as np

    from engines.runtime import (Engine, EngineConfig, GenerationRequest, LlamaModel, SamplingParams,
                                 demo_checkpoint_path, load_checkpoint)

    ckpt = load_checkpoint(demo_checkpoint_path())
    model = LlamaModel.from_checkpoint(ckpt, backend="cpu")
    config = EngineConfig(max_num_seqs=32, max_total_tokens=32 * 512, prefill_chunk_size=256,
                          enable_prefix_cache=False)
    rng = np.random.default_rng(seed)
    jobs = [(list(map(int, rng.integers(300, ckpt.config.vocab_size - 10, size=int(rng.integers(16, 128))))),
             int(rng.integers(16, 64))) for _ in range(requests)]

    def run(tag: str, profile: bool) -> float:
        engine = Engine(model, ckpt, config)
        if profile:
            engine.start_profile(max_seconds=3600)
        for i, (prompt, out_len) in enumerate(jobs):
            engine.add_request(GenerationRequest(f"{tag}-{i}", prompt,
                                                 SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)))
        tokens, began = 0, time.perf_counter()
        while engine.has_work:
            for out in engine.step():
                tokens += sum(len(c.token_ids) for c in out.choices)
        elapsed = time.perf_counter() - began
        if profile:
            engine.stop_profile()
        return (tokens + sum(len(p) for p, _ in jobs)) / elapsed

    run("warm", False)
    print("ready", flush=True)
    for n, line in enumerate(sys.stdin):
        print(json.dumps(run(f"r{n}", line.split()[1] == "on")), flush=True)


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` under /tmp. Both sides run from one (same filesystem, same fresh
    numba caches): a worker importing this working tree ran faster than one importing an
    identical commit's worktree, by more than the difference measured
    (docs/perf-log/code-comments.md#profiler-overhead-trees)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    tree = Path(f"/tmp/bench-profiler-{commit[:12]}")
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True,
                       capture_output=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="a commit without the profiler")
    parser.add_argument("--after", default="HEAD", help="a commit with the profiler")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_results_option(parser, "profiler_overhead")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.requests, seed=0)
        return
    # One worker per kind, so each runs once a round and none follows itself more than another.
    trees = {"before": worktree(args.before), "off": worktree(args.after), "on": worktree(args.after)}
    workers = {}
    for name, tree in trees.items():
        workers[name] = subprocess.Popen([sys.executable, __file__, "--worker", str(tree), "--requests",
                                          str(args.requests)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, cwd=tree)
    for process in workers.values():
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"

    def run(name: str) -> float:
        # A pause first: BLAS threads of the worker that ran last keep spinning for a while, and
        # would slow whichever worker runs next (the other one, more often than not).
        time.sleep(PAUSE_S)
        process = workers[name]
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(f"run {'on' if name == 'on' else 'off'}\n")
        process.stdin.flush()
        return float(process.stdout.readline())

    rates: dict[str, list[float]] = {"before": [], "off": [], "on": []}
    order = ["before", "off", "on"]
    for round_ in range(args.rounds):
        for name in order[round_ % 3:] + order[:round_ % 3]:
            rates[name].append(run(name))
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {rates[n][-1]:.0f}" for n in order), flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait(60)
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"before ({args.before[:12]}): {median['before']:.0f} tok/s; "
          f"profiler compiled in, off: {median['off']:.0f} tok/s; "
          f"profiling: {median['on']:.0f} tok/s (medians of {args.rounds})")
    print(f"off / before = {median['off'] / median['before']:.3f} (goal >= 0.99); "
          f"on / off = {median['on'] / median['off']:.3f}")
    results = ResultsFile(args.results, "profiler_overhead")
    for name, runtime in (("before", f"before the profiler ({args.before[:7]})"), ("off", "profiler compiled in, off"),
                          ("on", "profiling")):
        results.add("median total", median[name], "tok/s", runtime=runtime, requests=args.requests)
    results.add("off/before", median["off"] / median["before"], "ratio", runtime="profiler compiled in, off",
                requests=args.requests)
    results.add("on/off", median["on"] / median["off"], "ratio", runtime="profiling", requests=args.requests)


if __name__ == "__main__":
    main()

"""A batch-1 CPU decode step through the model's API against the compiled step alone, and both
against this machine's memory bandwidth.

A batch-1 step streams every weight once, so its ceiling is the host's read rate. The compiled
step (``LlamaModel.cpu_step.run``: one call of ``cpu_step.decode_step_cpu``, which checks the batch
and derives its metadata itself) is timed on buffers found once; ``LlamaModel.forward_greedy`` adds
the Python around it (the KV cache's and the arrays' checks, the buffers, the result's copy). Right after a
step has streamed ~120 MB through the caches that Python runs with cold caches, many times
slower than a microbenchmark of it says, so it is measured here where it runs: the two take
turns on the same step (the same context, the same KV slot rewritten), on issue 15's checkpoint
(``bench/cpu_anchors.py`` makes it), medians of the rounds, the host's read rate read in every
round (``measure_host_bandwidth``).

    .venv/bin/python bench/cpu_step_overhead.py --threads 2 --contexts 80 272 --rounds 30
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.results_file import add_results_option, ResultsFile  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[80, 272],
                        help="cached tokens before the timed step (80 and 272: the mean context of a 128- and "
                             "a 512-token generation after a 16-token prompt)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="steps of each form a round, alternated")
    add_results_option(parser, "cpu_step_overhead")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from bench.cpu_threads import use_threads

    use_threads(args.threads)
    import numpy as np

    from bench.cpu_anchors import make_checkpoint, parse_args as anchor_args
    from bench.decode import OurDecoder
    from engines.runtime import ForwardBatch, LlamaModel, load_checkpoint, measure_host_bandwidth

    hf, _ = make_checkpoint(anchor_args([]))
    model = LlamaModel.from_checkpoint(load_checkpoint(hf), backend="cpu")
    w = model.layer_weights
    weight_bytes = sum(a.nbytes for a in (w.input_norm, w.qkv_w, w.qkv_bias, w.o_w, w.post_attention_norm,
                                          w.gate_up_w, w.down_w, model.norm, model.lm_head_w))
    config = model.config
    kv_per_token = 2 * 4 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    results = ResultsFile(args.results, "cpu_step_overhead")
    print(f"{args.threads} thread(s); weights read a step {weight_bytes / 1e6:.1f} MB; medians of {args.rounds} rounds "
          f"of {args.steps} alternated steps each")
    for context in args.contexts:
        decoder = OurDecoder(model, np.random.default_rng(0).integers(3, config.vocab_size, (1, 16)), context + 2)
        while decoder.cached[0] < context:
            decoder.step()
        batch = ForwardBatch(decoder.next_ids.astype(np.int32), decoder.decode_starts, decoder.cached.copy(),
                             decoder.page_table)
        # The step's buffers, found once: what forward_greedy finds before its one call.
        act = model.workspace.activations(1, 1)
        forms = {"through forward_greedy": functools.partial(model.forward_greedy, batch, decoder.kv),
                 "compiled step alone": functools.partial(model.cpu_step.run, batch, act, decoder.kv, True)}
        times: dict[str, list[float]] = {name: [] for name in forms}
        host: list[float] = []
        for round_ in range(args.rounds):
            for _ in range(args.steps):
                for name in (list(forms) if round_ % 2 else list(forms)[::-1]):
                    began = time.perf_counter()
                    forms[name]()
                    times[name].append(time.perf_counter() - began)
            host.append(measure_host_bandwidth())
        gbs = statistics.median(host)
        step_bytes = weight_bytes + kv_per_token * (context + 1)
        print(f"\ncontext {context}: host read rate {gbs:.1f} GB/s (median of the rounds); a step reads "
              f"{step_bytes / 1e6:.1f} MB (weights and KV)")
        medians = {name: statistics.median(values) for name, values in times.items()}
        where = {"threads": args.threads, "context": context}
        results.add("host read rate", gbs, "GB/s", **where)
        for name, seconds in medians.items():
            rate = step_bytes / seconds / 1e9
            print(f"  {name:24s} {seconds * 1e3:6.3f} ms  {rate:5.1f} GB/s  {100 * rate / gbs:4.0f}% of the host's")
            results.add(f"step {name}", seconds * 1e3, "ms", **where)
            results.add(f"step {name}, share of the host's read rate", 100 * rate / gbs, "%", **where)
        around = medians["through forward_greedy"] - medians["compiled step alone"]
        print(f"  Python around the step: {1e3 * around:.3f} ms")
        results.add("Python around the step", 1e3 * around, "ms", **where)


if __name__ == "__main__":
    main()

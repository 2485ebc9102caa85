"""What ``serve --weights-dtype`` costs on the built-in SmolLM2 GGUF: ``gguf`` (the file's Q4_1 and
Q8_0 matrices kept as they are) against ``float32`` (dequantized at load), side by side in one run
on this machine.

* memory: the weights' bytes as the engine holds them (``LlamaModel.weight_bytes``), and what
  loading the file as an engine process does (the checkpoint and the model, both kept) adds to the
  process's resident set, each kind in a process of its own;
* speed: batch-1 greedy decode through the whole engine, 128 tokens, EOS ignored, the two kinds
  alternated, medians (``bench/quantized_matmul.py --engine``'s run);
* accuracy against the float32 path: ``bench/gguf_vs_llamacpp.py``'s accuracy worker (ours
  against ours, no llama.cpp): 4 prompts, 256 greedy tokens each from both, the tokens equal before
  the first divergence and in all; then the float32 engine's sequence teacher-forced through both,
  a decode step a token: how often their top tokens agree, and the logits' mean and largest
  absolute difference.

    .venv/bin/python bench/weights_dtype.py                 # all three, 5 rounds of the speed run
    .venv/bin/python bench/weights_dtype.py --skip-accuracy --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

from bench.results_file import ResultsFile, add_results_option, this_machine  # noqa: E402

BENCH = "weights_dtype"
KINDS = ("gguf", "float32")


def resident_bytes() -> int:
    """This process's resident set now (``VmRSS``)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def memory_worker(kind: str) -> None:
    """Load the file as an engine process does (``kind``: kept or dequantized), the checkpoint and
    the model both kept, and print as one JSON line the weights' bytes and what the load added to
    the resident set of this fresh process, whose libraries were imported before (the first
    reading): what it adds is the arrays', and the cached kernels the load runs (a few MB)."""
    from engines.runtime import LlamaModel, builtin_model_path, load_checkpoint

    path = builtin_model_path("smollm2")
    before = resident_bytes()
    checkpoint = load_checkpoint(path, keep_quantized=kind == "gguf")
    model = LlamaModel.from_checkpoint(checkpoint, backend="cpu")
    print(json.dumps({"weights": model.weights_format, "weight_bytes": model.weight_bytes,
                      "rss_added": resident_bytes() - before}))


def measure_memory(results: ResultsFile) -> None:
    print("memory: the weights as held, and what loading the file as an engine does adds to its resident set")
    for kind in KINDS:
        out = subprocess.run([sys.executable, __file__, "--memory-worker", kind], cwd=REPO, check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
        found = json.loads(out.splitlines()[-1])
        print(f"  --weights-dtype {kind:<8} {found['weights']:<20} weights {found['weight_bytes'] / 1e6:6.1f} MB, "
              f"resident set +{found['rss_added'] / 1e6:6.1f} MB", flush=True)
        for metric, key in (("weight bytes", "weight_bytes"), ("resident set added", "rss_added")):
            results.add(metric, found[key], "bytes", weights=kind)


def measure_accuracy(results: ResultsFile, threads: int) -> None:
    from bench.gguf_vs_llamacpp import ACCURACY_NEW_TOKENS, ACCURACY_PROMPTS, Worker, first_divergence
    from engines.runtime import builtin_model_path, load_checkpoint

    file = builtin_model_path("smollm2")
    tokenizer = load_checkpoint(file, load_weights=False).tokenizer
    worker = Worker(Path(sys.executable), "accuracy", file, threads)
    try:
        answers = [worker.ask(prompt=tokenizer.encode(text), new=ACCURACY_NEW_TOKENS) for text in ACCURACY_PROMPTS]
    finally:
        worker.close()
    new = ACCURACY_NEW_TOKENS
    print(f"accuracy, gguf ({worker.ready['weights']}) against float32: {len(answers)} prompts, {new} greedy "
          "tokens each; then float32's tokens teacher-forced through both")
    print(f"{'prompt':>8}{'same prefix':>13}{'same tokens':>13}{'top token':>11}{'mean |d|':>10}{'max |d|':>9}")
    for number, answer in enumerate(answers, 1):
        prefix = first_divergence(answer["quantized"], answer["float32"])
        equal = sum(x == y for x, y in zip(answer["quantized"], answer["float32"], strict=True))
        print(f"{number:>8}{prefix:>13}{equal:>13}{answer['same_argmax']:>11.3f}{answer['mean_diff']:>10.3f}"
              f"{answer['max_diff']:>9.3f}", flush=True)
        where = {"prompt": number, "new_tokens": new, "threads": threads}
        for metric, value, unit in (("same prefix", prefix, "tokens"), ("same tokens", equal, "tokens"),
                                    ("same top token, forced", answer["same_argmax"], "fraction"),
                                    ("mean abs logit diff", answer["mean_diff"], "logit"),
                                    ("max abs logit diff", answer["max_diff"], "logit")):
            results.add(metric, value, unit, **where)


def main() -> None:
    if sys.argv[1:2] == ["--memory-worker"]:
        memory_worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the speed run")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    add_results_option(parser, BENCH)
    args = parser.parse_args()
    machine = this_machine()
    print(f"--weights-dtype gguf against float32 on SmolLM2-135M's Q4_1 GGUF; {machine['cpu']}, "
          f"{machine['cores']} cores", flush=True)
    results = ResultsFile(args.results, BENCH)
    measure_memory(results)
    if not args.skip_speed:
        from bench.quantized_matmul import engine_decode

        print(f"speed: batch-1 decode through the engine, {args.rounds} alternated rounds")
        engine_decode(results, args.rounds)
    if not args.skip_accuracy:
        measure_accuracy(results, machine["cores"])


if __name__ == "__main__":
    main()

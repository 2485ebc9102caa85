"""Our CPU decode against the engines a CPU user would pick instead: CTranslate2 and transformers.

One random Llama checkpoint (by default issue 15's: hidden 512, 8 layers, 8 heads and 8 KV heads,
vocab 8192, fp32, untied head: 34M parameters), made here and converted for CTranslate2 at fp32.
For each thread count, each engine runs in a process of its own (as a user runs it; thread
counts are fixed before numpy loads), and for each batch size and generation length the three
take turns generating greedily from the same random prompts (EOS ignored; whole generations
timed, prefill included), and the table gives the medians of ``--rounds`` rounds. Prefill alone
(batch 1, long prompts) is timed the same way. This machine's memory bandwidth is measured in
the same run (and around each of our batch-1 generations), and batch 1's bytes per token
against it: its weights, and its weights with the keys and values it reads, over the whole
generation and over its decode steps alone (the prefill, bound by arithmetic, left out). With two
generation lengths, each batch's tokens/s over the longer one against the shorter one's, for each
engine, beside what a step bound by the bytes it reads would keep.

    .venv/bin/python bench/cpu_anchors.py                          # the full table (long)
    .venv/bin/python bench/cpu_anchors.py --threads 2 --batches 1 8 32 --new-tokens 128 --rounds 3
    .venv/bin/python bench/cpu_anchors.py --threads 2 --batches 1 8 32 --new-tokens 128 --prefill --engine
    .venv/bin/python bench/cpu_anchors.py --threads 1 2 --batches 1 8 --new-tokens 128 --prefill --per-kernel
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
# The repository root, not bench/, first on the path: bench/kernels.py would shadow the
# ``kernels`` package transformers looks for.
sys.path[0] = str(REPO)

from bench.pipe_worker import PipeWorker  # noqa: E402
from bench.results_file import add_results_option, ResultsFile  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32],
                        help="decode batches (none: prefill only)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--prefill", type=int, nargs="*", default=[512, 2048], help="prompt lengths timed alone")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--cache", type=Path, default=REPO / "var" / "bench-cpu-anchors")
    parser.add_argument("--engine", action="store_true",
                        help="also time our whole engine (scheduler, sampler, detokenizer) on the same cells")
    parser.add_argument("--per-kernel", action="store_true",
                        help="also time our model launching kernel by kernel (no compiled CPU step)")
    add_results_option(parser, "cpu_anchors")
    parser.add_argument("--worker", choices=["ours", "ctranslate2", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def hf_checkpoint(args: argparse.Namespace) -> Path:
    """The random HF checkpoint of ``args``' shape (with a word-level tokenizer), made once."""
    hf = args.cache / f"llama-h{args.hidden}-l{args.layers}-q{args.heads}-kv{args.kv_heads}-v{args.vocab}"
    if not (hf / "model.safetensors").exists():
        import torch
        from tokenizers import Tokenizer, models
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
        Tokenizer(models.WordLevel({f"w{i}": i for i in range(args.vocab)}, unk_token="w0")).save(
            str(hf / "tokenizer.json"))
    return hf


def make_checkpoint(args: argparse.Namespace) -> tuple[Path, Path]:
    """The random HF checkpoint (:func:`hf_checkpoint`) and its CTranslate2 conversion, made once."""
    hf = hf_checkpoint(args)
    ct2 = hf.with_name(f"{hf.name}-ct2")
    if not (ct2 / "model.bin").exists():
        import ctranslate2

        ctranslate2.converters.TransformersConverter(str(hf), load_as_float16=False).convert(
            str(ct2), quantization="float32", force=True)
        # A bare word-level tokenizer names no special tokens; CTranslate2 needs them as strings.
        config = json.loads((ct2 / "config.json").read_text())
        config.update(bos_token="w1", eos_token="w2", unk_token="w0")
        (ct2 / "config.json").write_text(json.dumps(config, indent=2))
    return hf, ct2


class Worker(PipeWorker):
    """One engine in a process of its own (``--worker NAME``), as a user would run it: numba's,
    torch's and CTranslate2's thread pools never share a process (in one, the compiled CPU step
    ran well below its own speed on two threads: docs/perf-log/cpu-anchors.md#2026-11-25-compiled-cpu-step).
    Only one worker computes at a time; the others wait on their pipes."""

    def __init__(self, args: argparse.Namespace, name: str, threads: int) -> None:
        command = [sys.executable, __file__, "--worker", name, "--worker-threads", str(threads), *forwarded(args)]
        super().__init__(command, name, str(REPO), {**os.environ, "PYTHONPATH": str(REPO)})
        self.variants: list[str] = self.ready["variants"]


def worker(args: argparse.Namespace) -> None:
    """``--worker NAME``: load one engine at ``--worker-threads`` threads, then answer commands
    from stdin: ``{"variant", "prompts", "new"}`` -> ``{"seconds"}`` (one generation, timed),
    ``{"bandwidth": true}`` -> ``{"gbs"}``. Ours also answers the seconds to its first token
    (``"prefill_seconds"``), so that its decode steps can be set against the host's read rate alone."""
    threads = args.worker_threads
    from bench.cpu_threads import use_threads

    use_threads(threads)
    import numpy as np

    hf, ct2_path = make_checkpoint(args)
    # A run returns the seconds its prefill (and first token) took where it can tell, else None.
    runs: dict[str, Callable[[Any, int], float | None]] = {}
    if args.worker == "ours":
        from bench.decode import OurDecoder
        from engines.runtime import LlamaModel, load_checkpoint

        model = LlamaModel.from_checkpoint(load_checkpoint(hf), backend="cpu")
        compiled_step = model.cpu_step
        # A KV cache per batch size, for the longest sequence of any cell, made at the first
        # (untimed, warming) call and kept, as an engine keeps its pool: a fresh one's pages are
        # mapped as the prefill first writes them (a sizeable share of a prefill's time:
        # docs/perf-log/cpu-anchors.md#2026-11-26-zen5-full-table-2a8ca35), which CTranslate2's and
        # torch's allocators, reusing their memory, do not pay either.
        longest = max(args.prompt_len + max(args.new_tokens) + 1, max(args.prefill or [0]) + 2)
        kv_caches: dict[int, Any] = {}

        def ours(prompts: np.ndarray, new: int) -> float:
            batch = prompts.shape[0]
            if batch not in kv_caches:
                kv_caches[batch] = model.new_kv_cache(batch * -(-longest // 16), 16)
            kv = kv_caches[batch]
            began = time.perf_counter()
            decoder = OurDecoder(model, prompts, prompts.shape[1] + new + 1, kv=kv)  # the prefill and first token
            prefill = time.perf_counter() - began
            for _ in range(new - 1):
                decoder.step()
            return prefill

        def ours_per_kernel(prompts: np.ndarray, new: int) -> float:
            model.cpu_step = None
            try:
                return ours(prompts, new)
            finally:
                model.cpu_step = compiled_step

        runs["ours"] = ours
        if args.engine:
            runs["engine"] = whole_engine(args, model, load_checkpoint(hf))
        if args.per_kernel:
            runs["per-kernel"] = ours_per_kernel
    elif args.worker == "ctranslate2":
        import ctranslate2

        generator = ctranslate2.Generator(str(ct2_path), device="cpu", inter_threads=1, intra_threads=threads)

        def theirs_ct2(prompts: np.ndarray, new: int) -> None:
            tokens = [[f"w{t}" for t in row] for row in prompts]
            generator.generate_batch(tokens, max_length=new, min_length=new, sampling_topk=1,
                                     include_prompt_in_result=False, max_batch_size=prompts.shape[0])
        runs["ctranslate2"] = theirs_ct2
    else:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()

        def theirs_torch(prompts: np.ndarray, new: int) -> None:
            with torch.inference_mode():
                torch_model.generate(torch.from_numpy(prompts.astype(np.int64)), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)
        runs["transformers"] = theirs_torch

    print(json.dumps({"variants": list(runs)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("bandwidth"):
            from engines.runtime import measure_host_bandwidth

            print(json.dumps({"gbs": measure_host_bandwidth()}), flush=True)
            continue
        prompts = np.asarray(command["prompts"], dtype=np.int64)
        began = time.perf_counter()
        prefill = runs[command["variant"]](prompts, command["new"])
        print(json.dumps({"seconds": time.perf_counter() - began, "prefill_seconds": prefill}), flush=True)


def measure(args: argparse.Namespace, threads: int) -> Iterator[dict]:
    """One thread count: every cell, the engines alternated, each in its own worker process;
    rows as dicts (the first: the host's bandwidth)."""
    import numpy as np

    workers = [Worker(args, name, threads) for name in ("ours", "ctranslate2", "transformers")]
    try:
        engines = {variant: w for w in workers for variant in w.variants}
        rng = np.random.default_rng(0)
        yield {"kind": "bandwidth", "threads": threads, "gbs": workers[0].ask(bandwidth=True)["gbs"]}

        def cell(kind: str, batch: int, prompt_len: int, new: int) -> dict:
            prompts = rng.integers(3, args.vocab, (batch, prompt_len))
            times: dict[str, list[float]] = {name: [] for name in engines}
            prefills: list[float] = []  # ours, each generation's prefill and first token
            # Batch 1: the host's read rate just before and just after each of our generations (the
            # machine's speed drifts by tens of per cent between minutes; a bracketing pair follows it).
            bandwidths: list[float] = []
            warm = prompts if kind == "prefill" else prompts[:, :8]  # a long prompt takes paths a short one does not
            for name, w in engines.items():  # warm: first calls compile, allocate, fill caches
                w.ask(variant=name, prompts=warm.tolist(), new=2)
            for round_ in range(args.rounds):
                names = list(engines)
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    bracket = kind == "decode" and batch == 1 and name == "ours"
                    before = workers[0].ask(bandwidth=True)["gbs"] if bracket else 0.0
                    answer = engines[name].ask(variant=name, prompts=prompts.tolist(), new=new)
                    times[name].append(answer["seconds"])
                    if bracket:
                        bandwidths.append((before + workers[0].ask(bandwidth=True)["gbs"]) / 2)
                        prefills.append(answer["prefill_seconds"])
            row = {"kind": kind, "threads": threads, "batch": batch, "prompt": prompt_len, "new": new}
            if bandwidths:
                row["gbs"] = statistics.median(bandwidths)
                # Each generation's rate against the yardstick read around it, the median of those shares.
                row["share"] = statistics.median(new / seconds / gbs
                                                 for seconds, gbs in zip(times["ours"], bandwidths, strict=True))
                # Its decode steps alone (after the first token): the prefill is bound by arithmetic, not
                # by memory, and has cells of its own.
                row["decode_share"] = statistics.median((new - 1) / (seconds - prefill) / gbs for seconds, prefill, gbs
                                                        in zip(times["ours"], prefills, bandwidths, strict=True))
            for name, values in times.items():
                row[name] = batch * (new if kind == "decode" else prompt_len) / statistics.median(values)
            return row

        for new in args.new_tokens:
            for batch in args.batches:
                yield cell("decode", batch, args.prompt_len, new)
        for prompt_len in args.prefill:
            yield cell("prefill", 1, prompt_len, 1)
    finally:
        for w in workers:
            w.close()


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options a worker needs (its checkpoint, its variants)."""
    return ["--cache", str(args.cache), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab),
            "--prompt-len", str(args.prompt_len), "--batches", *map(str, args.batches),
            "--new-tokens", *map(str, args.new_tokens), "--prefill", *map(str, args.prefill),
            *(["--engine"] if args.engine else []), *(["--per-kernel"] if args.per_kernel else [])]


def whole_engine(args: argparse.Namespace, model: Any, checkpoint: Any) -> Callable[[Any, int], None]:
    """Our engine on the bare model's weights: requests in, every step until they finish (the
    scheduler, the greedy sampler, stop checks and detokenizing included). No prefix cache: each
    round must prefill as the others do."""
    from engines.runtime import Engine, EngineConfig, GenerationRequest, SamplingParams

    pages = max(args.batches or [1]) * -(-(args.prompt_len + max(args.new_tokens) + 1) // 16)
    pages = max(pages, -(-(max(args.prefill or [0]) + 2) // 16)) + 8
    engine = Engine(model, checkpoint, EngineConfig(max_num_seqs=max(args.batches or [1]), num_pages=pages,
                                                    prefill_chunk_size=max([2048, *args.prefill]),
                                                    enable_prefix_cache=False))
    runs = iter(range(1 << 62))

    def generate(prompts: Any, new: int) -> None:
        run = next(runs)
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerationRequest(f"{run}-{i}", [int(t) for t in prompt],
                                                 SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)))
        while engine.has_work:
            engine.step()

    return generate


def weight_bytes(args: argparse.Namespace) -> int:
    """The bytes of weights a decode step reads (every layer's projections and the LM head)."""
    head_dim = args.hidden // args.heads
    q, kv, inter = args.heads * head_dim, args.kv_heads * head_dim, args.hidden * 11 // 4
    per_layer = args.hidden * (q + 2 * kv) + q * args.hidden + 3 * args.hidden * inter
    return 4 * (args.layers * per_layer + args.vocab * args.hidden)


def kv_bytes(args: argparse.Namespace, new: int) -> float:
    """The bytes of keys and values a batch-1 decode step reads, on average over a generation
    of ``new`` tokens after the prompt."""
    head_dim = args.hidden // args.heads
    return 4 * 2 * args.layers * args.kv_heads * head_dim * (args.prompt_len + new / 2)


def bandwidth_note(args: argparse.Namespace, row: dict) -> str:
    """Batch 1's read rate against the host's: weights alone, and weights with the KV cache the
    step reads too; each generation against the host's rate read around it (the median of those
    shares), whole and its decode steps alone (its tokens after the first over the time after
    it), and the medians' rates against the median host rate."""
    weights, both = weight_bytes(args), weight_bytes(args) + kv_bytes(args, row["new"])
    return (f"  (batch 1: weights {row['ours'] * weights / 1e9:.1f} GB/s, host {row['gbs']:.1f}; per generation "
            f"{100 * row['share'] * weights / 1e9:.0f}% of the host's, {100 * row['share'] * both / 1e9:.0f}% with "
            f"the KV cache; its decode steps {100 * row['decode_share'] * weights / 1e9:.0f}%, "
            f"{100 * row['decode_share'] * both / 1e9:.0f}% with the KV cache; "
            f"medians' {100 * row['ours'] * weights / 1e9 / row['gbs']:.0f}%)")


def decay_lines(args: argparse.Namespace, rows: list[dict], results: ResultsFile | None = None) -> list[str]:
    """Each batch's tokens/s over its longest generation against its shortest one's, for each
    engine (the goal: ours no lower than CTranslate2's), and the ratio a step bound by its bytes
    alone would have: the weights once a step and each sequence's keys and values, read at one rate.
    At batch 1, ours again with each generation against the host's rate read around it, as if
    the host's memory had kept one speed (it drifts between two cells:
    docs/perf-log/cpu-anchors.md#2026-11-26-xeon-amx-decay)."""
    lines = []
    weights = weight_bytes(args)
    for batch in sorted({row["batch"] for row in rows if row["kind"] == "decode"}):
        by_new = {row["new"]: row for row in rows if row["kind"] == "decode" and row["batch"] == batch}
        if len(by_new) < 2:
            continue
        short, long = by_new[min(by_new)], by_new[max(by_new)]
        bound = (weights + batch * kv_bytes(args, short["new"])) / (weights + batch * kv_bytes(args, long["new"]))
        engines = "; ".join(f"{name} {long[key] / short[key]:.3f}"
                            for name, key in (("ours", "ours"), ("CT2", "ctranslate2"), ("HF", "transformers")))
        # Batch 1 has the host's rate read around each of our generations: our decay at one rate.
        steady = (f"; ours at the host's rate around each generation {long['share'] / short['share']:.3f}"
                  if "share" in long and "share" in short else "")
        if results is not None:
            decays = {name: long[key] / short[key] for name, key in
                      (("ours", "ours"), ("CTranslate2", "ctranslate2"), ("transformers", "transformers"))}
            decays["bound by bytes"] = bound
            if steady:
                decays["ours at one host rate"] = long["share"] / short["share"]
            for name, value in decays.items():
                results.add("decay", value, "ratio", threads=long["threads"], batch=batch,
                            new=f"{long['new']}/{short['new']}", engine=name)
        lines.append(f"  batch {batch}, {long['new']} new over {short['new']} new (tok/s): {engines}; "
                     f"bound by bytes {bound:.3f}{steady}")
    return lines


def blas_note() -> str:
    """The BLAS our prefill's projections run on, and its kernels: an ``OPENBLAS_CORETYPE`` set in
    the environment picks them instead of the processor (some machines here set it, and on an
    AVX-512 one it halves OpenBLAS's sgemm), and CTranslate2 and transformers bring BLAS of their own."""
    import numpy  # noqa: F401 - loads its BLAS, which threadpoolctl lists only once loaded
    from threadpoolctl import threadpool_info

    libraries = [f"{i['internal_api']} {i['version']}, {i.get('architecture', '?')} kernels"
                 for i in threadpool_info() if i["user_api"] == "blas"]
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return (f"numpy's BLAS: {'; '.join(libraries) or 'none found'}"
            + (f" (OPENBLAS_CORETYPE={forced} set: not this processor's choice)" if forced else ""))


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    make_checkpoint(args)
    print(f"checkpoint: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, "
          f"vocab {args.vocab}, fp32; prompt {args.prompt_len}; medians of {args.rounds} alternated rounds")
    print(blas_note())
    results = ResultsFile(args.results, "cpu_anchors")
    for threads in args.threads:
        rows: list[dict] = []
        for row in measure(args, threads):
            rows.append(row)
            record(args, results, row)
            if row["kind"] == "bandwidth":
                print(f"\n{threads} thread(s): host memory bandwidth {row['gbs']:.1f} GB/s")
                print(f"{'':9}{'batch':>6}{'prompt':>7}{'new':>5}{'ours':>10}{'CT2':>10}{'HF':>10}"
                      f"{'ours/CT2':>10}{'ours/HF':>9}")
                continue
            unit = "tok/s"
            print(f"{row['kind']:<9}{row['batch']:>6}{row['prompt']:>7}{row['new']:>5}{row['ours']:>10.0f}"
                  f"{row['ctranslate2']:>10.0f}{row['transformers']:>10.0f}{row['ours'] / row['ctranslate2']:>10.2f}"
                  f"{row['ours'] / row['transformers']:>9.2f}  {unit}"
                  + (bandwidth_note(args, row) if "gbs" in row else "")
                  + (f"  engine {row['engine']:.0f} = {row['engine'] / row['ours']:.2f} of ours" if "engine" in row
                     else "")
                  + (f"  kernel by kernel {row['per-kernel']:.0f}: ours {row['ours'] / row['per-kernel']:.2f}x"
                     if "per-kernel" in row else ""), flush=True)
        for line in decay_lines(args, rows, results):
            print(line, flush=True)


def record(args: argparse.Namespace, results: ResultsFile, row: dict) -> None:
    """One printed row's figures into the results file: tokens/s of each engine, ours against the
    others, and batch 1's read rate against the host's."""
    if row["kind"] == "bandwidth":
        results.add("host read rate", row["gbs"], "GB/s", threads=row["threads"])
        return
    cell = f"batch {row['batch']}, {row['new']} new" if row["kind"] == "decode" else f"prefill {row['prompt']}"
    where = {"threads": row["threads"], "cell": cell}
    for name, key in (("ours", "ours"), ("CTranslate2", "ctranslate2"), ("transformers", "transformers"),
                      ("engine", "engine"), ("per-kernel", "per-kernel")):
        if key in row:
            results.add(name, row[key], "tok/s", **where)
    ratios = {"ours/CT2": row["ours"] / row["ctranslate2"], "ours/HF": row["ours"] / row["transformers"]}
    if "engine" in row:
        ratios["engine/ours"] = row["engine"] / row["ours"]
    if "per-kernel" in row:
        ratios["ours/per-kernel"] = row["ours"] / row["per-kernel"]
    for name, value in ratios.items():
        results.add(name, value, "ratio", **where)
    if "gbs" in row:
        weights, both = weight_bytes(args), weight_bytes(args) + kv_bytes(args, row["new"])
        results.add("host read rate", row["gbs"], "GB/s", **where)
        for name, share, size in (("weights, per generation", "share", weights),
                                  ("weights + KV, per generation", "share", both),
                                  ("weights, decode steps", "decode_share", weights),
                                  ("weights + KV, decode steps", "decode_share", both)):
            results.add(f"share of the host's read rate: {name}", 100 * row[share] * size / 1e9, "%", **where)


if __name__ == "__main__":
    main()

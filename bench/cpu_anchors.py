"""Our CPU decode against the engines a CPU user would pick instead: CTranslate2 and transformers.

One random Llama checkpoint (by default issue 15's: hidden 512, 8 layers, 8 heads and 8 KV heads,
vocab 8192, fp32, untied head: 34M parameters), made here and converted for CTranslate2 at fp32.
For each thread count (a child process each: thread counts are fixed before numpy loads), each
batch size and each generation length, the three take turns generating greedily from the same
random prompts (EOS ignored; whole generations timed, prefill included), and the table gives the
medians of ``--rounds`` rounds. Prefill alone (batch 1, long prompts) is timed the same way. This
machine's memory bandwidth is measured in the same run, and batch 1's bytes per token against it.

    .venv/bin/python bench/cpu_anchors.py                          # the full table (long)
    .venv/bin/python bench/cpu_anchors.py --threads 2 --batches 1 8 32 --new-tokens 128 --rounds 3
    .venv/bin/python bench/cpu_anchors.py --threads 2 --batches 1 8 32 --new-tokens 128 --prefill --engine
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
# The repository root, not bench/, first on the path: bench/kernels.py would shadow the
# ``kernels`` package transformers looks for.
sys.path[0] = str(REPO)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32], help="decode batches (none: prefill only)")
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
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # run one thread count, print JSON rows
    return parser.parse_args(argv)


def make_checkpoint(args: argparse.Namespace) -> tuple[Path, Path]:
    """The random HF checkpoint (with a word-level tokenizer) and its CTranslate2 conversion, made once."""
    name = f"llama-h{args.hidden}-l{args.layers}-q{args.heads}-kv{args.kv_heads}-v{args.vocab}"
    hf, ct2 = args.cache / name, args.cache / f"{name}-ct2"
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
    if not (ct2 / "model.bin").exists():
        import ctranslate2

        ctranslate2.converters.TransformersConverter(str(hf), load_as_float16=False).convert(
            str(ct2), quantization="float32", force=True)
        # A bare word-level tokenizer names no special tokens; CTranslate2 needs them as strings.
        config = json.loads((ct2 / "config.json").read_text())
        config.update(bos_token="w1", eos_token="w2", unk_token="w0")
        (ct2 / "config.json").write_text(json.dumps(config, indent=2))
    return hf, ct2


def child(args: argparse.Namespace) -> None:
    """One thread count: every cell, the three engines alternated; JSON rows on stdout."""
    threads = args.child
    from bench.cpu_threads import use_threads

    use_threads(threads)
    import ctranslate2
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from bench.decode import OurDecoder
    from engines.runtime import LlamaModel, load_checkpoint, measure_host_bandwidth

    torch.set_num_threads(threads)
    hf, ct2_path = make_checkpoint(args)
    ours_model = LlamaModel.from_checkpoint(load_checkpoint(hf), backend="cpu")
    torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    generator = ctranslate2.Generator(str(ct2_path), device="cpu", inter_threads=1, intra_threads=threads)
    rng = np.random.default_rng(0)

    def ours(prompts: np.ndarray, new: int) -> None:
        decoder = OurDecoder(ours_model, prompts, prompts.shape[1] + new + 1)
        for _ in range(new - 1):
            decoder.step()

    def theirs_torch(prompts: np.ndarray, new: int) -> None:
        with torch.inference_mode():
            torch_model.generate(torch.from_numpy(prompts.astype(np.int64)), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)

    def theirs_ct2(prompts: np.ndarray, new: int) -> None:
        tokens = [[f"w{t}" for t in row] for row in prompts]
        generator.generate_batch(tokens, max_length=new, min_length=new, sampling_topk=1,
                                 include_prompt_in_result=False, max_batch_size=prompts.shape[0])

    engines = {"ours": ours, "ctranslate2": theirs_ct2, "transformers": theirs_torch}
    if args.engine:
        engines["engine"] = whole_engine(args, ours_model, load_checkpoint(hf))

    def cell(kind: str, batch: int, prompt_len: int, new: int) -> dict:
        prompts = rng.integers(3, args.vocab, (batch, prompt_len))
        times: dict[str, list[float]] = {name: [] for name in engines}
        for name, run in engines.items():
            run(prompts[:, :8], 2)  # warm: first calls compile, allocate, fill caches
        for round_ in range(args.rounds):
            names = list(engines)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                began = time.perf_counter()
                engines[name](prompts, new)
                times[name].append(time.perf_counter() - began)
        row = {"kind": kind, "threads": threads, "batch": batch, "prompt": prompt_len, "new": new}
        for name, values in times.items():
            seconds = statistics.median(values)
            row[name] = batch * (new if kind == "decode" else prompt_len) / seconds
        return row

    print(json.dumps({"kind": "bandwidth", "threads": threads, "gbs": measure_host_bandwidth()}), flush=True)
    for new in args.new_tokens:
        for batch in args.batches:
            print(json.dumps(cell("decode", batch, args.prompt_len, new)), flush=True)
    for prompt_len in args.prefill:
        print(json.dumps(cell("prefill", 1, prompt_len, 1)), flush=True)


def whole_engine(args: argparse.Namespace, model: Any, checkpoint: Any) -> Callable[[Any, int], None]:
    """Our engine on the bare model's weights: requests in, every step until they finish (the
    scheduler, the greedy sampler, stop checks and detokenizing included). No prefix cache: each
    round must prefill as the others do."""
    from engines.runtime import Engine, EngineConfig, GenerationRequest, SamplingParams

    pages = max(args.batches or [1]) * -(-(args.prompt_len + max(args.new_tokens) + 1) // 16)
    pages = max(pages, -(-(max(args.prefill or [0]) + 2) // 16)) + 8
    engine = Engine(model, checkpoint, EngineConfig(max_num_seqs=max(args.batches or [1]), num_pages=pages,
                                                    prefill_chunk_size=max([2048, *args.prefill]), enable_prefix_cache=False))
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
    head_dim = args.hidden // args.heads
    q, kv, inter = args.heads * head_dim, args.kv_heads * head_dim, args.hidden * 11 // 4
    per_layer = args.hidden * (q + 2 * kv) + q * args.hidden + 3 * args.hidden * inter
    return 4 * (args.layers * per_layer + args.vocab * args.hidden)


def main() -> None:
    args = parse_args()
    if args.child is not None:
        child(args)
        return
    make_checkpoint(args)
    print(f"checkpoint: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, "
          f"vocab {args.vocab}, fp32; prompt {args.prompt_len}; medians of {args.rounds} alternated rounds")
    rows = []
    for threads in args.threads:
        command = [sys.executable, __file__, "--child", str(threads), "--rounds", str(args.rounds),
                   "--prompt-len", str(args.prompt_len), "--cache", str(args.cache),
                   "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
                   "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab),
                   "--batches", *map(str, args.batches), "--new-tokens", *map(str, args.new_tokens),
                   "--prefill", *map(str, args.prefill), *(["--engine"] if args.engine else [])]
        child_process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                         env={**os.environ, "PYTHONPATH": str(REPO)})
        assert child_process.stdout is not None
        for line in child_process.stdout:
            row = json.loads(line)
            rows.append(row)
            if row["kind"] == "bandwidth":
                print(f"\n{threads} thread(s): host memory bandwidth {row['gbs']:.1f} GB/s")
                print(f"{'':9}{'batch':>6}{'prompt':>7}{'new':>5}{'ours':>10}{'CT2':>10}{'HF':>10}"
                      f"{'ours/CT2':>10}{'ours/HF':>9}")
                bandwidth = row["gbs"]
                continue
            unit = "tok/s"
            print(f"{row['kind']:<9}{row['batch']:>6}{row['prompt']:>7}{row['new']:>5}{row['ours']:>10.0f}"
                  f"{row['ctranslate2']:>10.0f}{row['transformers']:>10.0f}{row['ours'] / row['ctranslate2']:>10.2f}"
                  f"{row['ours'] / row['transformers']:>9.2f}  {unit}"
                  + (f"  (batch 1: {row['ours'] * weight_bytes(args) / 1e9:.1f} GB/s of weights, "
                     f"{100 * row['ours'] * weight_bytes(args) / 1e9 / bandwidth:.0f}% of the host's)"
                     if row["kind"] == "decode" and row["batch"] == 1 else "")
                  + (f"  engine {row['engine']:.0f} = {row['engine'] / row['ours']:.2f} of ours" if "engine" in row
                     else ""), flush=True)
        if child_process.wait() != 0:
            raise SystemExit(f"the {threads}-thread run failed")


if __name__ == "__main__":
    main()

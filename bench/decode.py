"""Decode throughput: our engine vs transformers (torch eager), same checkpoint, side by side.

For each batch size, both models prefill the same random prompts, then take greedy decode
steps in alternation (ours, torch, ours, torch, ...) so that both see the same machine
load; each step is timed on its own and the table reports the median, as tokens/s
(batch size / step time). A step includes everything a serving loop pays for: the host
metadata upload, the forward pass and copying the greedy ids back.

    python bench/decode.py                                   # CPU, demo model, batch 1 8 32
    python bench/decode.py --backend cuda --torch-device cuda --dtype float16
    python bench/decode.py --backend cuda --torch-device cuda --dtype float16 \
        --random-llama /tmp/llama-1b --torch-compile --profile     # the GPU issue's table

On the GPU the table gives the bytes a step must read (weights and the KV cache) over its time as
a share of the card's peak (``--peak-gbs``, by default the device's memory clock times its bus
width); ``--profile`` adds each kernel's time and bandwidth from the built-in profiler
(``engines.runtime.telemetry.profiler``: each launch between two CUDA events, no graph).

Threads: ``--threads`` (default: all cores) is given to torch, OpenBLAS and numba alike;
it must be set before numpy is imported, which is why the arguments are parsed first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # The repository, not bench/, first on the path, as the benches that import this module have it
    # (bench/kernels.py would shadow the ``kernels`` package transformers looks for).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.results_file import add_results_option, ResultsFile  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="checkpoint folder, or 'demo' (default)")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for both (default: all)")
    parser.add_argument("--torch-device", default="cpu", help="torch device for transformers (cpu, cuda)")
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="device memory bandwidth peak in GB/s for the cuda report (default: the device's own, "
                             "from its memory clock and bus width)")
    parser.add_argument("--random-llama", metavar="DIR", default=None,
                        help="decode a random Llama of TinyLlama-1.1B's shape saved in DIR (made there first if "
                             "DIR has no config.json; needs the torch device to hold it)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time transformers under torch.compile (mode reduce-overhead) with a static KV cache")
    parser.add_argument("--profile", action="store_true",
                        help="after each batch size, a per-kernel table of a few steps from the built-in profiler")
    parser.add_argument("--engines-from", metavar="DIR", default=None,
                        help="import the engine from DIR instead of this checkout (an A/B against an older tree)")
    add_results_option(parser, "decode")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    from bench.cpu_threads import use_threads

    use_threads(ARGS.threads, ARGS.engines_from)

import numpy as np  # noqa: E402  (after the thread settings above)
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engines.runtime import demo_checkpoint_path, ForwardBatch, LlamaModel, load_checkpoint, PagedKVCache  # noqa: E402


class OurDecoder:
    """Greedy decoding of a fixed batch on our engine, with contiguous page tables.

    ``kv``: the cache to write, as an engine keeps one for its life (at least the pages the batch
    needs, of ``page_size`` tokens); none: a new one. A new cache's pages are mapped as the prefill
    first writes them, a sizeable share of a prefill's time
    (docs/perf-log/cpu-anchors.md#2026-11-26-zen5-full-table-2a8ca35)."""

    def __init__(self, model: LlamaModel, prompts: np.ndarray, max_len: int, page_size: int = 16,
                 kv: PagedKVCache | None = None) -> None:
        self.model = model
        batch, prompt_len = prompts.shape
        pages_per_seq = -(-max_len // page_size)
        if kv is None:
            kv = model.new_kv_cache(batch * pages_per_seq, page_size)
        elif kv.page_size != page_size or kv.num_pages < batch * pages_per_seq:
            raise ValueError(f"the KV cache needs {batch * pages_per_seq} pages of {page_size} tokens")
        self.kv = kv
        self.page_table = np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq)
        self.batch = batch
        self.cached = np.zeros(batch, np.int32)
        ids = self._step(prompts.reshape(-1), np.arange(0, batch * prompt_len + 1, prompt_len, dtype=np.int32))
        self.cached += prompt_len
        self.next_ids = ids
        self.decode_starts = np.arange(batch + 1, dtype=np.int32)

    def _step(self, token_ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return self.model.forward_greedy(ForwardBatch(token_ids.astype(np.int32), starts, self.cached, self.page_table),
                                         self.kv)

    def step(self) -> np.ndarray:
        """One decode step for every sequence; returns the new greedy ids."""
        self.next_ids = self._step(self.next_ids, self.decode_starts)
        self.cached += 1
        return self.next_ids


class TorchDecoder:
    """Greedy decoding of the same batch with transformers' KV cache, in eager mode."""

    def __init__(self, model: torch.nn.Module, prompts: np.ndarray, device: str) -> None:
        self.model = model
        self.device = device
        with torch.inference_mode():
            out = model(input_ids=torch.from_numpy(prompts.astype(np.int64)).to(device), use_cache=True,
                        logits_to_keep=1)
        self.past = out.past_key_values
        self.next_ids = out.logits[:, -1].argmax(-1)

    def step(self) -> np.ndarray:
        """One decode step for every sequence; returns the new greedy ids (on the host, which
        also waits for the device)."""
        with torch.inference_mode():
            out = self.model(input_ids=self.next_ids[:, None], past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        self.next_ids = out.logits[:, -1].argmax(-1)
        return self.next_ids.cpu().numpy()


class CompiledTorchDecoder:
    """The same greedy decoding under ``torch.compile`` (reduce-overhead: CUDA graphs) with
    transformers' static KV cache, the fastest plain-PyTorch decode loop transformers offers."""

    def __init__(self, model: torch.nn.Module, prompts: np.ndarray, device: str, max_len: int) -> None:
        from transformers import StaticCache

        self.model = model
        batch, prompt_len = prompts.shape
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        with torch.inference_mode():
            ids = torch.from_numpy(prompts.astype(np.int64)).to(device)
            out = model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                        cache_position=torch.arange(prompt_len, device=device))
        self.position = prompt_len
        self.device = device
        self.next_ids = out.logits[:, -1].argmax(-1)

    def step(self) -> np.ndarray:
        """One decode step for every sequence; returns the new greedy ids on the host."""
        with torch.inference_mode():
            position = torch.tensor([self.position], device=self.device)
            out = self.forward(input_ids=self.next_ids[:, None].clone(), past_key_values=self.cache, use_cache=True,
                               cache_position=position)
        self.position += 1
        self.next_ids = out.logits[:, -1].argmax(-1)
        return self.next_ids.cpu().numpy()


def make_random_llama(folder: Path, device: str) -> None:
    """A Llama of TinyLlama-1.1B's shape with random weights (float16), saved as transformers
    saves one: the issue's 1.1B model, made where it runs (nothing downloads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, torch_dtype="float16")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(folder)
    from tokenizers import models, Tokenizer  # a word-level vocabulary: the bench feeds token ids

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0")).save(
        str(folder / "tokenizer.json"))


def profile_steps(model: LlamaModel, decoder: "OurDecoder", batch: int, steps: int,
                  peak_gbs: float | None) -> list[dict]:
    """``steps`` decode steps under the built-in profiler; its per-kernel rows."""
    from engines.runtime import ProfiledBackend, StepProfiler

    plain = model.backend
    profiler = StepProfiler()
    model.use_backend(ProfiledBackend(plain, profiler))
    try:
        for _ in range(steps):
            profiler.begin_step()
            decoder.step()
            profiler.lap("forward")
            profiler.end_step(batch, batch, 0)
    finally:
        model.use_backend(plain)
    result = profiler.result(engine="bench", model="", backend=plain.name, device=plain.device_name(),
                             peak_gbs=peak_gbs, peak_source="", config={})
    return result.kernels


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of every matrix a decode step streams (norms and biases are negligible)."""
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size) * np.dtype(model.dtype).itemsize


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    path = demo_checkpoint_path() if args.model == "demo" else Path(args.model)
    if args.random_llama:
        path = Path(args.random_llama)
        if not (path / "config.json").exists():
            make_random_llama(path, args.torch_device)
    ckpt = load_checkpoint(path)
    ours_model = LlamaModel.from_checkpoint(ckpt, backend=args.backend, dtype=args.dtype)
    torch_dtype = torch.float16 if args.dtype == "float16" else torch.float32
    torch_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(args.torch_device).eval()
    c = ckpt.config
    print(f"model {ckpt.name}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}/"
          f"{c.num_key_value_heads}, vocab {c.vocab_size}; ours {ours_model.backend_name}/{args.dtype} vs torch "
          f"{torch.__version__} eager on {args.torch_device}; {args.threads} threads; prompt {args.prompt_len}, "
          f"{args.warmup} warm-up + {args.steps} timed steps")

    if args.engines_from:
        import engines

        print(f"engine imported from {Path(engines.__file__).parent}")
    on_gpu = ours_model.backend_name == "cuda"
    peak_gbs = args.peak_gbs
    if on_gpu and peak_gbs is None:
        peak_gbs = ours_model.backend.peak_bandwidth()[0]
    if on_gpu:
        print(f"device {ours_model.backend.device_name()}: peak {peak_gbs:.0f} GB/s; a device-to-device copy through "
              f"torch moves {copy_bandwidth(args.torch_device):.0f} GB/s (bytes read + written)")
    rows, compiled_rows, profiles = [], {}, {}
    rng = np.random.default_rng(0)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = rng.integers(0, c.vocab_size, (batch, args.prompt_len))
        max_len = args.prompt_len + args.warmup + args.steps + 1
        ours = OurDecoder(ours_model, prompts, max_len + (8 if args.profile else 0))
        theirs = TorchDecoder(torch_model, prompts, args.torch_device)
        decoders = [ours.step, theirs.step]
        if args.torch_compile:
            try:
                compiled = CompiledTorchDecoder(torch_model, prompts, args.torch_device, max_len + 8)
                for _ in range(3):  # compiles and records its graphs outside the timed steps
                    compiled.step()
                decoders.append(compiled.step)
            except Exception as exc:  # noqa: BLE001 - a torch/transformers that cannot do it is a reported result
                print(f"batch {batch}: torch.compile with a static cache failed: {type(exc).__name__}: {exc}")
        times: list[list[float]] = [[] for _ in decoders]
        agree = 0
        for i in range(args.warmup + args.steps):
            ids = []
            for d, step in enumerate(decoders):  # alternated, so that all see the same machine load
                t0 = time.perf_counter()
                ids.append(step())
                if i >= args.warmup:
                    times[d].append(time.perf_counter() - t0)
            agree += int((ids[0] == ids[1]).all())
        ours_step, torch_step = statistics.median(times[0]), statistics.median(times[1])
        if len(times) > 2:
            compiled_rows[batch] = batch / statistics.median(times[2])
        context = args.prompt_len + args.warmup + args.steps // 2
        kv_bytes = batch * context * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * np.dtype(
            args.dtype).itemsize
        rows.append((batch, batch / ours_step, batch / torch_step, torch_step / ours_step,
                     (weight_bytes(ours_model) + kv_bytes) / ours_step / 1e9, agree, args.warmup + args.steps))
        if args.profile:
            profiles[batch] = (ours_step, profile_steps(ours_model, ours, batch, 5, peak_gbs))

    for batch, (step_s, kernels) in profiles.items():
        total = sum(k["total_us"] for k in kernels) or 1.0
        print(f"\nbatch {batch}: per-kernel profile over 5 steps (each launch alone, no graph); the graphed step "
              f"took {step_s * 1e6:.0f} us, the kernels alone {total / 5:.0f} us a step")
        print(f"{'kernel':<22} {'calls/step':>10} {'us/step':>9} {'share':>6} {'p50 us':>8} {'GB/s':>8} {'of peak':>8}")
        for k in kernels:
            peak = f"{100 * k['peak_fraction']:.1f}%" if k["peak_fraction"] is not None else "-"
            share = 100 * k["total_us"] / total
            print(f"{k['name']:<22} {k['calls'] / 5:>10.0f} {k['total_us'] / 5:>9.1f} {share:>5.1f}% "
                  f"{k['p50_us']:>8.1f} {k['gbs']:>8.0f} {peak:>8}")

    compiled_header = f" {'compiled tok/s':>14} {'ours/compiled':>13}" if compiled_rows else ""
    peak_header = f" {'of peak':>8}" if on_gpu else ""
    print(f"\n{'batch':>5} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>7}{compiled_header} {'ours GB/s':>10}"
          f"{peak_header} {'same greedy ids':>16}")
    results = ResultsFile(args.results, "decode")
    setting = {"model": ckpt.name, "backend": ours_model.backend_name, "dtype": args.dtype, "threads": args.threads}
    for batch, ours_tps, torch_tps, ratio, gbs, agree, steps in rows:
        compiled = compiled_rows.get(batch)
        compiled_cells = ""
        if compiled_rows:
            compiled_cells = (f" {compiled:>14.1f} {ours_tps / compiled:>12.2f}x" if compiled is not None
                              else f" {'failed':>14} {'-':>13}")
        share = f" {100 * gbs / peak_gbs:>7.1f}%" if on_gpu and peak_gbs else ""
        print(f"{batch:>5} {ours_tps:>11.1f} {torch_tps:>12.1f} {ratio:>6.2f}x{compiled_cells} {gbs:>10.1f}{share} "
              f"{agree:>9}/{steps} steps")
        for metric, value, unit in (("ours", ours_tps, "tok/s"), ("transformers", torch_tps, "tok/s"),
                                    ("ours/transformers", ratio, "ratio"), ("ours, weights + KV read", gbs, "GB/s")):
            results.add(metric, value, unit, batch=batch, **setting)
        if compiled is not None:
            results.add("transformers compiled", compiled, "tok/s", batch=batch, **setting)
            results.add("ours/transformers compiled", ours_tps / compiled, "ratio", batch=batch, **setting)
        if on_gpu and peak_gbs:
            results.add("ours, share of the memory's peak", 100 * gbs / peak_gbs, "%", batch=batch, **setting)
    return 0


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` through torch (bytes read plus written),
    the best of five after a warm-up: the ceiling the decode's share is read against."""
    source = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        target.copy_(source)
        ended.record()
        ended.synchronize()
        best = min(best, began.elapsed_time(ended) / 1e3)
    del source, target
    return 2 * nbytes / best / 1e9


if __name__ == "__main__":
    sys.exit(main(ARGS))

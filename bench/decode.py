"""Decode throughput: our engine vs transformers (torch eager), same checkpoint, side by side.

For each batch size, both models prefill the same random prompts, then take greedy decode
steps in alternation (ours, torch, ours, torch, ...) so that both see the same machine
load; each step is timed on its own and the table reports the median, as tokens/s
(batch size / step time). A step includes everything a serving loop pays for: the host
metadata upload, the forward pass and copying the greedy ids back.

    python bench/decode.py                                   # CPU, demo model, batch 1 8 32
    python bench/decode.py --backend cuda --torch-device cuda --dtype float16

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
    parser.add_argument("--peak-gbs", type=float, default=3350.0,
                        help="device memory bandwidth peak in GB/s for the cuda report (default: H100 SXM)")
    add_results_option(parser, "decode")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    from bench.cpu_threads import use_threads

    use_threads(ARGS.threads)

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


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of every matrix a decode step streams (norms and biases are negligible)."""
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size) * np.dtype(model.dtype).itemsize


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    path = demo_checkpoint_path() if args.model == "demo" else Path(args.model)
    ckpt = load_checkpoint(path)
    ours_model = LlamaModel.from_checkpoint(ckpt, backend=args.backend, dtype=args.dtype)
    torch_dtype = torch.float16 if args.dtype == "float16" else torch.float32
    torch_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(args.torch_device).eval()
    c = ckpt.config
    print(f"model {ckpt.name}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}/"
          f"{c.num_key_value_heads}, vocab {c.vocab_size}; ours {ours_model.backend_name}/{args.dtype} vs torch "
          f"{torch.__version__} eager on {args.torch_device}; {args.threads} threads; prompt {args.prompt_len}, "
          f"{args.warmup} warm-up + {args.steps} timed steps")

    rows = []
    rng = np.random.default_rng(0)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = rng.integers(0, c.vocab_size, (batch, args.prompt_len))
        ours = OurDecoder(ours_model, prompts, args.prompt_len + args.warmup + args.steps + 1)
        theirs = TorchDecoder(torch_model, prompts, args.torch_device)
        ours_times, torch_times, agree = [], [], 0
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            a = ours.step()
            t1 = time.perf_counter()
            b = theirs.step()
            t2 = time.perf_counter()
            agree += int((a == b).all())
            if i >= args.warmup:
                ours_times.append(t1 - t0)
                torch_times.append(t2 - t1)
        ours_step, torch_step = statistics.median(ours_times), statistics.median(torch_times)
        context = args.prompt_len + args.warmup + args.steps // 2
        kv_bytes = batch * context * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * np.dtype(
            args.dtype).itemsize
        rows.append((batch, batch / ours_step, batch / torch_step, torch_step / ours_step,
                     (weight_bytes(ours_model) + kv_bytes) / ours_step / 1e9, agree, args.warmup + args.steps))

    print(f"\n{'batch':>5} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>7} {'ours GB/s':>10} "
          f"{'same greedy ids':>16}")
    results = ResultsFile(args.results, "decode")
    setting = {"model": ckpt.name, "backend": ours_model.backend_name, "dtype": args.dtype, "threads": args.threads}
    for batch, ours_tps, torch_tps, ratio, gbs, agree, steps in rows:
        print(f"{batch:>5} {ours_tps:>11.1f} {torch_tps:>12.1f} {ratio:>6.2f}x {gbs:>10.1f} {agree:>9}/{steps} steps")
        for metric, value, unit in (("ours", ours_tps, "tok/s"), ("transformers", torch_tps, "tok/s"),
                                    ("ours/transformers", ratio, "ratio"), ("ours, weights + KV read", gbs, "GB/s")):
            results.add(metric, value, unit, batch=batch, **setting)
    if ours_model.backend_name == "cuda":
        batch, _, _, _, gbs, _, _ = rows[-1]
        print(f"\nbatch {batch}: {gbs:.0f} GB/s of weights + KV streamed per step = "
              f"{100 * gbs / args.peak_gbs:.1f}% of a {args.peak_gbs:.0f} GB/s peak")
        results.add("ours, share of the memory's peak", 100 * gbs / args.peak_gbs, "%", batch=batch, **setting)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))

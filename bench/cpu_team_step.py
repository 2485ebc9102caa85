"""Batch-1 decode on the CPU: the compiled step as a thread team against the same step forking
numba's threads for each kernel, step by step in turn.

A step of one token runs as one parallel region whose members meet at spin barriers
(``cpu_step.one_token_team_step``), unless the model's team was called off: then the compiled step
calls each kernel's own ``prange`` (an OpenMP fork and join each, ~45 a step). This bench flips
that switch (``CpuDecodeStep.team``) between consecutive steps of the same greedy
generations, so that both forms see the same contexts and the same memory spells (a machine's
read rate may switch between a slow and a fast spell for minutes at a time:
docs/perf-log/cpu-anchors.md#2026-11-26-one-numba-call-a-step), on issue 15's
checkpoint (``bench/cpu_anchors.py`` makes it), or with ``--gguf`` on one of the judge's GGUF files
(``bench/gguf_vs_llamacpp.py``) with its weights kept quantized, or with ``--big LAYERS`` on a random
model of TinyLlama-1.1B's layer shape (hidden 2048, MLP 5632, 32 heads, 4 KV heads, 32,000 tokens)
with its matrices quantized as SmolLM2's file holds its own (Q4_1, the LM head Q8_0): matrices of
2-7 MB where SmolLM2's are 0.07-1.1 MB, so that a step's fixed costs (barriers, norms, attention)
weigh less against its weights' bytes. ``kernels`` adds a third form:
the model launching kernel by kernel from Python (``LlamaModel.cpu_step`` None), the path a
quantized model took before the compiled step read quantized weights. It prints each
generation's median step of each form and their share of the host's read rate
(``measure_host_bandwidth`` of as many bytes as a step's weights, read before each generation: a
read of 128 MB, on a host whose last-level cache holds 32 MB, ran at up to twice the rate of a read
of 1 GB), then the ratios of the medians, over all steps and by spell.

    .venv/bin/python bench/cpu_team_step.py --threads 2 --new-tokens 128 512 --generations 12
    .venv/bin/python bench/cpu_team_step.py --gguf q4_1 --forms team omp kernels --new-tokens 128
    .venv/bin/python bench/cpu_team_step.py --big 8 --forms team --new-tokens 64 --generations 6
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.results_file import add_results_option, ResultsFile  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--generations", type=int, default=12, help="generations of each length")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--gguf", choices=["q4_1", "q8_0", "q4_k_m"],
                        help="a judge's GGUF file, kept quantized, instead of issue 15's float32 checkpoint")
    parser.add_argument("--big", type=int, metavar="LAYERS",
                        help="a random Q4_1 model of TinyLlama-1.1B's layer shape, this many layers")
    parser.add_argument("--forms", nargs="+", choices=["team", "omp", "kernels"], default=["team", "omp"],
                        help="the step's forms, in turn (the first is the ratios' numerator)")
    add_results_option(parser, "cpu_team_step")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from bench.cpu_threads import use_threads

    use_threads(args.threads)
    import numpy as np

    from bench import cpu_anchors
    from bench.decode import OurDecoder
    from engines.runtime import LlamaModel, load_checkpoint, measure_host_bandwidth

    if args.gguf:
        from bench import gguf_vs_llamacpp

        made = args.gguf != "q4_1"  # the others llama.cpp quantizes, once
        path = gguf_vs_llamacpp.gguf_files([args.gguf], gguf_vs_llamacpp.llamacpp_python() if made else Path())
        model = LlamaModel.from_checkpoint(load_checkpoint(path[args.gguf], keep_quantized=True), backend="cpu")
        weight_bytes, vocab = model.weight_bytes, model.config.vocab_size
        print(f"{args.gguf}: {model.weights_format}")
    elif args.big:
        model = big_quantized_model(args.big)
        # Its embedding (float32, untied) is not read whole by a step: one row of it.
        weight_bytes, vocab = model.weight_bytes - model.embed_tokens.nbytes, model.config.vocab_size
        print(f"{args.big} layers of TinyLlama-1.1B's shape: {model.weights_format}")
    else:
        anchors = cpu_anchors.parse_args([])
        hf, _ = cpu_anchors.make_checkpoint(anchors)
        model = LlamaModel.from_checkpoint(load_checkpoint(hf), backend="cpu")
        weight_bytes, vocab = cpu_anchors.weight_bytes(anchors), anchors.vocab
    step = model.cpu_step
    if step is None:
        raise SystemExit("this model has no compiled step")
    forms = tuple(args.forms)
    first, second = forms[0], forms[1] if len(forms) > 1 else forms[0]
    prompt = np.random.default_rng(0).integers(3, vocab, (1, args.prompt_len)).astype(np.int32)
    results = ResultsFile(args.results, "cpu_team_step")
    print(f"{args.threads} thread(s), batch 1, {weight_bytes / 1e6:.1f} MB of weights a step")
    for new in args.new_tokens:
        kv = model.new_kv_cache(-(-(args.prompt_len + new + 1) // 16), 16)
        steps: dict[str, list[float]] = {form: [] for form in forms}
        by_spell: dict[str, list[tuple[float, float, float]]] = {form: [] for form in forms}
        for generation in range(args.generations + 1):  # the first warms up, untimed
            gbs = measure_host_bandwidth(weight_bytes)
            decoder = OurDecoder(model, prompt, args.prompt_len + new + 1, kv=kv)
            times: dict[str, list[float]] = {form: [] for form in forms}
            for i in range(new - 1):
                form = forms[(i + generation) % len(forms)]
                step.team = form == "team"
                model.cpu_step = None if form == "kernels" else step
                began = time.perf_counter()
                decoder.step()
                times[form].append(time.perf_counter() - began)
            step.team = True
            model.cpu_step = step
            if generation == 0:
                continue
            medians = {form: statistics.median(times[form]) for form in forms}
            for form in forms:
                steps[form].extend(times[form])
                by_spell[form].append((gbs, medians[form], weight_bytes / medians[form] / 1e9 / gbs))
            print(f"  {new} new, generation {generation}: host {gbs:.1f} GB/s; "
                  + "; ".join(f"{form} {medians[form] * 1e3:.3f} ms a step ({by_spell[form][-1][2]:.0%})"
                              for form in forms), flush=True)
        run, called_off = step.team_steps
        if called_off:
            raise SystemExit(f"the team was called off ({called_off}): every step forked per kernel")
        model_name = {"model": args.gguf} if args.gguf else {"model": f"big-{args.big}"} if args.big else {}
        for other in forms[1:]:
            ratio = statistics.median(steps[first]) / statistics.median(steps[other])
            print(f"{new} new: {first}/{other}, median step over all steps: {ratio:.3f}")
            results.add(f"{first}/{other}, median step", ratio, "ratio", threads=args.threads, new=new,
                        spell="all steps", **model_name)
        rates = sorted(gbs for gbs, _, _ in by_spell[first])
        split = (rates[0] + rates[-1]) / 2 if rates[-1] > 1.3 * rates[0] else 0.0  # else one spell throughout
        spells = (("slow spell", lambda gbs, split=split: gbs < split),
                  ("fast spell", lambda gbs, split=split: gbs >= split)) if split \
            else (("one spell", lambda gbs: True),)
        for spell, pick in spells:
            pairs = [(t[1], o[1], t[2], o[2])
                     for t, o in zip(by_spell[first], by_spell[second], strict=True) if pick(t[0])]
            if pairs:
                first_share, second_share = (statistics.median(p[i] for p in pairs) for i in (2, 3))
                first_over_second = statistics.median(p[0] / p[1] for p in pairs)
                print(f"  {spell} ({len(pairs)} generations): {first}/{second} "
                      f"{first_over_second:.3f}; share of the host's read rate "
                      f"{first} {first_share:.1%}, {second} {second_share:.1%}")
                where = {"threads": args.threads, "new": new, "spell": spell, **model_name}
                results.add(f"{first}/{second}, median step", first_over_second, "ratio", **where)
                results.add(f"{first}, share of the host's read rate", 100 * first_share, "%", **where)
                results.add(f"{second}, share of the host's read rate", 100 * second_share, "%", **where)


def big_quantized_model(layers: int):  # noqa: ANN201 - a LlamaModel, imported after the thread counts are set
    """``--big``'s model: bench/cpu_anchors.py's random checkpoint of TinyLlama-1.1B's layer shape,
    its projections quantized to Q4_1 and its LM head to Q8_0 by the ``gguf`` package, kept so."""
    import dataclasses

    import gguf

    from bench import cpu_anchors
    from engines.runtime import LlamaModel, QuantizedWeight, load_checkpoint

    shape = cpu_anchors.parse_args(["--hidden", "2048", "--layers", str(layers), "--heads", "32", "--kv-heads", "4",
                                    "--vocab", "32000"])
    checkpoint = load_checkpoint(cpu_anchors.hf_checkpoint(shape))
    weights = {}
    for name, values in checkpoint.weights.items():
        kind = "Q8_0" if name == "lm_head.weight" else "Q4_1" if name.endswith("_proj.weight") else None
        weights[name] = values if kind is None else QuantizedWeight.from_blocks(
            gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]).reshape(-1), kind, values.shape)
    return LlamaModel.from_checkpoint(dataclasses.replace(checkpoint, weights=weights), backend="cpu")


if __name__ == "__main__":
    main()

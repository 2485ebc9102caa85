"""Batch-1 decode on the CPU: the compiled step as a thread team against the same step forking
numba's threads for each kernel, step by step in turn.

A step of one token runs as one parallel region whose members meet at spin barriers
(``cpu_step.one_token_team_step``), unless the model's team was called off: then the compiled step
calls each kernel's own ``prange`` (an OpenMP fork and join each, ~45 a step). This bench flips
that switch (``CpuDecodeStep.team``) between consecutive steps of the same greedy
generations, so that both forms see the same contexts and the same memory spells (a machine's
read rate may switch between a slow and a fast spell for minutes at a time:
docs/perf-log/cpu-anchors.md#2026-11-26-one-numba-call-a-step), on issue 15's
checkpoint (``bench/cpu_anchors.py`` makes it). It prints each generation's median step of each
form and their share of the host's read rate (``measure_host_bandwidth``, read before each
generation), then the ratios of the medians, over all steps and by spell.

    .venv/bin/python bench/cpu_team_step.py --threads 2 --new-tokens 128 512 --generations 12
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

    anchors = cpu_anchors.parse_args([])
    hf, _ = cpu_anchors.make_checkpoint(anchors)
    model = LlamaModel.from_checkpoint(load_checkpoint(hf), backend="cpu")
    step = model.cpu_step
    weight_bytes = cpu_anchors.weight_bytes(anchors)
    forms = ("team", "omp")
    prompt = np.random.default_rng(0).integers(3, anchors.vocab, (1, args.prompt_len)).astype(np.int32)
    results = ResultsFile(args.results, "cpu_team_step")
    print(f"{args.threads} thread(s), batch 1, {weight_bytes / 1e6:.1f} MB of weights a step")
    for new in args.new_tokens:
        kv = model.new_kv_cache(-(-(args.prompt_len + new + 1) // 16), 16)
        steps: dict[str, list[float]] = {form: [] for form in forms}
        by_spell: dict[str, list[tuple[float, float, float]]] = {form: [] for form in forms}
        for generation in range(args.generations + 1):  # the first warms up, untimed
            gbs = measure_host_bandwidth()
            decoder = OurDecoder(model, prompt, args.prompt_len + new + 1, kv=kv)
            times: dict[str, list[float]] = {form: [] for form in forms}
            for i in range(new - 1):
                form = forms[(i + generation) % 2]
                step.team = form == "team"
                began = time.perf_counter()
                decoder.step()
                times[form].append(time.perf_counter() - began)
            step.team = True
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
        ratio = statistics.median(steps["team"]) / statistics.median(steps["omp"])
        print(f"{new} new: team/omp, median step over all steps: {ratio:.3f}")
        results.add("team/omp, median step", ratio, "ratio", threads=args.threads, new=new, spell="all steps")
        rates = sorted(gbs for gbs, _, _ in by_spell["team"])
        split = (rates[0] + rates[-1]) / 2 if rates[-1] > 1.3 * rates[0] else 0.0  # else one spell throughout
        spells = (("slow spell", lambda gbs, split=split: gbs < split),
                  ("fast spell", lambda gbs, split=split: gbs >= split)) if split \
            else (("one spell", lambda gbs: True),)
        for spell, pick in spells:
            pairs = [(t[1], o[1], t[2], o[2])
                     for t, o in zip(by_spell["team"], by_spell["omp"], strict=True) if pick(t[0])]
            if pairs:
                team_share, omp_share = (statistics.median(p[i] for p in pairs) for i in (2, 3))
                team_over_omp = statistics.median(p[0] / p[1] for p in pairs)
                print(f"  {spell} ({len(pairs)} generations): team/omp "
                      f"{team_over_omp:.3f}; share of the host's read rate "
                      f"team {team_share:.1%}, omp {omp_share:.1%}")
                where = {"threads": args.threads, "new": new, "spell": spell}
                results.add("team/omp, median step", team_over_omp, "ratio", **where)
                results.add("team, share of the host's read rate", 100 * team_share, "%", **where)
                results.add("omp, share of the host's read rate", 100 * omp_share, "%", **where)


if __name__ == "__main__":
    main()

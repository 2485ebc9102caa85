"""Two commits of this repo, one bench, alternated in one run: does a change move a figure beyond noise?

Each commit is checked out once into a worktree of its own (``var/bench-ab/<commit>``, the
repository's virtualenv linked in), and the bench runs there ``--rounds`` times per side, the two
sides taking turns (which goes first alternates by round), each run appending its figures to that
side's results file (``bench/results_file.py``'s format; ``--results`` is added to the bench's own
arguments). Then, for every figure both sides measured (bench, metric, parameters), the median of
each side's rounds and the ratio of the two runs of each round (new / baseline, side by side in
time: a load that came and went slowed both), their median and range: **beyond noise** where every
round's ratio lies on the same side of 1 (with 5 rounds, a chance of 1 in 16 when nothing changed),
else "within noise" (one round has no spread to judge by). The table is Markdown, for a commit
message or a pull request.

    .venv/bin/python scripts/commits_ab.py ad0fff1 HEAD --rounds 5 -- bench/decode.py --batch-sizes 1,8
    .venv/bin/python scripts/commits_ab.py ad0fff1 HEAD -- bench/engine_throughput.py
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_file import this_machine  # noqa: E402
WORKTREES = REPO / "var" / "bench-ab"


def resolve(commit: str) -> str:
    """``commit``'s full hash."""
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], capture_output=True, text=True,
                          check=True).stdout.strip()


def worktree(commit: str) -> Path:
    """A checkout of ``commit`` (made once), with the repository's virtualenv linked in."""
    path = WORKTREES / commit[:12]
    if not (path / ".git").exists():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), commit], check=True,
                       capture_output=True)
    venv = path / ".venv"
    if not venv.exists():
        venv.symlink_to(REPO / ".venv")
    return path


def run_side(path: Path, bench: list[str], results: Path) -> float:
    """The bench once in ``path``, its figures appended to ``results``; its wall seconds."""
    began = time.perf_counter()
    done = subprocess.run([str(REPO / ".venv" / "bin" / "python"), *bench, "--results", str(results)], cwd=path,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(bench)} failed in {path} (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"\n{done.stderr[-2000:]}")
    return time.perf_counter() - began


def figures(results: Path) -> dict[tuple[str, str, str], list[float]]:
    """Every figure of ``results``, by (bench, metric, parameters): its values, one a round."""
    out: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for line in results.read_text().splitlines():
        if line.strip():
            row = orjson.loads(line)
            params = ", ".join(f"{k}={v}" for k, v in sorted((row.get("params") or {}).items()))
            out[(row["bench"], f"{row['metric']} ({row.get('unit', '')})", params)].append(float(row["value"]))
    return out


def table(baseline: dict[tuple[str, str, str], list[float]], new: dict[tuple[str, str, str], list[float]]) -> str:
    """Markdown: each figure both sides hold, each side's median, and the rounds' paired ratios
    (new / baseline of the same round: a load that came and went slowed both sides of its round)."""
    lines = ["| bench | metric | parameters | baseline (median) | new (median) | new/baseline (median of rounds) "
             "| rounds' ratios | verdict |", "|---|---|---|---:|---:|---:|---|---|"]
    for key in sorted(set(baseline) & set(new)):
        a, b = baseline[key], new[key]
        ratios = [y / x for x, y in zip(a, b, strict=False) if x]
        if not ratios:
            continue
        spread = f"{min(ratios):.3f} .. {max(ratios):.3f}"
        verdict = ("one round: no spread" if len(ratios) < 2 else
                   "beyond noise" if min(ratios) > 1 or max(ratios) < 1 else "within noise")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {statistics.median(a):.4g} | {statistics.median(b):.4g} | "
                     f"{statistics.median(ratios):.3f} | {spread} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("baseline", help="the commit before")
    parser.add_argument("new", help="the commit after")
    parser.add_argument("--rounds", type=int, default=5)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if not bench:
        parser.error("name the bench after --: -- bench/decode.py ...")
    sides = {name: resolve(commit) for name, commit in (("baseline", args.baseline), ("new", args.new))}
    paths = {name: worktree(commit) for name, commit in sides.items()}
    stamp = time.strftime("%Y%m%dT%H%M%S")
    files = {name: WORKTREES / f"{stamp}-{name}-{commit[:12]}.jsonl" for name, commit in sides.items()}
    for round_ in range(args.rounds):
        order = ["baseline", "new"] if round_ % 2 == 0 else ["new", "baseline"]
        for name in order:
            seconds = run_side(paths[name], bench, files[name])
            print(f"round {round_ + 1}/{args.rounds}: {name} ({sides[name][:9]}) in {seconds:.0f} s", flush=True)
    print(f"\n{' '.join(bench)}, {args.rounds} rounds alternated; {this_machine()['cpu']}; "
          f"baseline {sides['baseline'][:9]}, new {sides['new'][:9]}\n")
    print(table(figures(files["baseline"]), figures(files["new"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""BENCHMARKS.md's tables of current figures, made from the benches' results files; and two sets of
results compared figure by figure.

Every bench appends what it measures to ``bench/results/<bench>.jsonl`` (``bench/results_file.py``):
one JSON object a figure, with its parameters, machine, commit, date and command. A figure's current
value is the latest recorded for its bench, metric, parameters and machine; a table row shows the
figures of the latest run that measured it, so a row never mixes two runs. ``VIEWS`` says what each
table of BENCHMARKS.md shows; the tables sit between ``<!-- bench_report: NAME -->`` and
``<!-- /bench_report -->``, and ``tests/test_bench_report.py`` fails when they differ from what this
script makes of ``bench/results/``, or when the page is over ``MAX_PAGE_BYTES`` (``check`` says so too).

    .venv/bin/python scripts/bench_report.py tables           # print every table
    .venv/bin/python scripts/bench_report.py update           # write them into BENCHMARKS.md
    .venv/bin/python scripts/bench_report.py compare OLD.jsonl NEW.jsonl
    .venv/bin/python scripts/bench_report.py compare bench/results/cpu_anchors.jsonl \\
        --baseline-commit 55395b7 --commit 790cd64

``compare`` joins the two sides on bench, metric, parameters and machine (``--ignore-machine``: not
the machine) and gives new / baseline for each figure both have, as llama.cpp's
``compare-llama-bench.py`` and vLLM's ``compare-json-results.py`` do.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BENCHMARKS = REPO / "BENCHMARKS.md"
#: The most BENCHMARKS.md may hold (``check`` fails past it): the current tables and how each is
#: measured; what runs showed, and how the figures came about, go to docs/perf-log/.
MAX_PAGE_BYTES = 40_000
BLOCK = re.compile(r"(<!-- bench_report: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench_report -->)", re.S)


#: The short name each machine goes by in the tables and their lists of runs, by the name it was
#: recorded under (``Result.machine_name``): the long names, a row each, made the page a third
#: longer. BENCHMARKS.md's machines table gives both. A machine not listed shows its recorded name.
MACHINE_LABELS: dict[str, str] = {
    "AMD EPYC (Zen 5, family 26 model 2)": "Zen 5",
    "AMD EPYC (Zen 5, family 26)": "Zen 5 (family 26)",
    "AMD EPYC (Zen 4, family 25 model 17)": "Zen 4",
    "AMD EPYC (Zen 3, family 25 model 1)": "Zen 3",
    "Intel Xeon (Emerald Rapids, family 6 model 207)": "Emerald Rapids",
    "Intel Xeon (AMX, family 6 model 167)": "Xeon AMX",
    "Intel Xeon (family 6 model 167)": "Xeon (model 167)",
    "2-core x86-64 (model not recorded)": "2-core x86-64",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H200": "H200",
}


def machine_label(name: str) -> str:
    """What the tables call the machine recorded as ``name``."""
    return MACHINE_LABELS.get(name, name)


@dataclass(frozen=True, eq=False)
class Result:
    """One figure of a results file, and its place among all the figures read (later is newer on a tie)."""

    bench: str
    metric: str
    value: float
    unit: str
    params: Mapping[str, Any]
    machine: Mapping[str, Any]
    commit: str | None
    date: str
    command: str
    order: int

    @property
    def machine_name(self) -> str:
        """The GPU where the machine has one, else the CPU."""
        return self.machine.get("gpu") or self.machine["cpu"]

    def key(self, with_machine: bool = True) -> tuple:
        """What makes two records the same figure measured again."""
        params = tuple(sorted((name, repr(value)) for name, value in self.params.items()))
        return self.bench, self.metric, params, self.machine_name if with_machine else ""

    @property
    def run(self) -> tuple[str, str, str | None, str]:
        """The run that measured it: machine, date, commit, command."""
        return self.machine_name, self.date, self.commit, self.command

    def field(self, name: str) -> str:
        """A field as a table shows it: ``metric``, ``machine`` (its label), or a parameter (empty
        when absent)."""
        if name == "metric":
            return self.metric
        if name == "machine":
            return machine_label(self.machine_name)
        value = self.params.get(name)
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, int) and value >= 10_000:
            return f"{value:,}"
        return "" if value is None else str(value)


def load(paths: Iterable[Path]) -> list[Result]:
    """Every record of these files (a folder: its ``*.jsonl``), in the order they were written."""
    files = [f for path in paths for f in (sorted(path.glob("*.jsonl")) if path.is_dir() else [path])]
    results = []
    for file in files:
        for number, line in enumerate(file.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
                results.append(Result(record["bench"], record["metric"], record["value"], record["unit"],
                                      record.get("params") or {}, record["machine"], record.get("commit"),
                                      record["date"], record.get("command", ""), len(results)))
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                raise SystemExit(f"{file}:{number}: not a results record ({exc}); each line is one JSON object "
                                 "with bench, metric, value, unit, params, machine, commit, date, command") from None
    return results


def current(results: Iterable[Result], with_machine: bool = True) -> list[Result]:
    """The latest record of each figure (by date, then by the order written), in the order each
    figure was first recorded."""
    first: dict[tuple, int] = {}
    latest: dict[tuple, Result] = {}
    for r in results:
        key = r.key(with_machine)
        first.setdefault(key, r.order)
        held = latest.get(key)
        if held is None or (r.date, r.order) >= (held.date, held.order):
            latest[key] = r
    return sorted(latest.values(), key=lambda r: first[r.key(with_machine)])


@dataclass(frozen=True)
class View:
    """One table of BENCHMARKS.md: a bench's current figures, the fields that make its rows, and
    those that make its columns (each column's header their values; no columns: one of values).
    ``name`` is the block it goes in; the views of one block share its list of runs."""

    name: str
    bench: str
    rows: tuple[str, ...]
    columns: tuple[str, ...] = ("metric",)
    metrics: tuple[str, ...] = ()  # the metrics shown, in this order; none: all
    where: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # a field's values shown, in this order

    def shows(self, r: Result) -> bool:
        return (r.bench == self.bench and (not self.metrics or r.metric in self.metrics)
                and all(r.field(name) in values for name, values in self.where.items()))

    def listed(self, name: str) -> tuple[str, ...]:
        """The order a field's values are shown in, where ``metrics`` or ``where`` gives one."""
        return self.metrics if name == "metric" else tuple(self.where.get(name, ()))


ZEN5 = machine_label("AMD EPYC (Zen 5, family 26)")
ZEN5_2 = machine_label("AMD EPYC (Zen 5, family 26 model 2)")
ZEN4 = machine_label("AMD EPYC (Zen 4, family 25 model 17)")
ZEN3 = machine_label("AMD EPYC (Zen 3, family 25 model 1)")
EMERALD_RAPIDS = machine_label("Intel Xeon (Emerald Rapids, family 6 model 207)")
XEON_AMX = machine_label("Intel Xeon (AMX, family 6 model 167)")
ANCHOR_COLUMNS = ("ours", "CTranslate2", "transformers", "ours/CT2")

VIEWS = (
    View("decode", "decode", ("machine", "model", "dtype", "threads"), columns=("batch", "metric"),
         metrics=("ours", "transformers", "ours/transformers", "ours, weights + KV read")),
    View("decode-gpu", "decode", ("machine", "model", "dtype"), columns=("batch", "metric"),
         metrics=("ours", "transformers compiled", "ours/transformers compiled", "ours, weights + KV read",
                  "ours, share of the memory's peak"),
         where={"backend": ("cuda",), "dtype": ("float16",), "batch": ("1", "8", "32")}),
    View("engine", "engine_throughput", ("machine", "dtype", "workload", "requests", "of two runs"),
         metrics=("generated", "total", "wall", "tracing off", "tracing on", "on/off")),
    View("engine", "trace_recorder", ("metric", "events"), columns=("workload",)),
    View("server", "serve_load", ("machine", "threads"), columns=("clients", "metric"),
         metrics=("engine alone", "HTTP", "HTTP/engine", "HTTP TTFT p50", "HTTP TTFT p99", "dump_engine_metrics p99"),
         where={"engine_mode": ("process",), "client": ("raw",), "max_tokens": ("64",)}),
    View("trace-history", "trace_history", ("metric", "database", "page"), columns=(),
         metrics=("save_trace, bytes (dump_json)", "save_trace, dict (dump)", "server time"),
         where={"page": ("", "trace list", "trace list, page 500", "request list", "request list, engine + e2e desc",
                         "trace detail (the saved trace)")}),
    View("smollm2", "smollm2", ("load",), metrics=("metadata", "checkpoint", "model ready")),
    View("smollm2", "smollm2", ("batch", "new_tokens"), columns=("threads", "metric"),
         metrics=("ours", "transformers", "CTranslate2", "ours/HF", "ours/CT2")),
    View("first-start", "first_start", ("phase",),
         metrics=("to /health", "burst of 8", "max TTFT", "first save trace", "first profile start", "profile stop")),
    View("engine", "engine_lifecycle", ("metric", "statistic"), columns=(),
         where={"statistic": ("median", "")}),
    View("fan-out", "ws_fanout", ("channel_layer", "cores"),
         metrics=("missed deliveries", "latency p50", "latency p99 (worst round)", "server CPU per viewer-second",
                  "engine, viewers", "engine, none", "engine, viewers/none")),
    View("timeline", "timeline", ("machine", "events_asked"),
         metrics=("events", "gzip", "open -> usable", "data arrived -> first frame", "zoom: frame p95",
                  "pan: frame p95", "zoom: draw p95", "pan: draw p95"), where={"part": ("saved trace",)}),
    View("timeline", "timeline", ("machine", "viewer"),
         metrics=("engine", "engine, viewer/none", "behind the engine p50", "behind the engine p99",
                  "cores used: server", "cores used: engine", "cores used: browser"), where={"part": ("live",)}),
    View("profiler", "profiler_overhead", ("runtime",), metrics=("median total", "off/before", "on/off")),
    View("otel", "otel_overhead", ("machine", "mode"),
         metrics=("requests/s", "vs off", "off path a request", "span work a request")),
    View("replay", "replay", ("machine", "server"), columns=("metric",),
         metrics=("output tokens/s", "TTFT p50", "ITL p50", "E2E p50")),
    View("watchdog", "watchdog_overhead", ("machine", "threads", "watchdog"),
         metrics=("decode", "on/off", "board writes a step", "a poll", "cost from the parts")),
    View("metrics-truth", "metrics_truth", ("model", "source", "metric"), columns=("machine", "concurrency")),
    View("tools", "tools", ("machine", "metric"), columns=("tool",),
         metrics=("ttft mean", "ttft p99", "itl mean", "request latency mean", "output tokens/s", "requests/s",
                  "output tokens per request", "acc", "acc_norm")),
    View("cpu-anchors", "cpu_anchors", ("cell",), columns=("threads", "machine"), metrics=("ours/CT2",),
         where={"machine": (ZEN5, ZEN4, ZEN3, EMERALD_RAPIDS, XEON_AMX)}),
    View("cpu-anchors", "cpu_anchors", ("cell",), columns=("threads", "metric"), metrics=ANCHOR_COLUMNS,
         where={"machine": (ZEN4,)}),
    View("disagg", "disagg", ("split_cores",), columns=("setup", "metric"), metrics=("output", "TTFT p50", "TTFT p99"),
         where={"part": ("load",)}),
    View("disagg", "disagg", ("window_tokens",),
         metrics=("window", "K/V transfer", "plain loopback", "transfer/plain"), where={"part": ("transfer",)}),
    View("fleet", "fleet", ("metric",), columns=("servers", "boards"), where={"part": ("redis",)},
         metrics=("Redis commands per server-second, no page open", "Redis bytes in per server-second, no page open",
                  "Redis bytes out per server-second, 10 members with pages open",
                  "row age when pushed to a page, p99, 10 members with pages open",
                  "row age when pushed to a page, p99, 1 member with pages open",
                  "member CPU per server-second, no page open", "fleet view assembly")),
    View("fleet", "fleet", ("metric", "servers", "engines"), columns=(), where={"part": ("browser",)}),
    View("quantized-matmul", "quantized_matmul", ("machine", "threads", "type", "rows"),
         metrics=("quantized pass", "float32 pass", "float32/quantized", "read of the same bytes",
                  "quantized of read")),
    View("quantized-matmul", "quantized_matmul", ("machine", "weights", "batch", "new_tokens"),
         metrics=("engine decode",)),
    # Ours/llama.cpp on each machine, then the tok/s and the accuracy on one (as the CPU anchors').
    View("gguf-vs-llamacpp", "gguf_vs_llamacpp", ("threads", "file", "cell"), columns=("machine",),
         metrics=("ours/llama.cpp",), where={"machine": (ZEN5_2, ZEN4, ZEN3, EMERALD_RAPIDS, XEON_AMX)}),
    View("gguf-vs-llamacpp", "gguf_vs_llamacpp", ("threads", "file", "cell"),
         metrics=("ours", "llama.cpp", "ours/llama.cpp"), where={"machine": (ZEN5_2,)}),
    View("gguf-vs-llamacpp", "gguf_vs_llamacpp", ("threads", "file", "prompt", "new_tokens"),
         where={"machine": (ZEN5_2,)},
         metrics=("quantized vs float32: same prefix", "quantized vs float32: same tokens",
                  "quantized vs float32: max abs logit diff", "quantized vs float32: mean abs logit diff",
                  "quantized vs float32: same argmax, forced", "vs llama.cpp: first divergence",
                  "vs llama.cpp: same tokens", "float32 vs llama.cpp: first divergence",
                  "float32 vs llama.cpp: same tokens")),
    View("weights-dtype", "weights_dtype", ("machine", "weights"), metrics=("weight bytes", "resident set added")),
    View("weights-dtype", "weights_dtype", ("machine", "weights", "batch", "new_tokens"), metrics=("engine decode",)),
    View("weights-dtype", "weights_dtype", ("machine", "prompt", "new_tokens"),
         metrics=("same prefix", "same tokens", "same top token, forced", "mean abs logit diff",
                  "max abs logit diff")),
    View("soak", "soak", ("metric",), columns=("soak",), where={"minutes": ("30.0",)},
         metrics=("requests", "tokens", "faults", "checks failed", "server RSS, first window",
                  "server RSS, last window", "engine RSS, first window", "engine RSS, last window",
                  "event-loop lag p99 outside faults")),
)
#: BENCHMARKS.md's blocks by name: the views whose tables each holds.
BLOCKS: dict[str, list[View]] = {}
for _view in VIEWS:
    BLOCKS.setdefault(_view.name, []).append(_view)


def format_value(value: float, unit: str, with_unit: bool) -> str:
    """A figure as recorded (thousands separated; ratios to at least two decimals), with its unit
    where the column's header does not give it."""
    if isinstance(value, int) or abs(value) >= 1000:
        text = f"{value:,.0f}"
    else:
        text = repr(value)
    if unit == "ratio":
        whole, _, decimals = text.partition(".")
        text = f"{whole}.{decimals.ljust(2, '0')}"
    return f"{text} {unit}" if with_unit and unit != "ratio" else text


def latest_runs(view: View, figures: list[Result]) -> list[Result]:
    """The figures of the latest run of each row (and, with columns other than the metric, of each
    cell group), so that a row never sets figures of two runs side by side."""
    def group(r: Result) -> tuple:
        return tuple(r.field(name) for name in (*view.rows, *view.columns) if name != "metric")

    newest: dict[tuple, Result] = {}
    for r in figures:
        held = newest.get(group(r))
        if held is None or (r.date, r.order) > (held.date, held.order):
            newest[group(r)] = r
    return [r for r in figures if r.run == newest[group(r)].run]


def table(view: View, results: Iterable[Result]) -> tuple[list[str], list[Result]]:
    """The view's markdown table of current figures, and the figures it shows."""
    results = list(results)
    figures = latest_runs(view, [r for r in current(results) if view.shows(r)])
    if not figures:
        return [f"(no {view.bench} results recorded yet)"], []

    def row_of(r: Result) -> tuple[str, ...]:
        return tuple(r.field(name) for name in view.rows)

    def column_of(r: Result) -> tuple[str, ...]:
        return tuple(r.field(name) for name in view.columns)

    # Rows and columns in the order of the run (current or not) that has the most rows, then the
    # others' as first recorded; a column field's values in the order the view lists them, if it does.
    by_run: dict[tuple, list[Result]] = {}
    for r in results:
        if view.shows(r):
            by_run.setdefault(r.run, []).append(r)
    ordered = [*max(by_run.values(), key=lambda records: len({row_of(r) for r in records})), *figures]
    rows = list(dict.fromkeys(row_of(r) for r in ordered))
    seen = [list(dict.fromkeys([*view.listed(name), *(r.field(name) for r in ordered)])) for name in view.columns]
    columns = sorted(dict.fromkeys(column_of(r) for r in figures),
                     key=lambda col: [values.index(value) for values, value in zip(seen, col, strict=True)])
    cells = {(row_of(r), column_of(r)): r for r in figures}
    units = {col: {r.unit for r in figures if column_of(r) == col} for col in columns}
    header = [name.replace("_", " ") for name in view.rows]
    for col in columns:
        label = ", ".join(value if name in ("metric", "machine") else f"{name.replace('_', ' ')} {value}"
                          for name, value in zip(view.columns, col, strict=True) if value) or "result"
        (unit,) = units[col] if len(units[col]) == 1 else ("",)
        header.append(f"{label} ({unit})" if unit not in ("", "ratio") and unit not in label.split() else label)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        values = [format_value(r.value, r.unit, len(units[col]) > 1) if (r := cells.get((row, col))) else ""
                  for col in columns]
        lines.append("| " + " | ".join([*row, *values]) + " |")
    return lines, figures


def render(block: str, results: list[Result]) -> str:
    """A block of BENCHMARKS.md: the tables of its views, then the runs their figures come from."""
    lines: list[str] = []
    shown: list[Result] = []
    for view in BLOCKS[block]:
        view_lines, figures = table(view, results)
        lines += [*(view_lines if not lines else ["", *view_lines])]
        shown += figures
    # The runs of one day, machine and commit share their parenthesis.
    commands: dict[tuple[str, str, str | None], list[str]] = {}
    for machine, date, commit, command in dict.fromkeys(r.run for r in shown):
        commands.setdefault((date[:10], machine_label(machine), commit), []).append(f"`{command}`")
    runs = [f"{', '.join(listed)} ({day}, {machine}{f', {commit}' if commit else ''})"
            for (day, machine, commit), listed in commands.items()]
    if runs:
        lines += ["", "Measured by " + "; ".join(runs) + "."]
    return "\n".join(lines) + "\n"


def update(text: str, results: list[Result]) -> str:
    """``text`` with every ``bench_report`` block's body made again from ``results``."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise SystemExit(f"BENCHMARKS.md has a block named {name!r}, which no view in scripts/bench_report.py "
                             f"makes; the blocks are: {', '.join(BLOCKS)}")
        return match.group(1) + render(name, results) + match.group(4)

    return BLOCK.sub(body, text)


def stale_blocks(text: str, results: list[Result]) -> list[str]:
    """The blocks missing from ``text`` or differing from what ``results`` make."""
    bodies = {match["name"]: match["body"] for match in BLOCK.finditer(text)}
    return [name for name in BLOCKS if bodies.get(name) != render(name, results)]


def oversize(text: str) -> str | None:
    """Why the page is too long, or None when it is within :data:`MAX_PAGE_BYTES`."""
    size = len(text.encode())
    if size <= MAX_PAGE_BYTES:
        return None
    return (f"is {size:,} bytes, over {MAX_PAGE_BYTES:,}: it holds the current tables and how each is measured; "
            "move what the runs showed, and the history, to docs/perf-log/ and link it")


def compare(baseline: list[Result], new: list[Result], with_machine: bool = True) -> str:
    """A markdown table of every figure both sides hold (each side's latest), new over baseline."""
    base = {r.key(with_machine): r for r in current(baseline, with_machine)}
    pairs = [(base[r.key(with_machine)], r) for r in current(new, with_machine) if r.key(with_machine) in base]
    if not pairs:
        return "No figure is in both: compare results of the same bench, metric and parameters" + (
            " on the same machine (or pass --ignore-machine)." if with_machine else ".")
    machines = with_machine and len({r.machine_name for _, r in pairs}) > 1
    header = ["bench", *(["machine"] if machines else []), "metric", "parameters", "unit", "baseline", "new",
              "new/baseline"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for old, now in pairs:
        params = ", ".join(f"{name}={now.field(name)}" for name in now.params)
        ratio = f"{now.value / old.value:.3f}" if old.value else ""
        lines.append("| " + " | ".join([now.bench, *([now.machine_name] if machines else []), now.metric, params,
                                         now.unit, format_value(old.value, old.unit, False),
                                         format_value(now.value, now.unit, False), ratio]) + " |")
    sides = {"baseline": {(r.run[2], r.run[3]) for r, _ in pairs}, "new": {(r.run[2], r.run[3]) for _, r in pairs}}
    for side, runs in sides.items():
        lines.append(f"\n{side}: " + "; ".join(f"{commit or 'commit not recorded'}: `{command}`"
                                                for commit, command in sorted(runs, key=str)))
    return "\n".join(lines)


def by_commit(results: list[Result], prefix: str | None) -> list[Result]:
    return [r for r in results if prefix is None or (r.commit or "").startswith(prefix)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("tables", "print every table of current figures"),
                       ("update", "write the tables into BENCHMARKS.md's bench_report blocks"),
                       ("check", "exit 1 if BENCHMARKS.md's tables differ from the results', or it is "
                                 "over MAX_PAGE_BYTES")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--results", type=Path, nargs="+", default=[RESULTS], help="results files or folders")
        sub.add_argument("--file", type=Path, default=BENCHMARKS, help="the page (default: BENCHMARKS.md)")
    sub = commands.add_parser("compare", help="two results files (or two commits of one) figure by figure")
    sub.add_argument("baseline", type=Path, help="a results file or folder")
    sub.add_argument("new", type=Path, nargs="?", help="a results file or folder (default: the baseline's)")
    sub.add_argument("--baseline-commit", help="only the baseline's figures measured at this commit (a prefix)")
    sub.add_argument("--commit", help="only the new side's figures measured at this commit (a prefix)")
    sub.add_argument("--bench", help="only this bench's figures")
    sub.add_argument("--ignore-machine", action="store_true", help="join figures measured on different machines")
    args = parser.parse_args(argv)

    if args.command == "compare":
        baseline = by_commit(load([args.baseline]), args.baseline_commit)
        new = by_commit(load([args.new or args.baseline]), args.commit)
        if args.bench:
            baseline, new = ([r for r in side if r.bench == args.bench] for side in (baseline, new))
        print(compare(baseline, new, with_machine=not args.ignore_machine))
        return 0
    results = load(args.results)
    if args.command == "tables":
        for name in BLOCKS:
            print(f"<!-- bench_report: {name} -->\n{render(name, results)}<!-- /bench_report -->\n")
        return 0
    text = args.file.read_text()
    if args.command == "update":
        args.file.write_text(update(text, results))
        text = args.file.read_text()
        stale = stale_blocks(text, results)
        if stale:
            print(f"{args.file} has no block for: {', '.join(stale)}", file=sys.stderr)
    else:
        stale = stale_blocks(text, results)
        if stale:
            print(f"{args.file}'s tables differ from the results for: {', '.join(stale)}; run "
                  f"scripts/bench_report.py update", file=sys.stderr)
    too_long = oversize(text)
    if too_long:
        print(f"{args.file} {too_long}", file=sys.stderr)
    return 1 if stale or too_long else 0


if __name__ == "__main__":
    sys.exit(main())

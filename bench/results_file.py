"""The benches' results files: one JSON object a measured figure, appended as a line.

Every bench takes ``--results FILE`` (default ``bench/results/<bench>.jsonl``) and writes each figure
it prints there as ``{bench, metric, value, unit, params, machine, commit, date, command}``: what was
measured and with which settings, on which machine (``{cpu, vector_width, cores}``, and ``gpu`` where
one is present), at which commit, when, and by which command. ``scripts/bench_report.py`` makes
BENCHMARKS.md's tables from these files and compares two of them.

This module imports nothing heavy: the benches that set thread counts before numpy loads import
it first.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parents[1]

#: (vendor, family, model) as /proc/cpuinfo gives them -> the microarchitecture, for a readable name.
MICROARCHITECTURES = {
    ("AuthenticAMD", 25, 1): "Zen 3",
    ("AuthenticAMD", 25, 17): "Zen 4",
    ("AuthenticAMD", 26, 2): "Zen 5",
    ("GenuineIntel", 6, 207): "Emerald Rapids",
}


def add_results_option(parser: argparse.ArgumentParser, bench: str) -> None:
    """``--results FILE``: where ``bench`` appends its figures."""
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / f"{bench}.jsonl", metavar="FILE",
                        help=f"append every measured figure to FILE, a JSON object a line "
                             f"(default: bench/results/{bench}.jsonl)")


@functools.cache
def this_machine() -> dict[str, Any]:
    """The CPU by name and microarchitecture, its widest vector unit in bits, the machine's cores (not
    this process's: a bench may pin itself), and the first GPU's name where ``nvidia-smi`` finds one."""
    info = _cpuinfo()
    # "Intel(R) Xeon(R) Processor" -> "Intel Xeon", as BENCHMARKS.md's machines table names hosts.
    name = re.sub(r"\((R|TM)\)| Processor$", "", info.get("model name", "unknown CPU"))
    try:
        family, model = int(info.get("cpu family", "")), int(info.get("model", ""))
    except ValueError:
        cpu = name
    else:
        arch = MICROARCHITECTURES.get((info.get("vendor_id", ""), family, model))
        cpu = f"{name} ({arch + ', ' if arch else ''}family {family} model {model})"
    flags = set(info.get("flags", "").split())
    width = 512 if "avx512f" in flags else 256 if "avx2" in flags or "avx" in flags else 128 if flags else None
    machine: dict[str, Any] = {"cpu": cpu, "vector_width": width, "cores": os.cpu_count()}
    gpu = _first_gpu()
    if gpu:
        machine["gpu"] = gpu
    return machine


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _first_gpu() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


@functools.cache
def current_commit() -> str | None:
    """HEAD's short hash, with ``-dirty`` when the working tree has changes; None outside a checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}-dirty" if dirty else head


def command_line() -> str:
    """This process's command as a user would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


class ResultsFile:
    """Appends one bench run's figures to a JSON-lines file, each with the run's machine, commit,
    date and command (found once, when the first figure is added)."""

    def __init__(self, path: Path, bench: str) -> None:
        self.path = path
        self.bench = bench
        self._run: dict[str, Any] | None = None

    def add(self, metric: str, value: float, unit: str, **params: Any) -> None:
        """Append ``metric`` = ``value`` ``unit`` measured with ``params`` (JSON scalars)."""
        if self._run is None:
            self._run = {"machine": this_machine(), "commit": current_commit(),
                         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         "command": command_line()}
        record = {"bench": self.bench, "metric": metric, "value": _rounded(value), "unit": unit, "params": params,
                  **self._run}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as out:
            out.write(orjson.dumps(record) + b"\n")


def _rounded(value: float) -> float | int:
    """Four significant digits: more than any of these measurements resolves."""
    if isinstance(value, bool) or isinstance(value, int):
        return int(value)
    return float(f"{value:.4g}")

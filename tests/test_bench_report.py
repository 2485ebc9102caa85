"""BENCHMARKS.md's tables are what scripts/bench_report.py makes of bench/results/; the report's
current figures, its tables and its comparison; the benches' results writer."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from bench.results_file import ResultsFile

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "bench_results"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "scripts" / "bench_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


report = _load_script()
ZEN5 = "AMD EPYC (Zen 5, family 26 model 2)"
XEON = "Intel Xeon (AMX, family 6 model 167)"
# What the tables call them (scripts/bench_report.py's MACHINE_LABELS).
ZEN5_LABEL, XEON_LABEL = "Zen 5", "Xeon AMX"
DECODE = report.View("decode-test", "decode", ("machine", "batch"),
                     metrics=("ours", "transformers", "ours/transformers"))


def test_benchmarks_md_tables_are_what_the_results_make():
    results = report.load([REPO / "bench" / "results"])
    stale = report.stale_blocks((REPO / "BENCHMARKS.md").read_text(), results)
    assert stale == [], (f"BENCHMARKS.md's tables {stale} differ from bench/results/: run "
                         ".venv/bin/python scripts/bench_report.py update")


def test_benchmarks_md_holds_the_current_figures_only():
    text = (REPO / "BENCHMARKS.md").read_text()
    assert report.oversize(text) is None, f"BENCHMARKS.md {report.oversize(text)}"
    assert report.MAX_PAGE_BYTES <= 40_000  # issue 63: the current figures; the log in docs/perf-log/


def test_check_fails_on_a_page_over_its_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "BLOCKS", {})  # no tables: only the size is checked
    page, empty = tmp_path / "BENCHMARKS.md", tmp_path / "empty.jsonl"
    empty.write_text("")
    args = ["check", "--file", str(page), "--results", str(empty)]
    page.write_text("x" * report.MAX_PAGE_BYTES)
    assert report.main(args) == 0
    page.write_text("x" * (report.MAX_PAGE_BYTES + 1))
    assert report.main(args) == 1
    assert f"over {report.MAX_PAGE_BYTES:,}" in capsys.readouterr().err


def test_every_bench_writes_a_results_file():
    benches = [path for path in sorted((REPO / "bench").glob("*.py")) if '__name__ == "__main__"' in path.read_text()]
    assert len(benches) >= 17
    for path in benches:
        source = path.read_text()
        assert "add_results_option(" in source and "ResultsFile(" in source, f"{path.name} takes no --results"


def test_current_is_the_latest_figure_and_on_a_tie_the_later_line():
    current = report.current(report.load([FIXTURES / "baseline.jsonl", FIXTURES / "new.jsonl"]))
    ours = {(r.machine_name, r.params["batch"]): r.value for r in current if r.metric == "ours"}
    assert ours == {(ZEN5, 1): 120, (ZEN5, 8): 410, (XEON, 1): 90}


def test_a_table_shows_each_figure_with_its_unit_and_its_run():
    lines, shown = report.table(DECODE, report.load([FIXTURES / "baseline.jsonl"]))
    assert lines == [
        "| machine | batch | ours (tok/s) | transformers (tok/s) | ours/transformers |",
        "|---|---|---|---|---|",
        f"| {ZEN5_LABEL} | 1 | 100 | 50 | 2.00 |",
        f"| {ZEN5_LABEL} | 8 | 400 | 300 | 1.33 |",
        f"| {XEON_LABEL} | 1 | 90 |  |  |",
    ]
    assert {r.commit for r in shown} == {"aaaa111"}


def test_a_machine_goes_by_its_label_or_else_its_recorded_name():
    assert report.machine_label(ZEN5) == ZEN5_LABEL and report.machine_label(XEON) == XEON_LABEL
    assert report.machine_label("RISC-V (model not recorded)") == "RISC-V (model not recorded)"
    labels = list(report.MACHINE_LABELS.values())
    assert len(set(labels)) == len(labels), "two machines with one label would share a table's rows"
    assert not set(labels) & set(report.MACHINE_LABELS), "a label that is another machine's recorded name"


def test_every_machine_a_table_names_is_in_the_machines_table():
    text = (REPO / "BENCHMARKS.md").read_text()
    machines = text.split("## Machines", 1)[1].split("\n## ", 1)[0]
    named = {r.field("machine") for r in report.current(report.load([REPO / "bench" / "results"]))
             if any(view.shows(r) for view in report.VIEWS)}
    missing = [label for label in sorted(named) if f"| {label} |" not in machines]
    assert not missing, f"BENCHMARKS.md's machines table has no row for {missing}"


def test_the_runs_of_one_day_machine_and_commit_share_their_parenthesis(monkeypatch):
    monkeypatch.setattr(report, "BLOCKS", {"decode-test": [DECODE]})
    results = report.load([FIXTURES / "baseline.jsonl"])
    twice = [report.Result(r.bench, r.metric, r.value, r.unit, {**r.params, "batch": 16}, r.machine, r.commit, r.date,
                           "python bench/decode.py --batch 16", len(results) + i)
             for i, r in enumerate(results) if r.machine_name == ZEN5]
    runs = report.render("decode-test", results + twice).rsplit("\n\n", 1)[1]
    assert runs == (f"Measured by `python bench/decode.py`, `python bench/decode.py --batch 16` (2026-11-20, "
                    f"{ZEN5_LABEL}, aaaa111); `python bench/decode.py` (2026-11-20, {XEON_LABEL}, aaaa111).\n")


def test_a_row_never_mixes_two_runs():
    lines, _ = report.table(DECODE, report.load([FIXTURES / "baseline.jsonl", FIXTURES / "new.jsonl"]))
    # Batch 1's latest run measured no ratio, batch 8's latest only ours: the older figures stay out
    # of those rows (and with them the ratio's column).
    assert lines[2:4] == [f"| {ZEN5_LABEL} | 1 | 120 | 48 |", f"| {ZEN5_LABEL} | 8 | 410 |  |"]


def test_update_remakes_the_blocks_and_says_which_are_stale(monkeypatch):
    monkeypatch.setattr(report, "BLOCKS", {"decode-test": [DECODE]})
    results = report.load([FIXTURES / "baseline.jsonl"])
    text = "# Page\n\n<!-- bench_report: decode-test -->\nold table\n<!-- /bench_report -->\nafter\n"
    assert report.stale_blocks(text, results) == ["decode-test"]
    updated = report.update(text, results)
    assert updated.startswith("# Page\n\n<!-- bench_report: decode-test -->\n| machine | batch |")
    assert updated.endswith(f"\n\nMeasured by `python bench/decode.py` (2026-11-20, {ZEN5_LABEL}, aaaa111); "
                            f"`python bench/decode.py` (2026-11-20, {XEON_LABEL}, aaaa111)."
                            "\n<!-- /bench_report -->\nafter\n")
    assert report.stale_blocks(updated, results) == []
    assert report.stale_blocks("no blocks", results) == ["decode-test"]
    with pytest.raises(SystemExit, match="'unknown'"):
        report.update("<!-- bench_report: unknown -->\n<!-- /bench_report -->\n", results)


def test_compare_two_files_figure_by_figure():
    table = report.compare(report.load([FIXTURES / "baseline.jsonl"]), report.load([FIXTURES / "new.jsonl"]))
    lines = table.splitlines()
    assert lines[0] == "| bench | metric | parameters | unit | baseline | new | new/baseline |"
    assert lines[2:5] == ["| decode | ours | batch=1 | tok/s | 100 | 120 | 1.200 |",
                          "| decode | transformers | batch=1 | tok/s | 50 | 48 | 0.960 |",
                          "| decode | ours | batch=8 | tok/s | 400 | 410 | 1.025 |"]
    assert "baseline: aaaa111: `python bench/decode.py`" in table


def test_compare_two_commits_of_one_folder_and_across_machines(capsys):
    assert report.main(["compare", str(FIXTURES), "--baseline-commit", "aaaa", "--commit", "bbbb"]) == 0
    assert "| decode | ours | batch=1 | tok/s | 100 | 120 | 1.200 |" in capsys.readouterr().out
    across = report.compare(report.load([FIXTURES / "baseline.jsonl"]), report.load([FIXTURES / "new.jsonl"]),
                            with_machine=False)
    assert "| decode | ours | batch=1 | tok/s | 90 | 120 | 1.333 |" in across  # the Xeon's, the latest
    assert report.compare([], report.load([FIXTURES / "new.jsonl"])).startswith("No figure is in both")


def test_the_results_file_holds_one_line_a_figure(tmp_path):
    results = ResultsFile(tmp_path / "out" / "decode.jsonl", "decode")
    results.add("ours", 123.456789, "tok/s", batch=1, threads=2)
    results.add("ours/transformers", 1.5, "ratio", batch=1, threads=2)
    first, second = report.load([tmp_path / "out"])
    assert (first.bench, first.metric, first.value, first.unit, dict(first.params)) == (
        "decode", "ours", 123.5, "tok/s", {"batch": 1, "threads": 2})
    assert set(first.machine) >= {"cpu", "vector_width", "cores"} and first.machine["cores"] >= 1
    assert first.run == second.run and first.command.startswith("python ")
    assert report.format_value(second.value, second.unit, False) == "1.50"

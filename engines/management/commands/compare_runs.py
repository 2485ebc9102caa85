"""``manage.py compare_runs A B [--json | --markdown]``: the regression report of run B against run A,
each a run's JSON file (``manage.py replay --output``) or a saved run's id (the history's replay
runs: their report adds the phases and kernels of the runs' traces and profiles)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engines.history.payload import PayloadError
from engines.models import ReplayRunRecord
from engines.workloads.run_compare import RunError, compare_runs, markdown
from engines.workloads.run_report import RunNotReadyError, run_records_report


class Command(BaseCommand):
    help = ("Compare two runs of manage.py replay: TTFT, ITL and E2E p50/p90/p99 with bootstrap intervals and "
            "a verdict each (beyond noise or not), throughput, and the outputs compared.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("a", help="the run before (A): a run's JSON file, or a saved run's id")
        parser.add_argument("b", help="the run after (B): a run's JSON file, or a saved run's id")
        shape = parser.add_mutually_exclusive_group()
        shape.add_argument("--json", action="store_true", help="the report as JSON")
        shape.add_argument("--markdown", action="store_true", help="the report as Markdown (for a pull request)")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["a"].isdigit() and options["b"].isdigit():
            report = self._saved(int(options["a"]), int(options["b"]))
        else:
            runs = []
            for name in ("a", "b"):
                try:
                    runs.append(orjson.loads(Path(options[name]).read_bytes()))
                except (OSError, orjson.JSONDecodeError) as exc:
                    raise CommandError(f"{options[name]}: {exc}") from None
            try:
                report = compare_runs(*runs)
            except RunError as exc:
                raise CommandError(str(exc)) from None
        if options["json"]:
            self.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        else:
            self.stdout.write(markdown(report))

    def _saved(self, a: int, b: int) -> dict[str, Any]:
        records = ReplayRunRecord.objects.defer("payload").in_bulk([a, b])
        for pk in (a, b):
            if pk not in records:
                raise CommandError(f"no saved run #{pk} (the admin's Replay runs lists them)")
        try:
            return run_records_report(records[a], records[b])
        except (RunNotReadyError, RunError, PayloadError) as exc:
            raise CommandError(str(exc)) from None

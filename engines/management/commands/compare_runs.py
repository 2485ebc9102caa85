"""``manage.py compare_runs A B [--json | --markdown]``: the regression report of run B against run A."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engines.workloads.run_compare import RunError, compare_runs, markdown


class Command(BaseCommand):
    help = ("Compare two runs of manage.py replay: TTFT, ITL and E2E p50/p90/p99 with bootstrap intervals and "
            "a verdict each (beyond noise or not), throughput, and the outputs compared.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("a", type=Path, help="the run before (A)")
        parser.add_argument("b", type=Path, help="the run after (B)")
        shape = parser.add_mutually_exclusive_group()
        shape.add_argument("--json", action="store_true", help="the report as JSON")
        shape.add_argument("--markdown", action="store_true", help="the report as Markdown (for a pull request)")

    def handle(self, *args: Any, **options: Any) -> None:
        runs = []
        for name in ("a", "b"):
            try:
                runs.append(orjson.loads(options[name].read_bytes()))
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

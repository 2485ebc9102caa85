"""``manage.py replay WORKLOAD --target URL --output RUN.json``: a recorded workload sent to a server."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engines.workloads.replay import PROMPT_FORMS, WorkloadError, replay


class Command(BaseCommand):
    help = ("Replay a workload (what POST /debug/dump_workload answers) onto an OpenAI-compatible server at its "
            "recorded arrival times (or --speed times faster), and write what the client saw (TTFT, ITL, E2E, "
            "outputs, errors) to --output as a run.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workload", type=Path, help="the workload's JSON file")
        parser.add_argument("--target", required=True, help="the server's base URL (http://host:port)")
        parser.add_argument("--model", help="the model to name in each request (default: the workload's engine)")
        parser.add_argument("--speed", type=float, default=1.0, help="arrivals this many times faster (default 1)")
        parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
        parser.add_argument("--max-requests", type=int, default=None, help="replay at most this many")
        parser.add_argument("--max-seconds", type=float, default=600.0,
                            help="send nothing after this many seconds, and give up on a request then (default 600)")
        parser.add_argument("--prompt-form", choices=PROMPT_FORMS, default="ids",
                            help="prompts as token ids (default) or as text, for a server that takes text only")
        parser.add_argument("--output", type=Path, required=True, help="where the run's JSON goes")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            workload = orjson.loads(options["workload"].read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise CommandError(f"{options['workload']}: {exc}") from None
        model = options["model"] or (workload.get("engine") if isinstance(workload, dict) else None)
        if not model:
            raise CommandError("name the model: --model NAME (the workload names no engine)")
        headers = {"Authorization": f"Bearer {options['api_key']}"} if options["api_key"] else {}

        async def run() -> Any:
            async with httpx.AsyncClient(base_url=options["target"], headers=headers) as client:
                return await replay(workload, client, model, options["target"], options["speed"],
                                    options["max_requests"], options["max_seconds"],
                                    prompt_form=options["prompt_form"])

        try:
            result = asyncio.run(run())
        except WorkloadError as exc:
            raise CommandError(str(exc)) from None
        options["output"].write_bytes(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2))
        summary = result.as_dict()["summary"]
        self.stdout.write(f"{summary['succeeded']} of {summary['requests']} requests succeeded in "
                          f"{result.duration_s:.1f} s; TTFT p50 {summary['ttft_p50_s']} s; wrote {options['output']}")

"""``manage.py replay WORKLOAD --target URL --output RUN.json``: a recorded workload sent to a server.

WORKLOAD is a workload's JSON file or a saved workload's id. With ``--save`` the replay runs as the
admin's does (``engines.workloads.run_job``: the target's configuration, and on ours a profile and
the trace of the run) and is kept in the history as a replay run; a file's workload is saved first."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
from django.core.management.base import BaseCommand, CommandError, CommandParser

from pydantic import ValidationError

from engines.fleet.attach import AttachError
from engines.history.workloads import EmptyWorkloadError, read_json_payload, save_workload
from engines.models import ReplayRunRecord, WorkloadRecord
from engines.workloads.replay import PROMPT_FORMS, WorkloadError, check_workload, replay
from engines.workloads.run_job import ReplayJob, start_replay, wait_for_run


class Command(BaseCommand):
    help = ("Replay a workload (what POST /debug/dump_workload answers) onto an OpenAI-compatible server at its "
            "recorded arrival times (or --speed times faster), and write what the client saw (TTFT, ITL, E2E, "
            "outputs, errors) to --output as a run.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workload", help="the workload's JSON file, or a saved workload's id")
        parser.add_argument("--target", required=True, help="the server's base URL (http://host:port)")
        parser.add_argument("--model", help="the model to name in each request (default: the workload's engine)")
        parser.add_argument("--speed", type=float, default=1.0, help="arrivals this many times faster (default 1)")
        parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
        parser.add_argument("--max-requests", type=int, default=None, help="replay at most this many")
        parser.add_argument("--max-seconds", type=float, default=600.0,
                            help="send nothing after this many seconds, and give up on a request then (default 600)")
        parser.add_argument("--prompt-form", choices=PROMPT_FORMS, default="ids",
                            help="prompts as token ids (default) or as text, for a server that takes text only")
        parser.add_argument("--no-request-ids", action="store_true",
                            help="send no X-Request-Id (llama-cpp-python's server refuses any that is not a UUID)")
        parser.add_argument("--extra-body", default=None, metavar="JSON",
                            help="a JSON object whose keys go into every request's body (llama-cpp-python's server: "
                                 "'{\"repeat_penalty\": 1.0}', or it applies 1.1)")
        parser.add_argument("--save", action="store_true",
                            help="keep the run in the history (the admin's Replay runs), with the target's "
                                 "configuration, and on our servers a profile and the trace of the run")
        parser.add_argument("--output", type=Path, help="where the run's JSON goes (needed without --save)")

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["save"] and options["output"] is None:
            raise CommandError("say where the run goes: --output RUN.json (or keep it in the history: --save)")
        if options["save"]:
            result = self._saved_run(options)
        else:
            result = self._run(self._workload(options["workload"]), options)
        if options["output"] is not None:
            options["output"].write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        summary = result["summary"]
        self.stdout.write(f"{summary['succeeded']} of {summary['requests']} requests succeeded in "
                          f"{result['duration_s']:.1f} s; TTFT p50 {summary['ttft_p50_s']} s"
                          + (f"; wrote {options['output']}" if options["output"] is not None else ""))

    def _workload(self, name: str) -> Any:
        if name.isdigit():
            record = WorkloadRecord.objects.defer("payload").filter(pk=int(name)).first()
            if record is None:
                raise CommandError(f"no saved workload #{name} (the admin's Workloads lists them)")
            return read_json_payload(record)
        try:
            return orjson.loads(Path(name).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise CommandError(f"{name}: {exc}") from None

    def _run(self, workload: Any, options: dict[str, Any]) -> dict[str, Any]:
        model = options["model"] or (workload.get("engine") if isinstance(workload, dict) else None)
        if not model:
            raise CommandError("name the model: --model NAME (the workload names no engine)")
        headers = {"Authorization": f"Bearer {options['api_key']}"} if options["api_key"] else {}
        extra_body = self._extra_body(options)

        async def run() -> Any:
            async with httpx.AsyncClient(base_url=options["target"], headers=headers) as client:
                return await replay(workload, client, model, options["target"], options["speed"],
                                    options["max_requests"], options["max_seconds"],
                                    prompt_form=options["prompt_form"], request_ids=not options["no_request_ids"],
                                    extra_body=extra_body)

        try:
            return asyncio.run(run()).as_dict()
        except WorkloadError as exc:
            raise CommandError(str(exc)) from None

    @staticmethod
    def _extra_body(options: dict[str, Any]) -> dict[str, Any] | None:
        try:
            extra_body = orjson.loads(options["extra_body"]) if options["extra_body"] else None
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"--extra-body: {exc}") from None
        if extra_body is not None and not isinstance(extra_body, dict):
            raise CommandError("--extra-body must be a JSON object")
        return extra_body

    def _saved_run(self, options: dict[str, Any]) -> dict[str, Any]:
        name = options["workload"]
        if name.isdigit():
            workload_id = int(name)
        else:
            workload = self._workload(name)
            try:
                check_workload(workload)
                workload_id = save_workload(workload, engine=str(workload.get("engine") or options["model"] or ""),
                                            note=f"from {name}"[:2000]).pk
            except (WorkloadError, EmptyWorkloadError) as exc:
                raise CommandError(f"{name}: {exc}") from None
        try:
            job = ReplayJob(workload_id=workload_id, target=options["target"], model=options["model"] or "",
                            speed=options["speed"], api_key=options["api_key"] or "",
                            max_requests=options["max_requests"], max_seconds=options["max_seconds"],
                            prompt_form=options["prompt_form"], request_ids=not options["no_request_ids"],
                            extra_body=self._extra_body(options) or {})
            record = start_replay(job, requested_by="manage.py replay")
        except (ValidationError, AttachError, WorkloadRecord.DoesNotExist) as exc:
            raise CommandError(str(exc)) from None
        wait_for_run(record.pk)
        record.refresh_from_db()
        if record.state != ReplayRunRecord.State.DONE:
            raise CommandError(f"run #{record.pk} failed: {record.message}")
        self.stdout.write(f"run #{record.pk} kept in the history ({record.target_kind or 'unknown'} server)")
        return dict(read_json_payload(record))

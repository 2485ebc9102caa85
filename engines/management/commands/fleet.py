"""``manage.py fleet``: the servers attached to the fleet by URL.

    manage.py fleet attach URL [--api-key KEY] [--name NAME] [--interval SECONDS]
    manage.py fleet list
    manage.py fleet detach NAME
"""
from __future__ import annotations

import asyncio
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from engines.fleet.attach import AttachError, attach_server


class Command(BaseCommand):
    help = "Attach, list or detach the foreign servers the fleet polls by URL (vLLM, SGLang, MLC LLM, llama.cpp)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        attach = sub.add_parser("attach", help="attach a server by its base URL")
        attach.add_argument("url")
        attach.add_argument("--api-key", default="", help="sent as a bearer token; kept server-side")
        attach.add_argument("--name", default="", help="how the dashboard names it (default: host:port)")
        attach.add_argument("--interval", type=float, default=2.0, help="seconds between polls, 1-5 (default 2)")
        sub.add_parser("list", help="list the attached servers")
        detach = sub.add_parser("detach", help="stop watching a server")
        detach.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        from engines.models import ForeignServer

        action = options["action"]
        if action == "attach":
            try:
                done = asyncio.run(attach_server(options["url"], options["name"], options["api_key"],
                                                 options["interval"], attached_by="manage.py"))
            except AttachError as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write(f"Attached {done.name}: {done.kind}{' ' + done.version if done.version else ''} "
                              f"at {done.url}")
            if done.metrics_error:
                self.stdout.write(f"  its /metrics: {done.metrics_error}")
        elif action == "list":
            for server in ForeignServer.objects.all():
                key = "API key set" if server.api_key else "no API key"
                self.stdout.write(f"{server.name}\t{server.kind or 'unknown'}\t{server.url}\t"
                                  f"every {server.poll_interval_s:g} s\t{key}")
        else:
            deleted, _ = ForeignServer.objects.filter(name=options["name"]).delete()
            if not deleted:
                raise CommandError(f"no attached server is named {options['name']!r}")
            self.stdout.write(f"Detached {options['name']}.")

"""Attaching a server by URL (the fleet page's form and ``manage.py fleet attach``): check that it
answers, find what it is, and keep it in the database for every member to poll."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from engines.fleet.server_kinds import ServerKind
from engines.fleet.foreign import ForeignReader, PollError, fetch_metrics, probe_kind
from engines.server.db_calls import in_db_thread

__all__ = ["AttachError", "Attached", "attach_server", "check_url"]


class AttachError(ValueError):
    """Why a server cannot be attached (shown to the user as is)."""


@dataclass(frozen=True)
class Attached:
    id: int
    name: str
    url: str
    kind: str
    version: str
    metrics_error: str | None       # the server answered but its /metrics did not (it is still attached)


def check_url(url: str) -> str:
    """``url`` normalised (no trailing slash), or :class:`AttachError`."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AttachError(f"{url!r} is not an http(s) URL such as http://10.0.0.5:8000")
    if parts.query or parts.fragment:
        raise AttachError("give the server's base URL, without a query or a fragment")
    return url


async def detect(url: str, api_key: str = "", client: httpx.AsyncClient | None = None) -> tuple[str, str, str | None]:
    """``(kind, version, metrics error)``: from ``/metrics`` when it answers, else from the probes;
    :class:`AttachError` when nothing at the URL answers like a server."""
    own = client is None
    client = client or httpx.AsyncClient(follow_redirects=False, timeout=httpx.Timeout(5.0))
    try:
        metrics_error = None
        kind = ServerKind.UNKNOWN
        try:
            text = await fetch_metrics(client, url, api_key or None)
            reading = ForeignReader().read(text)
            metrics_error = reading.error
            kind = reading.kind
        except PollError as exc:
            metrics_error = str(exc)
        except httpx.HTTPError as exc:
            raise AttachError(f"nothing answers at {url}: {type(exc).__name__}") from None
        probed, version = await probe_kind(client, url, api_key or None)
        if kind is ServerKind.UNKNOWN:
            kind = probed
        if kind is ServerKind.UNKNOWN and metrics_error is not None:
            raise AttachError(f"{url} does not look like an LLM server: {metrics_error}")
        return kind.value, version, metrics_error
    finally:
        if own:
            await client.aclose()


async def attach_server(url: str, name: str = "", api_key: str = "", poll_interval_s: float = 2.0,
                        attached_by: str = "", client: httpx.AsyncClient | None = None) -> Attached:
    """Check, detect and store one server; :class:`AttachError` says why not."""
    from engines.models import ForeignServer

    url = check_url(url)
    if not 1.0 <= poll_interval_s <= 5.0:
        raise AttachError("the poll interval is 1 to 5 seconds")
    name = (name.strip() or (urlsplit(url).netloc))[:100]
    kind, version, metrics_error = await detect(url, api_key, client)

    def save() -> ForeignServer:
        if ForeignServer.objects.filter(url=url).exists():
            raise AttachError(f"{url} is attached already")
        if ForeignServer.objects.filter(name=name).exists():
            raise AttachError(f"a server named {name!r} is attached already: give another --name")
        return ForeignServer.objects.create(name=name, url=url, api_key=api_key, kind=kind, version=version,
                                            poll_interval_s=poll_interval_s, attached_by=attached_by)

    server = await in_db_thread(save)()
    return Attached(server.pk, server.name, server.url, kind, version, metrics_error)

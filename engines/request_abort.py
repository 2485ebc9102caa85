"""Cancelling one request by id, from ``POST /debug/abort_request`` or the live table's button.

The engine aborts it as it aborts a request whose client went away (``Engine.abort_request``,
through ``AsyncEngine.abort_request``): a stream then ends with ``finish_reason: "abort"`` and
``[DONE]``, a non-streaming call answers what it had, with ``abort``. Each abort is kept in the
history as a :class:`~engines.models.FleetJob` (``action="abort_request"``), the audit of who did
what and when that the fleet's controls keep too (the admin's "Fleet jobs"), with one target: this
server's engine.
"""
from __future__ import annotations

import logging

from django.db import DatabaseError
from django.utils import timezone

from engines.server.db_calls import in_db_thread
from engines.runtime import AsyncEngine
from engines.server.server_identity import server_id

logger = logging.getLogger(__name__)

__all__ = ["ABORT_ACTION", "AbortOutcome", "RequestNotLiveError", "abort_live_request"]

#: The history's name for the action.
ABORT_ACTION = "abort_request"


class RequestNotLiveError(LookupError):
    """The engine holds no request of that id: it never came, or it has ended already."""


class AbortOutcome:
    """An abort carried out: on which engine, which request, and whether the history kept it."""

    def __init__(self, engine: str, request_id: str, record_id: int | None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.record_id = record_id

    def as_dict(self) -> dict[str, object]:
        """The API's and the page's answer."""
        return {"status": "aborted", "model": self.engine, "request_id": self.request_id,
                "history_id": self.record_id}


@in_db_thread
def _record(engine: str, request_id: str, who: str, source: str) -> int:
    from engines.models import FleetJob, FleetJobTarget

    now = timezone.now()
    here = server_id()
    job = FleetJob.objects.create(action=ABORT_ACTION, requested_by=who, requested_on=here,
                                  options={"request_id": request_id, "source": source}, created_at=now,
                                  finished_at=now)
    FleetJobTarget.objects.create(job=job, server=here, server_name=here, engine=engine,
                                  state=FleetJobTarget.State.DONE, message=f"aborted request {request_id}",
                                  result={"request_id": request_id}, updated_at=now)
    return job.pk


async def abort_live_request(engine: AsyncEngine, request_id: str, who: str, source: str) -> AbortOutcome:
    """Abort ``request_id`` on ``engine`` and keep it in the history as asked by ``who`` from
    ``source`` (``"api"``, ``"dashboard"``). Raises :class:`RequestNotLiveError` when the engine
    did not hold it, and ``EngineDeadError`` when it is down. The abort stands when the database
    does not answer: the history then misses it (logged), and ``record_id`` is None."""
    if not await engine.abort_request(request_id):
        raise RequestNotLiveError(f"engine {engine.name} holds no request {request_id!r}: "
                                  "it never came or has ended already")
    try:
        record: int | None = await _record(engine.name, request_id, who, source)
    except DatabaseError as exc:
        logger.warning("aborted request %s on %s, but the history did not keep it: %s", request_id, engine.name, exc)
        record = None
    return AbortOutcome(engine.name, request_id, record)

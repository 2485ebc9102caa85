"""The watchdog's stall incidents kept in the history (``models.StallIncidentRecord``).

:class:`IncidentRecorder` listens to ``engines.watchdog.stall_watch``: it is called on the watch's threads
when an incident's evidence has been taken and when the incident closes, in either order (a
py-spy read of a stopped process may outlast a short stall). Each call writes the incident's
whole state, so the row ends up as the incident ended whatever the order. A database that does
not answer loses that write (said once in the log, as every history write does), never the watch.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
from collections import OrderedDict

import orjson
from django.db import connection

from engines.history.outage import OUTAGE_ERRORS
from engines.models import StallIncidentRecord
from engines.server.server_identity import fleet_name, server_id
from engines.watchdog.detector import StallIncident

__all__ = ["IncidentRecorder", "incident_recorder"]

logger = logging.getLogger(__name__)

#: Incidents whose row id is remembered (to update it on close): more than the watch keeps.
REMEMBERED = 1000


class IncidentRecorder:
    """Writes each incident it hears of to its row, making the row the first time."""

    def __init__(self) -> None:
        # An incident by its engine and opening moment (what makes it one) -> its row's pk.
        self._rows: OrderedDict[tuple[str, float], int] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, incident: StallIncident) -> None:
        """The watch's listener: the incident as it is now, into its row."""
        opened = dt.datetime.fromtimestamp(incident.opened_wall, dt.timezone.utc)
        duration = incident.duration_s
        fields = {
            "engine": incident.engine, "reason": incident.reason, "detail": incident.detail, "opened_at": opened,
            "closed_at": opened + dt.timedelta(seconds=duration) if duration is not None else None,
            "duration_s": duration, "evidence": _storable(incident.evidence),
        }
        try:
            with self._lock:  # the evidence and the close come from two threads
                pk = self._rows.get(_key(incident))
                if pk is None or not StallIncidentRecord.objects.filter(pk=pk).update(**fields):
                    row = StallIncidentRecord.objects.create(server=server_id(), fleet=fleet_name(), **fields)
                    self._rows[_key(incident)] = row.pk
                    while len(self._rows) > REMEMBERED:
                        self._rows.popitem(last=False)
        except OUTAGE_ERRORS as exc:
            logger.warning("engine %s: its stall incident could not be kept in the history: %s", incident.engine, exc)
        finally:
            # A watch thread's connection is no request's, which Django would close: closed here
            # (unless a caller's transaction holds it: a test's).
            if not connection.in_atomic_block:
                connection.close()

    def record_pk(self, incident: StallIncident) -> int | None:
        """The row of ``incident``, once written (the dashboard's banner links it)."""
        with self._lock:
            return self._rows.get(_key(incident))


def _storable(evidence: dict) -> dict:
    """``evidence`` as both databases keep it: PostgreSQL's jsonb holds neither NaN (orjson writes
    null) nor NUL (a client's request id may hold one: replaced, as the trace history does)."""
    return orjson.loads(orjson.dumps(evidence, default=str).replace(b"\\u0000", b"\\ufffd"))


def _key(incident: StallIncident) -> tuple[str, float]:
    return incident.engine, incident.opened_at


#: The server process's recorder (``manage.py serve`` adds it to ``stall_watch``'s listeners).
incident_recorder = IncidentRecorder()

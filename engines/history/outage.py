"""The history's database going away (PostgreSQL restarting, a network cut), as the server says it.

The live side (the engines, the API, the dashboard's sockets already open) needs no database; the
history (the admin, the dashboard's record pages, trace and profile saves) and every sign-in
(sessions are stored there) do. While it is away, each of those answers a 503 with the driver's
reason (:func:`database_reason`): a save raises :class:`HistoryUnavailableError`, a page answers
through ``engines.history.middleware``, an API view through ``engines.views.api``. The log says
so once an outage (:data:`history_outage`), not a traceback a request, and says when it answers
again: the first connection that opens after it, which is when pages work again, without a
restart (Django opens a connection per request: ``CONN_MAX_AGE`` is 0).
"""
from __future__ import annotations

import logging
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.backends.signals import connection_created
from django.http import HttpResponseBase

from engines.server.outage_log import OutageLog

__all__ = ["OUTAGE_ERRORS", "HistoryOutage", "HistoryUnavailableError", "database_reason", "history_outage",
           "page_message", "request_message", "said_once"]

logger = logging.getLogger(__name__)

#: What a database that does not answer raises (refused, dropped, shutting down); an
#: IntegrityError or a ProgrammingError is a bug, and stays a 500.
OUTAGE_ERRORS = (OperationalError, InterfaceError)


class HistoryUnavailableError(Exception):
    """The history's database does not answer (PostgreSQL restarting, a network cut): nothing was
    saved, and a trace was not taken from its engine (the views answer a 503)."""


def page_message(reason: str) -> str:
    """What a history page says while the database is away."""
    return (f"The history database does not answer: {reason}. Live pages already open and the API keep "
            "working; this page comes back by itself when it does.")


def request_message(reason: str) -> str:
    """What a JSON request that needed the database is answered while it is away."""
    return f"The history database does not answer: {reason}. Try again when it is back."


def said_once(response: HttpResponseBase) -> HttpResponseBase:
    """``response`` (a 503 for the outage) without the error line Django's ``log_response`` adds
    for each request: :data:`history_outage` says the outage once."""
    response._has_been_logged = True  # type: ignore[attr-defined]  # the flag django.utils.log reads
    return response


def database_reason(exc: BaseException) -> str:
    """What the database driver said, in one line: psycopg adds a hint on a second line ("Is the
    server running on that host...") that the first already implies."""
    lines = str(exc).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(exc).__name__


class HistoryOutage(OutageLog):
    """The history's database, away or not, as the last request that needed it found it: each
    request that fails is told the driver's reason, and the log says the outage once (an
    :class:`~engines.server.outage_log.OutageLog`) and its end at the next connection."""

    def __init__(self) -> None:
        super().__init__(logger, "history: the database", down="does not answer", back="answers again",
                         meanwhile="history pages and sign-ins answer 503 until it does, live pages and the API "
                                   "serve on", describe=database_reason)

    def answered(self, **_: Any) -> None:
        """A connection opened (``connection_created``): the outage, if there was one, is over."""
        self.worked()


#: The server process's one view of its history database.
history_outage = HistoryOutage()
connection_created.connect(history_outage.answered, dispatch_uid="engines.history.outage")

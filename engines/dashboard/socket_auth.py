"""The dashboard sockets' session and user: Channels' ``AuthMiddlewareStack``, except while the
database does not answer.

The session and the user are stored in the database, and Channels reads them before the
consumer runs: an outage there would be an exception out of the application (Daphne logs a
traceback and refuses the handshake with a 500, and the page's reconnects repeat both). Here it
leaves the socket anonymous and says why in its scope (:func:`database_away`); the consumer
closes it with a code of its own (``consumers.CLOSE_UNAVAILABLE``) and the page tries again.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from channels.auth import AuthMiddleware
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.contrib.auth.models import AnonymousUser

from engines.history.outage import OUTAGE_ERRORS, history_outage

if TYPE_CHECKING:  # the stubs' scope type: no such class at run time
    from channels.consumer import _ChannelScope
    from channels.utils import _ChannelApplication

__all__ = ["SocketAuthMiddleware", "database_away", "socket_auth_stack"]

#: The scope's key for why its session could not be read.
_DATABASE_AWAY = "database_away"


class SocketAuthMiddleware(AuthMiddleware):
    """``scope["user"]`` from the session, or anonymous and :func:`database_away` set while the
    database does not answer (said in the log once an outage)."""

    async def resolve_scope(self, scope: _ChannelScope) -> None:
        try:
            await super().resolve_scope(scope)
        except OUTAGE_ERRORS as exc:
            scope["user"]._wrapped = AnonymousUser()  # type: ignore[union-attr]  # populate_scope set the lazy user
            cast(dict[str, Any], scope)[_DATABASE_AWAY] = history_outage.failed(exc)


def database_away(scope: Mapping[str, Any]) -> str | None:
    """Why the socket's session could not be read (the database does not answer), or None."""
    return scope.get(_DATABASE_AWAY)


def socket_auth_stack(inner: _ChannelApplication) -> _ChannelApplication:
    """``AuthMiddlewareStack`` with :class:`SocketAuthMiddleware`: cookies, session, user."""
    return CookieMiddleware(SessionMiddleware(SocketAuthMiddleware(inner)))

"""The session and CSRF cookies' names, one pair per port.

A browser keeps cookies per host, not per port: two servers on one host that both named their
session cookie ``sessionid`` overwrote each other's, so signing in to one signed the user out of
the other (and spent that one's one-time login link). Signing in also rotates the CSRF cookie,
which the other server's open forms then no longer matched.
"""
from __future__ import annotations

__all__ = ["cookie_names"]


def cookie_names(port: int | None) -> tuple[str, str]:
    """The session and CSRF cookies' names of a server listening on ``port``; Django's own
    (``sessionid``, ``csrftoken``) for a server that does not know its port."""
    if port is None:
        return "sessionid", "csrftoken"
    return f"sessionid_{port}", f"csrftoken_{port}"

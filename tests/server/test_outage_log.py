"""The server's one way of saying an outage (engines.server.outage_log): its first failure once,
its end once, however long it lasts and however many threads fail at once."""
from __future__ import annotations

import logging
import threading

import pytest

from engines.server.outage_log import OutageLog

LOGGER = "engines.fleet"


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_one_warning_an_outage_and_one_line_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    outage = OutageLog(logging.getLogger(LOGGER), "fleet: reading the attached servers")
    outage.worked()  # no outage yet: nothing to say
    for _ in range(5):
        assert outage.failed(ConnectionError("refused")) == "refused"
    assert outage.failing
    outage.worked()
    outage.worked()
    assert not outage.failing
    outage.failed(TimeoutError("slow"))  # a second outage is said again
    said = lines(caplog)
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO, logging.WARNING]
    assert said[0][1] == "fleet: reading the attached servers failed (refused); retrying, quietly until it works again"
    assert said[1][1].startswith("fleet: reading the attached servers works again after ")
    assert said[1][1].endswith("(5 failed tries)")


def test_its_own_words_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    """What the history's database says: its own verbs, and the driver's first line as the reason."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    outage = OutageLog(logging.getLogger(LOGGER), "history: the database", down="does not answer",
                       meanwhile="pages answer 503", back="answers again",
                       describe=lambda exc: str(exc).splitlines()[0])
    assert outage.failed(OSError("refused\nIs the server running?")) == "refused"
    outage.worked()
    said = lines(caplog)
    assert said[0][1] == "history: the database does not answer (refused); pages answer 503"
    assert said[1][1].startswith("history: the database answers again after ") and "(1 failed tries)" in said[1][1]


def test_threads_failing_at_once_say_it_once(caplog: pytest.LogCaptureFixture) -> None:
    """Requests fail on many threads at once while the database is away: one warning still."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    outage = OutageLog(logging.getLogger(LOGGER), "history: the database", down="does not answer")
    start = threading.Barrier(8)

    def fail() -> None:
        start.wait()
        for _ in range(50):
            outage.failed(ConnectionError("refused"))

    threads = [threading.Thread(target=fail) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outage.worked()
    said = lines(caplog)
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO]
    assert said[1][1].endswith("(400 failed tries)")

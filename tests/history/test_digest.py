"""A trace's digest (engines.history.digest) made in a process of its own equals the one made
here; its errors come back as themselves; the process is replaced after its quota; a server's
saves go through it (its parse's memory never touches the server's heap)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from engines.history import TraceFormatError, capture, save_trace
from engines.history.digest import DigestProcess, digest_trace
from engines.models import RequestSummary
from tests.history.trace_builder import serving_trace


@pytest.fixture(scope="module")
def process():
    digests = DigestProcess(digests_per_process=2)
    yield digests
    digests.close()


def test_the_process_digests_as_this_process_does(process: DigestProcess) -> None:
    raw = orjson.dumps(serving_trace(num_requests=4, prompt_tokens=9, completion_tokens=5))
    here_analysis, here_stored = digest_trace(raw)
    there_analysis, there_stored = process.digest(raw)
    assert there_analysis == here_analysis
    assert there_analysis.event_count > 0 and len(there_analysis.requests) == 4
    assert (there_stored.data, there_stored.crc32, there_stored.raw_size) == \
           (here_stored.data, here_stored.crc32, here_stored.raw_size)


def test_a_bad_trace_raises_its_own_error_from_the_process(process: DigestProcess) -> None:
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        process.digest(b"{not json")
    with pytest.raises(TraceFormatError):
        process.digest(b'{"no": "events"}')


def test_ctrl_c_to_the_process_group_leaves_the_process_to_the_server() -> None:
    """A terminal's Ctrl-C reaches every process of the group: the child ignores it (the server's
    shutdown ends it) rather than dying mid-digest with a traceback on the server's console."""
    process = DigestProcess()
    try:
        raw = orjson.dumps(serving_trace(num_requests=1))
        process.digest(raw)
        child = process.child_pid()
        assert child is not None
        os.kill(child, signal.SIGINT)
        time.sleep(0.2)
        assert process.digest(raw)[0].event_count > 0 and process.child_pid() == child
    finally:
        process.close()


def test_the_process_is_replaced_after_its_quota(process: DigestProcess) -> None:
    raw = orjson.dumps(serving_trace(num_requests=1))
    pids = set()
    for _ in range(4):
        process.digest(raw)
        pids.add(process.child_pid())  # None between a child's exit and its successor's start
    assert len(pids - {None}) >= 2


@pytest.mark.django_db(transaction=True)
def test_saves_go_through_the_process_once_started(monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.history.digest as digest

    def not_here(trace):
        raise AssertionError("parsed in the server's process")

    capture.start_digest_process()
    try:
        monkeypatch.setattr(digest, "analyze_trace", not_here)  # this process's copy only
        record = save_trace(orjson.dumps(serving_trace(num_requests=3)), engine="eng-digest", model="demo")
    finally:
        capture.stop_digest_process()
    assert record.request_count == 3 and RequestSummary.objects.filter(trace=record).count() == 3
    with pytest.raises(AssertionError, match="server's process"):  # stopped: here again
        save_trace(orjson.dumps(serving_trace(num_requests=1)), engine="eng-digest", model="demo")


def test_the_process_ends_when_its_server_is_killed(tmp_path) -> None:
    """A server killed outright (SIGKILL: no shutdown runs) takes its digest process with it."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import django; django.setup()\n"
         "from engines.history.digest import DigestProcess\n"
         "digests = DigestProcess(); digests.warm(); print(digests.child_pid(), flush=True)\n"
         "import time; time.sleep(600)"],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "debugsite.settings", "DEBUGSITE_VAR_DIR": str(tmp_path)})
    try:
        child = int(server.stdout.readline())
        os.kill(child, 0)  # running
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the digest process outlived its killed server")

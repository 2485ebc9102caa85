"""The watchdog against a real server: an engine process SIGSTOPped (a hung device) is seen
stalled, its evidence taken, ``/health`` says so (503), ``/metrics`` counts it, and the incident
closes with its duration when the process runs again; the request in flight then finishes."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time

import httpx
import pytest

from tests.processes import child_pids, start_server

pytestmark = pytest.mark.slow


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()):
            return value
        time.sleep(0.2)
    pytest.fail(f"{what} did not happen in {timeout_s:g} s")


def test_a_stopped_engine_process_is_a_stall_with_its_evidence(tmp_path) -> None:
    srv = start_server(["--model", "demo", "--enable-debug", "--enable-tracing", "--backend", "cpu",
                        "--max-num-seqs", "4", "--max-total-tokens", "4096", "--stall-no-progress-s", "2"], tmp_path)
    done: dict[str, httpx.Response] = {}
    try:
        engine_pid = next(pid for pid in child_pids(srv.process.pid)
                          if open(f"/proc/{pid}/cmdline", "rb").read().endswith(b"engine=demo\0"))
        body = {"model": "demo", "prompt": "tides", "max_tokens": 600, "debug_config": {"ignore_eos": True}}
        worker = threading.Thread(target=lambda: done.setdefault("reply", httpx.post(
            f"{srv.base}/v1/completions", json=body, timeout=180)), daemon=True)
        worker.start()
        wait_for(lambda: srv.http.post("/debug/list_requests", json={}).json()["total"], 30, "the request started")
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            health = wait_for(lambda: (r := srv.http.get("/health")).status_code == 503 and r, 30, "/health 503")
            stalled = health.json()
            assert stalled["status"] == "stalled" and stalled["stalled"]["demo"]["reason"] == "no_progress"
            assert "no step finished" in stalled["stalled"]["demo"]["detail"]
            metrics = srv.http.get("/metrics").text
            assert 'llm_engine_stalls_total{model="demo"} 1.0' in metrics
            assert 'llm_engine_stalled{model="demo"} 1.0' in metrics
            # The evidence, taken while it lasts: py-spy's stacks of the stopped process or its reason;
            # the server's own threads; what the stopped engine could not answer, named.
            incident = wait_for(lambda: (i := srv.http.post("/debug/list_incidents", json={}).json()["incidents"])
                                and i[0]["evidence"] and i[0], 60, "the evidence")
            evidence = incident["evidence"]
            assert incident["open"] and incident["reason"] == "no_progress"
            assert "stall-watch" in evidence["server_stacks"]
            assert "engine_stacks" in evidence or "py-spy" in evidence["missing"]["engine_stacks"]
            assert "did not answer" in evidence["missing"]["requests"]
            assert evidence["progress"]["work"] >= 1 and evidence["configuration"]["mode"] == "process"
            assert len(evidence["server_streams"]) == 1  # whom the server waits on
            assert evidence["thresholds"]["no_progress_s"] == 2.0
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        wait_for(lambda: srv.http.get("/health").status_code == 200, 30, "/health 200 again")
        closed = srv.http.post("/debug/list_incidents", json={"model": "demo"}).json()
        assert not closed["open"] and closed["stalls_total"] == 1
        assert closed["incidents"][0]["duration_s"] >= 2.0
        assert 'llm_engine_stalled{model="demo"} 0.0' in srv.http.get("/metrics").text
        worker.join(180)
        assert done["reply"].status_code == 200 and done["reply"].json()["usage"]["completion_tokens"] == 600
        # Kept in the history as it ended: one row, closed, with its evidence.
        with sqlite3.connect(tmp_path / "db.sqlite3") as db:
            rows = wait_for(lambda: (r := db.execute(
                "select engine, reason, duration_s, evidence, server from engines_stallincidentrecord").fetchall())
                and r[0][2] is not None and r, 30, "the incident's row closed")
        assert len(rows) == 1
        engine, reason, duration_s, evidence_json, server = rows[0]
        assert (engine, reason) == ("demo", "no_progress") and server.endswith(f":{srv.port}")  # host:port
        assert duration_s == pytest.approx(closed["incidents"][0]["duration_s"], abs=1e-6)
        assert json.loads(evidence_json)["thresholds"]["no_progress_s"] == 2.0
    finally:
        srv.stop()


def test_a_step_held_for_20_s_is_a_long_step_stall_with_the_engines_stack(tmp_path) -> None:
    """The engine process holds its third step 20 s (``ENGINES_TEST_STEP_HOLD``, a test-only hook):
    a long-step incident at 5 s, the engine's own stacks showing where it is (it answers from its
    receiver thread meanwhile), closed with its duration when the step ends."""
    srv = start_server(["--model", "demo", "--enable-debug", "--backend", "cpu", "--max-num-seqs", "4",
                        "--max-total-tokens", "4096", "--stall-step-s", "5", "--stall-no-progress-s", "60"], tmp_path,
                       env={"ENGINES_TEST_STEP_HOLD": "3:20"})
    done: dict[str, httpx.Response] = {}
    try:
        body = {"model": "demo", "prompt": "tides", "max_tokens": 8, "debug_config": {"ignore_eos": True}}
        began = time.monotonic()
        worker = threading.Thread(target=lambda: done.setdefault("reply", httpx.post(
            f"{srv.base}/v1/completions", json=body, timeout=120)), daemon=True)
        worker.start()
        health = wait_for(lambda: (r := srv.http.get("/health")).status_code == 503 and r, 30, "/health 503")
        assert health.json()["stalled"]["demo"]["reason"] == "long_step"
        incident = wait_for(lambda: (i := srv.http.post("/debug/list_incidents", json={}).json()["incidents"])
                            and i[0]["evidence"] and i[0], 30, "the evidence")
        assert incident["reason"] == "long_step" and incident["open"]
        assert "_held_for_a_test" in incident["evidence"]["engine_stacks"]  # taken from inside: it answers
        wait_for(lambda: srv.http.get("/health").status_code == 200, 40, "/health 200 again")
        closed = srv.http.post("/debug/list_incidents", json={"model": "demo"}).json()["incidents"][0]
        assert not closed["open"] and 14.0 <= closed["duration_s"] <= 25.0, closed["duration_s"]
        worker.join(60)
        assert done["reply"].status_code == 200 and done["reply"].json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - began >= 20.0  # the step was held
    finally:
        srv.stop()

"""Replay and the regression report end to end (issue 62, parts 2 and 3): one bursty workload,
saved in the history, replayed from its admin page onto two real servers that differ in one flag
(``--max-num-seqs 16`` and ``1``); the report says TTFT p90 is worse beyond noise on the second,
names the flag in its configuration diff, and carries both runs' phases (from their traces) and
kernels (from their profiles). The same server twice says "no change" for TTFT p50."""
from __future__ import annotations

import io
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from django.core.management import call_command

from engines.history.workloads import read_json_payload, save_workload
from engines.models import FleetJobTarget, ReplayRunRecord, TraceRecord
from engines.runtime import WORKLOAD_FORMAT, WORKLOAD_VERSION
from engines.workloads.run_job import wait_for_run
from engines.workloads.run_report import run_records_report
from tests.processes import Server, start_server

pytestmark = pytest.mark.django_db(transaction=True)

SERVE = ["--model", "demo", "--enable-debug", "--enable-tracing", "--backend", "cpu", "--engine-mode", "thread"]
#: Three bursts of eight requests, two seconds apart.
BURSTS, BURST, GAP_S = 3, 8, 2.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    wide = start_server([*SERVE, "--max-num-seqs", "16"], tmp_path_factory.mktemp("wide"))
    narrow = start_server([*SERVE, "--max-num-seqs", "1"], tmp_path_factory.mktemp("narrow"))
    for server in (wide, narrow):  # a burst first: what a first batch of its size compiles is not measured
        warm_up(server)
    yield wide, narrow
    wide.stop()
    narrow.stop()


def warm_up(server: Server) -> None:
    body = {"model": "demo", "prompt": list(range(1000, 1024)), "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(BURST) as pool:
        replies = list(pool.map(lambda _: server.http.post("/v1/completions", json=body), range(BURST)))
    assert all(r.status_code == 200 for r in replies)


def bursty_workload() -> dict:
    requests = [{"request_id": f"b{burst}-{i}", "offset_s": burst * GAP_S + i * 0.01, "prompt_tokens": 24,
                 "completion_tokens": 32, "cached_tokens": 0, "max_tokens": 32, "temperature": 0.0, "top_p": 1.0,
                 "n": 1, "seed": None, "ignore_eos": True, "finish_reason": "length", "queue_s": None,
                 "ttft_s": None, "e2e_s": 0.0} for burst in range(BURSTS) for i in range(BURST)]
    return {"format": WORKLOAD_FORMAT, "version": WORKLOAD_VERSION, "engine": "demo", "first_arrival_unix": time.time(),
            "capacity": len(requests), "dropped": 0, "requests": requests}


def replay_from_the_page(admin_client, workload_id: int, target: str) -> ReplayRunRecord:
    reply = admin_client.post(f"/admin/engines/workloadrecord/{workload_id}/replay/",
                              {"target": target, "speed": "1", "max_seconds": "120", "profile": "on"})
    assert reply.status_code == 302, reply.content[:500]
    run = ReplayRunRecord.objects.order_by("-id").first()
    assert run is not None and reply["Location"].endswith(f"/replayrunrecord/{run.pk}/change/")
    assert wait_for_run(run.pk, timeout=180)
    run.refresh_from_db()
    assert run.state == "done", run.message
    return run


def test_max_num_seqs_1_against_16_is_slower_beyond_noise_and_the_report_says_why(servers, admin_client) -> None:
    wide, narrow = servers
    workload = save_workload(bursty_workload(), engine="demo", model="demo")
    page = admin_client.get(f"/admin/engines/workloadrecord/{workload.pk}/change/")
    assert page.status_code == 200 and b'id="replay-form"' in page.content

    a = replay_from_the_page(admin_client, workload.pk, wide.base)
    b = replay_from_the_page(admin_client, workload.pk, narrow.base)
    for run in (a, b):
        assert (run.request_count, run.succeeded, run.target_kind) == (BURSTS * BURST, BURSTS * BURST, "ours")
        # ... and a line in the fleet's job audit: who replayed what onto which server, and how it went.
        line = FleetJobTarget.objects.get(job__action="replay", result__run_id=run.pk)
        assert (line.state, line.server_name, line.job.requested_by) == ("done", run.target, "admin")
        assert line.message == f"{BURSTS * BURST} of {BURSTS * BURST} requests succeeded"
        assert run.trace_id is not None and TraceRecord.objects.get(pk=run.trace_id).request_count >= BURSTS * BURST
    assert b.target_config["engine"]["config"]["max_num_seqs"] == 1

    report = run_records_report(a, b)
    verdicts = {(r["figure"], r["stat"]): r for r in report["figures"]}
    assert verdicts[("TTFT", "p90")]["verdict"] == "slower beyond noise", verdicts[("TTFT", "p90")]
    assert verdicts[("TTFT", "p90")]["ci_low"] > 0
    assert {"key": "engine.config.max_num_seqs", "a": 16, "b": 1} in report["config_diff"]
    # Replayed greedy with the same prompts onto the same model: the same outputs.
    assert report["outputs_compared"] == BURSTS * BURST and report["outputs_identical"] == BURSTS * BURST
    phases = {row["phase"]: row for row in report["phases"]}
    assert phases and max(phases.values(), key=lambda r: r["delta"])["delta"] > 0  # B waited somewhere longer
    assert report["kernels"] and all(row["calls_a"] for row in report["kernels"][:3])

    page = admin_client.get(f"/admin/engines/replayrunrecord/compare/?a={a.pk}&b={b.pk}")
    assert page.status_code == 200
    assert b"slower beyond noise" in page.content and b"max_num_seqs" in page.content
    md = admin_client.get(f"/admin/engines/replayrunrecord/compare/?a={a.pk}&b={b.pk}&format=md")
    assert md.status_code == 200 and b"| TTFT p90 |" in md.content and b"slower beyond noise" in md.content
    as_json = admin_client.get(f"/admin/engines/replayrunrecord/compare/?a={a.pk}&b={b.pk}&format=json").json()
    assert {"ci_low", "ci_high", "verdict"} <= set(as_json["figures"][0])

    # The command line says the same of the saved runs, and replays a saved workload into the history.
    out = io.StringIO()
    call_command("compare_runs", str(a.pk), str(b.pk), "--json", stdout=out)
    from_command = orjson.loads(out.getvalue())
    assert from_command["figures"] == report["figures"] and from_command["kernels"] == report["kernels"]
    before = ReplayRunRecord.objects.count()
    call_command("replay", str(workload.pk), "--target", wide.base, "--save", "--max-requests", "4",
                 stdout=io.StringIO())
    saved = ReplayRunRecord.objects.order_by("-id").first()
    assert ReplayRunRecord.objects.count() == before + 1 and (saved.state, saved.succeeded) == ("done", 4)

    again = replay_from_the_page(admin_client, workload.pk, wide.base)
    same = {(r["figure"], r["stat"]): r["verdict"] for r in run_records_report(a, again)["figures"]}
    assert same[("TTFT", "p50")] != "slower beyond noise" and same[("E2E", "p50")] != "slower beyond noise"


def test_a_replay_onto_nothing_fails_its_run_with_the_reason(admin_client) -> None:
    workload = save_workload(bursty_workload(), engine="demo")
    bad = admin_client.post(f"/admin/engines/workloadrecord/{workload.pk}/replay/", {"target": "not a url"})
    assert bad.status_code == 302 and not ReplayRunRecord.objects.exists()
    bad_body = admin_client.post(f"/admin/engines/workloadrecord/{workload.pk}/replay/",
                                 {"target": "http://127.0.0.1:9", "extra_body": "{not json"})
    assert bad_body.status_code == 302 and not ReplayRunRecord.objects.exists()
    reply = admin_client.post(f"/admin/engines/workloadrecord/{workload.pk}/replay/",
                              {"target": "http://127.0.0.1:9", "max_requests": "2", "max_seconds": "5",
                               "no_request_ids": "on", "extra_body": '{"repeat_penalty": 1.0}'})
    run = ReplayRunRecord.objects.get()
    assert reply.status_code == 302 and wait_for_run(run.pk, timeout=60)
    run.refresh_from_db()
    # Nothing answers: the run ends, each request an error the run keeps (not a crash, not "running").
    assert run.state == "done" and run.succeeded == 0 and run.request_count == 2
    sent = read_json_payload(run)["requests"]
    assert [r["sent_id"] for r in sent] == ["", ""] and all(r["error"] for r in sent)  # no X-Request-Id

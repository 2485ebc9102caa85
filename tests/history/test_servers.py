"""Every history record names the server that wrote it (``host:port``) and its fleet: servers that
share a database and an engine name keep their histories apart. Each record type gets its server;
a snapshot chart draws one server's engine, never rows of several in one line; the admin lists
show and filter by server; compare pages name each side's; rows saved before servers were
recorded read as "unknown" after the migration."""
from __future__ import annotations

import json
import re
import socket
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.urls import reverse
from django.utils import timezone

from engines.server import server_identity
from engines.admin.servers import UNRECORDED_PARAMETER
from engines.history import save_metrics_snapshot, save_trace
from engines.history.profiles import save_profile
from engines.models import UNRECORDED_SERVER_TEXT, MetricsSnapshot, ProfileRecord, RequestSummary, TraceRecord
from tests.history.trace_builder import serving_trace
from tests.server.test_profile_page_edges import small_profile

SNAPSHOTS = "admin:engines_metricssnapshot_changelist"
PORT = 8123
HERE = f"{socket.gethostname()}:{PORT}"


@pytest.fixture
def this_server(monkeypatch: pytest.MonkeyPatch, settings) -> str:
    """This process as ``serve`` names it on port 8123, in the fleet "blue"."""
    monkeypatch.setattr(server_identity, "_port", PORT)
    settings.FLEET_NAME = "blue"
    return HERE


# ------------------------------------------------------------------- each record, its server


@pytest.mark.django_db
def test_each_record_names_the_server_that_wrote_it_and_its_fleet(this_server: str) -> None:
    trace = save_trace(serving_trace(engine="smollm2", num_requests=3), engine="smollm2", model="m")
    snapshot = save_metrics_snapshot("smollm2", "m", {"num_running_requests": 1})
    profile = save_profile(small_profile("smollm2"), engine="smollm2")
    summaries = list(RequestSummary.objects.filter(trace=trace))
    assert len(summaries) == 3
    for row in (trace, snapshot, profile, *summaries):
        assert (row.server, row.fleet) == (HERE, "blue"), row
    stored = [TraceRecord.objects.get(pk=trace.pk), MetricsSnapshot.objects.get(pk=snapshot.pk),
              ProfileRecord.objects.get(pk=profile.pk)]
    assert {(r.server, r.fleet) for r in stored} == {(HERE, "blue")}
    assert trace.server_text == f"{HERE} (fleet blue)"
    # A trace another server recorded (a foreign server's, saved by a fleet job here) names that one;
    # its summaries follow it.
    elsewhere = save_trace(serving_trace(engine="mlc", num_requests=2), engine="gpu-1/m", model="m",
                           server="gpu-7:8000")
    assert {(r.server, r.fleet) for r in (elsewhere, *RequestSummary.objects.filter(trace=elsewhere))} == {
        ("gpu-7:8000", "blue")}


@pytest.mark.django_db
@pytest.mark.parametrize("where, problem", [({"server": ""}, "server must be a non-empty string"),
                                            ({"server": "h" * 201}, "server is 201 characters long"),
                                            ({"server": "a\x00:1"}, "server must not contain NUL"),
                                            ({"fleet": "f" * 101}, "fleet must be a string of at most 100"),
                                            ({"fleet": "b\x00"}, "fleet must not contain NUL")])
def test_a_server_or_fleet_the_columns_cannot_hold_is_refused(where: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        save_metrics_snapshot("e", "m", {}, **where)
    with pytest.raises(ValueError, match=problem):
        save_trace(serving_trace(num_requests=1), engine="e", model="m", **where)
    assert not TraceRecord.objects.exists() and not MetricsSnapshot.objects.exists()


# ------------------------------------------------------------- the snapshot charts, one server


#: Three servers writing one database under one engine name, in the same seconds: each its own
#: counters (tokens a snapshot apart, finished requests) and latency.
SERVERS = {"a:8001": (50, 6, 0.1), "b:8002": (500, 69, 2.0), "c:8003": (5000, 239, 7.0)}


def three_servers_snapshots(points: int = 12) -> None:
    start = timezone.now() - timedelta(seconds=10 * points)
    for i in range(points):
        for name, (tokens, finished, ttft) in SERVERS.items():
            save_metrics_snapshot("smollm2", "SmolLM2", {
                "decode_tokens_processed": tokens * 10 * i, "num_finished_requests": finished + i,
                "num_running_requests": 1, "ttft_s": {"p50": ttft / 2, "p99": ttft}},
                taken_at=start + timedelta(seconds=10 * i), retention=False, server=name, fleet="blue")


def series(data: dict[str, Any], label: str) -> list[float | None]:
    return next(s["values"] for c in data["charts"] for s in c["series"] if s["label"] == label)


@pytest.mark.django_db
def test_a_chart_draws_one_servers_engine_never_the_others_rows(admin_client) -> None:
    three_servers_snapshots()
    # The server with the newest snapshot, by default: the newest second's last row is c's.
    page = admin_client.get(reverse(SNAPSHOTS), {"engine": "smollm2"})
    data = page.context["snapshot_charts"]
    assert page.context["snapshot_charts_server"] == "c:8003" and data["count"] == 12
    assert len(data["x"]) == len(set(data["x"])) == 12                # one point a moment, not three
    assert set(series(data, "decode tok/s")[1:]) == {5000.0}          # c's rate only: no zigzag
    assert set(series(data, "TTFT p99")) == {7000.0}                  # c's TTFT, not a band of three
    assert "smollm2 on c:8003, the server with its newest snapshot: 12 snapshots" in page.content.decode()
    # Picked: a's alone, in the chart and in the list under it.
    page = admin_client.get(reverse(SNAPSHOTS), {"engine": "smollm2", "server": "a:8001"})
    data = page.context["snapshot_charts"]
    assert data["count"] == 12 and set(series(data, "decode tok/s")[1:]) == {50.0}
    assert set(series(data, "TTFT p99")) == {100.0}
    assert {s.server for s in page.context["cl"].result_list} == {"a:8001"}
    html = page.content.decode()
    embedded = json.loads(html.split('<script id="snapshot-charts-data" type="application/json">')[1]
                          .split("</script>")[0])
    assert embedded == json.loads(json.dumps(data))
    # The select offers each server of this engine, the one charted selected, and keeps the other filters.
    start = html.index('id="snapshot-charts-server"')
    select = html[start:html.index("</form>", start)]
    assert '<input type="hidden" name="engine" value="smollm2">' in select and 'name="p"' not in select
    assert '<option value="a:8001" selected>a:8001</option>' in select
    assert '<option value="b:8002">b:8002</option>' in select and '<option value="c:8003">c:8003</option>' in select
    assert "smollm2 on a:8001: 12 snapshots" in html


@pytest.mark.django_db
def test_rows_saved_before_servers_were_recorded_chart_on_their_own(admin_client) -> None:
    three_servers_snapshots(points=4)
    MetricsSnapshot.objects.filter(server="b:8002").update(server="", fleet="")
    page = admin_client.get(reverse(SNAPSHOTS), {"engine": "smollm2", "server": UNRECORDED_PARAMETER})
    data = page.context["snapshot_charts"]
    assert page.context["snapshot_charts_server"] == "" and data["count"] == 4
    assert set(series(data, "decode tok/s")[1:]) == {500.0}
    html = page.content.decode()
    assert f'<option value="-" selected>{UNRECORDED_SERVER_TEXT}</option>' in html
    assert "smollm2 on an unknown server (saved before servers were recorded): 4 snapshots" in html
    # A server that has no snapshot of the engine charts nothing, and says so.
    none = admin_client.get(reverse(SNAPSHOTS), {"engine": "smollm2", "server": "nowhere:1"}).content.decode()
    assert "No snapshot of smollm2 on nowhere:1 in this selection to chart." in none


@pytest.mark.django_db
def test_the_unfiltered_snapshot_list_links_each_servers_engine(admin_client) -> None:
    three_servers_snapshots(points=2)
    save_metrics_snapshot("demo", "demo", {}, retention=False, server="a:8001")
    html = admin_client.get(reverse(SNAPSHOTS)).content.decode()
    links = html[html.index('id="snapshot-charts-pick"'):html.index("</p>", html.index('id="snapshot-charts-pick"'))]
    assert re.findall(r'<a href="[^"]*">([^<]*)</a>', links) == [
        "demo on a:8001", "smollm2 on a:8001", "smollm2 on b:8002", "smollm2 on c:8003"]
    assert '<a href="?engine=smollm2&amp;server=b%3A8002">' in links
    one = admin_client.get(reverse(SNAPSHOTS), {"server": "a:8001"}).content.decode()
    assert "smollm2 on b:8002" not in one and "smollm2 on a:8001" in one


# ------------------------------------------------------------------ the lists: column and filter


def records_of_two_servers_and_an_old_one() -> dict[str, list[Any]]:
    made: dict[str, list[Any]] = {}
    for name in ("a:8001", "b:8002", "old"):
        trace = save_trace(serving_trace(engine="smollm2", num_requests=2), engine="smollm2", model="m",
                           server=name, fleet="blue", retention=False)
        made[name] = [trace, save_profile(small_profile("smollm2"), engine="smollm2", server=name, fleet="blue",
                                          retention=False),
                      save_metrics_snapshot("smollm2", "m", {}, server=name, fleet="blue", retention=False)]
    for model in (TraceRecord, RequestSummary, ProfileRecord, MetricsSnapshot):
        model.objects.filter(server="old").update(server="", fleet="")  # as the migration leaves them
    return made


@pytest.mark.django_db
@pytest.mark.parametrize("model, rows", [("tracerecord", 1), ("requestsummary", 2), ("profilerecord", 1),
                                         ("metricssnapshot", 1)])
def test_each_history_list_shows_and_filters_by_server(admin_client, model: str, rows: int) -> None:
    records_of_two_servers_and_an_old_one()
    url = reverse(f"admin:engines_{model}_changelist")
    page = admin_client.get(url)
    html = page.content.decode()
    assert ('<td class="field-server_column"><span class="engines-server">a:<wbr>8001</span>'
            '<span class="engines-quiet">fleet blue</span></td>') in html
    assert f'<span class="engines-quiet" title="{UNRECORDED_SERVER_TEXT}">unknown</span>' in html
    (spec,) = [s for s in page.context["cl"].filter_specs if s.title == "server"]
    assert spec.lookup_choices == [("-", UNRECORDED_SERVER_TEXT), ("a:8001", "a:8001"), ("b:8002", "b:8002")]
    for picked, server in (("b:8002", "b:8002"), (UNRECORDED_PARAMETER, "")):
        listed = admin_client.get(url, {"server": picked}).context["cl"].result_list
        assert len(listed) == rows and {r.server for r in listed} == {server}, picked


@pytest.mark.django_db
def test_a_record_page_names_its_server_and_links_only_this_servers_engine(admin_client, this_server) -> None:
    mine = save_trace(serving_trace(engine="smollm2", num_requests=1), engine="smollm2", model="m")
    theirs = save_trace(serving_trace(engine="smollm2", num_requests=1), engine="smollm2", model="m",
                        server="b:8002")
    page = admin_client.get(reverse("admin:engines_tracerecord_change", args=[theirs.pk])).content.decode()
    assert '<span class="engines-server">b:<wbr>8002</span><span class="engines-quiet">fleet blue</span>' in page
    assert "recorded by another server" in page
    page = admin_client.get(reverse("admin:engines_tracerecord_change", args=[mine.pk])).content.decode()
    assert f'<span class="engines-server">{socket.gethostname()}:<wbr>{PORT}</span>' in page
    assert "recorded by another server" not in page


@pytest.mark.django_db
def test_comparisons_name_each_sides_server(admin_client) -> None:
    made = records_of_two_servers_and_an_old_one()
    (a, a_profile, _), (b, b_profile, _) = made["a:8001"], made["old"]
    text = admin_client.get(reverse("admin:engines_tracerecord_compare"), {"a": a.pk, "b": b.pk}).content.decode()
    assert '<span class="compare-server">a:8001 (fleet blue)</span>' in text
    assert f'<span class="compare-server">{UNRECORDED_SERVER_TEXT}</span>' in text
    text = admin_client.get(reverse("dashboard-profile-compare"),
                            {"a": a_profile.pk, "b": b_profile.pk}).content.decode()
    row = text[text.index('<tr id="compare-servers">'):]
    assert row[:row.index("</tr>")] == (f'<tr id="compare-servers"><th>Server</th><td>a:8001 (fleet blue)</td>'
                                        f'<td>{UNRECORDED_SERVER_TEXT}</td>')
    # A profile's page names its server, and its compare list the server of each other profile.
    page = admin_client.get(reverse("dashboard-profile", args=[a_profile.pk])).content.decode()
    assert '<td colspan="5" id="profile-server">a:8001 (fleet blue)</td>' in page
    assert " · on b:8002</option>" in page and " · on an unknown server</option>" in page


# ------------------------------------------------------------------------------ the migration


BEFORE = [("engines", "0004_fleet")]


@pytest.mark.django_db(transaction=True)
def test_rows_saved_before_the_migration_read_as_an_unknown_server(admin_client) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    now = timezone.now()
    trace = old.get_model("engines", "TraceRecord").objects.create(engine="smollm2", model="m", payload=b"")
    old.get_model("engines", "RequestSummary").objects.create(trace_id=trace.pk, engine="smollm2", request_id="r")
    old.get_model("engines", "MetricsSnapshot").objects.create(engine="smollm2", model="m", metrics={})
    old.get_model("engines", "ProfileRecord").objects.create(engine="smollm2", model="m", payload=b"")
    old.get_model("engines", "FleetRollup").objects.create(period="minute", start=now, server="h:pid1", engine="e")

    executor = MigrationExecutor(connection)  # a fresh loader sees the database at 0004
    executor.migrate(executor.loader.graph.leaf_nodes())

    for model in (TraceRecord, RequestSummary, MetricsSnapshot, ProfileRecord):
        assert list(model.objects.values_list("server", "fleet")) == [("", "")], model
    from engines.models import FleetRollup

    assert list(FleetRollup.objects.values_list("server", "fleet")) == [("h:pid1", "")]
    # The default stays in the database: a server of the older version, which names no server,
    # still writes a row, and it reads as unknown too.
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO engines_metricssnapshot (engine, model, taken_at, metrics) "
                       "VALUES ('smollm2', 'm', %s, '{}')", [now])
    assert list(MetricsSnapshot.objects.values_list("server", flat=True)) == ["", ""]
    page = admin_client.get(reverse("admin:engines_tracerecord_change", args=[trace.pk])).content.decode()
    assert f'title="{UNRECORDED_SERVER_TEXT}">unknown</span>' in page

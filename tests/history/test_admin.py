"""The trace history in the Django admin: lists, detail, downloads, compare, permissions."""
from __future__ import annotations

import gzip
import re

import orjson
import pytest
from django.contrib.admin.templatetags.admin_list import result_headers
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils.text import capfirst

from engines.history import save_metrics_snapshot, save_trace
from engines.history.columns import REQUEST_COLUMNS, STATISTIC_COLUMNS
from engines.models import MetricsSnapshot, RequestSummary, TraceRecord
from engines.runtime import FinishReason
from tests.history.trace_builder import T0, TraceBuilder, serving_trace

pytestmark = pytest.mark.django_db

LIST = "admin:engines_tracerecord_changelist"
REQUESTS = "admin:engines_requestsummary_changelist"


def change_url(record: TraceRecord) -> str:
    return reverse("admin:engines_tracerecord_change", args=[record.pk])


def download(client, record: TraceRecord, kind: str):
    name = "admin:engines_tracerecord_download_json" if kind == "json" else "admin:engines_tracerecord_download_gzip"
    return client.get(reverse(name, args=[record.pk]))


def body(response) -> bytes:
    return b"".join(response.streaming_content) if response.streaming else response.content


def test_round_trip_save_list_filter_detail_download(admin_client, saved_trace):
    record, trace = saved_trace
    other = save_trace(serving_trace(engine="eng-b", num_requests=1), engine="eng-b", model="other-model")

    page = admin_client.get(reverse(LIST))
    assert page.status_code == 200
    assert f"#{record.pk}" in page.text and f"#{other.pk}" in page.text

    filtered = admin_client.get(reverse(LIST), {"engine": "eng-a"})
    assert list(filtered.context["cl"].result_list) == [record]
    by_model = admin_client.get(reverse(LIST), {"model": "other-model"})
    assert list(by_model.context["cl"].result_list) == [other]

    detail = admin_client.get(change_url(record))
    assert detail.status_code == 200
    assert "baseline run" in detail.text and "req-2" in detail.text
    assert "Request latency" in detail.text and "Phases" in detail.text
    assert f"CRC32 {record.payload_crc32:08x}" in detail.text and "this page does not read it" in detail.text

    as_json = download(admin_client, record, "json")
    assert as_json.status_code == 200 and as_json["Content-Type"] == "application/json"
    assert as_json["Content-Disposition"].startswith('attachment; filename="trace-eng-a-')
    assert as_json["Content-Disposition"].endswith('.json"')
    assert orjson.loads(body(as_json)) == trace

    as_gz = download(admin_client, record, "gz")
    assert as_gz.status_code == 200 and as_gz["Content-Type"] == "application/gzip"
    assert as_gz["Content-Disposition"].endswith('.json.gz"')
    assert orjson.loads(gzip.decompress(as_gz.content)) == trace
    assert as_gz.content == bytes(TraceRecord.objects.get(pk=record.pk).payload)


def test_list_is_newest_first_and_filters_by_source_and_date(admin_client):
    first = save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo", source="automatic")
    second = save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo", source="api")
    page = admin_client.get(reverse(LIST))
    assert list(page.context["cl"].result_list) == [second, first]
    assert list(admin_client.get(reverse(LIST), {"source": "automatic"}).context["cl"].result_list) == [first]
    today = first.captured_at.replace(hour=0, minute=0, second=0, microsecond=0).isoformat()
    dated = admin_client.get(reverse(LIST), {"captured_at__gte": today})
    assert len(dated.context["cl"].result_list) == 2


def test_search_by_note_tag_and_request_id(admin_client, saved_trace):
    record, _ = saved_trace
    b = TraceBuilder(engine="eng-a")
    b.add("chatcmpl-XYZ", "request added to engine", T0)
    other = save_trace(b.export(), engine="eng-a", model="demo", note="after the config change")

    def found(term: str) -> list[TraceRecord]:
        return list(admin_client.get(reverse(LIST), {"q": term}).context["cl"].result_list)

    assert found("baseline") == [record]
    assert found("nightly") == [record]
    assert found("config change") == [other]
    assert found("chatcmpl-XYZ") == [other]
    assert found("req-1") == [record]
    assert found("req") == []  # request ids match exactly, never by substring


def test_user_data_is_escaped(admin_client):
    b = TraceBuilder(engine="eng-a")
    evil = '<script>alert("rid")</script>'
    b.add(evil, "request added to engine", T0)
    b.add(evil, "finish", T0 + 5, {"finish_reason": "<b>stop</b>"})
    record = save_trace(b.export(), engine="eng-a", model="demo", note='<img src=x onerror="alert(1)">')
    for url in (change_url(record), reverse(LIST), reverse(REQUESTS)):
        text = admin_client.get(url).text
        assert "<script>alert" not in text and "<img src=x" not in text and "<b>stop</b>" not in text
    assert "&lt;script&gt;alert" in admin_client.get(change_url(record)).text


def test_detail_request_table_sorts(admin_client, saved_trace):
    record, _ = saved_trace
    url = change_url(record)
    default = admin_client.get(url).context["request_rows"]
    assert [row[0] for row in default] == [("request_id", f"req-{i}") for i in (2, 1, 0)]  # slowest e2e first
    by_ttft = admin_client.get(url, {"requests_sort": "ttft_us"}).context["request_rows"]
    assert [row[0][1] for row in by_ttft] == ["req-0", "req-1", "req-2"]
    bogus = admin_client.get(url, {"requests_sort": "payload"})
    assert bogus.status_code == 200 and len(bogus.context["request_rows"]) == 3
    assert reverse(REQUESTS) + f"?trace__id__exact={record.pk}" in admin_client.get(url).text


def test_anonymous_users_go_to_login(client, saved_trace):
    record, _ = saved_trace
    for url in (reverse(LIST), change_url(record), reverse(REQUESTS),
                reverse("admin:engines_tracerecord_download_json", args=[record.pk]),
                reverse("admin:engines_tracerecord_download_gzip", args=[record.pk]),
                reverse("admin:engines_tracerecord_compare") + "?a=1&b=2"):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("admin:login")), url


def test_staff_without_permissions_are_refused(client, django_user_model, saved_trace):
    record, _ = saved_trace
    client.force_login(django_user_model.objects.create_user("nobody", password="pw", is_staff=True))
    assert client.get(reverse(LIST)).status_code == 403
    assert client.get(reverse("admin:engines_tracerecord_download_gzip", args=[record.pk])).status_code == 403
    assert client.get(reverse("admin:engines_tracerecord_compare") + "?a=1&b=2").status_code == 403


def test_view_only_staff_can_read_and_download_but_not_delete(viewer_client, saved_trace):
    record, trace = saved_trace
    page = viewer_client.get(reverse(LIST))
    assert page.status_code == 200
    actions = [name for name, _ in page.context["action_form"].fields["action"].choices]
    assert "compare_traces" in actions and "verify_payloads" in actions
    assert "delete_selected" not in actions and "apply_retention_limits" not in actions
    detail = viewer_client.get(change_url(record))
    assert detail.status_code == 200 and "baseline run" in detail.text
    assert orjson.loads(body(download(viewer_client, record, "json"))) == trace
    delete = reverse("admin:engines_tracerecord_delete", args=[record.pk])
    assert viewer_client.get(delete).status_code == 403
    assert viewer_client.post(delete, {"post": "yes"}).status_code == 403
    refused = viewer_client.post(reverse(LIST), {"action": "delete_selected", "_selected_action": [record.pk],
                                                 "post": "yes"})
    assert refused.status_code in (200, 302)
    assert TraceRecord.objects.filter(pk=record.pk).exists()
    # Notes are not editable without the change permission.
    viewer_client.post(change_url(record), {"note": "changed", "tags": ""})
    assert TraceRecord.objects.get(pk=record.pk).note == "baseline run"


def test_staff_with_change_permission_edit_only_note_and_tags(client, django_user_model, saved_trace):
    record, _ = saved_trace
    user = django_user_model.objects.create_user("editor", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=["view_tracerecord", "change_tracerecord"]))
    client.force_login(user)
    response = client.post(change_url(record), {"note": "edited <note>", "tags": " a, b ,a", "engine": "hijack"})
    assert response.status_code == 302
    saved = TraceRecord.objects.get(pk=record.pk)
    assert (saved.note, saved.tags, saved.engine) == ("edited <note>", "a,b", "eng-a")
    assert bytes(saved.payload) == bytes(record.payload)


def test_bulk_delete_removes_summaries(admin_client, saved_trace):
    record, _ = saved_trace
    keep = save_trace(serving_trace(engine="eng-b", num_requests=2), engine="eng-b", model="demo")
    confirm = admin_client.post(reverse(LIST), {"action": "delete_selected", "_selected_action": [record.pk]})
    assert confirm.status_code == 200
    assert "with its 3 request summaries" in confirm.text
    done = admin_client.post(reverse(LIST), {"action": "delete_selected", "_selected_action": [record.pk],
                                             "post": "yes"})
    assert done.status_code == 302
    assert list(TraceRecord.objects.values_list("pk", flat=True)) == [keep.pk]
    assert set(RequestSummary.objects.values_list("trace_id", flat=True)) == {keep.pk}


def test_apply_retention_action(admin_client, settings):
    settings.TRACE_RETENTION_MAX_RECORDS = 1
    old = [save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo", retention=False)
           for _ in range(3)]
    other = save_trace(serving_trace(num_requests=1), engine="eng-b", model="demo", retention=False)
    other2 = save_trace(serving_trace(num_requests=1), engine="eng-b", model="demo", retention=False)
    response = admin_client.post(reverse(LIST), {"action": "apply_retention_limits",
                                                 "_selected_action": [old[0].pk]}, follow=True)
    assert "Retention removed 2 trace records" in response.text
    assert set(TraceRecord.objects.values_list("pk", flat=True)) == {old[2].pk, other.pk, other2.pk}


def test_compare_two_traces(admin_client):
    a = save_trace(serving_trace(num_requests=2, completion_tokens=3), engine="eng-a", model="demo", note="before")
    b = save_trace(serving_trace(num_requests=4, completion_tokens=6), engine="eng-a", model="demo", note="after")
    response = admin_client.post(reverse(LIST), {"action": "compare_traces", "_selected_action": [b.pk, a.pk]})
    assert response.status_code == 302
    page = admin_client.get(response["Location"])
    assert page.status_code == 200
    text = page.text
    assert f"#{a.pk}" in text and f"#{b.pk}" in text and "before" in text and "after" in text
    comparison = page.context["comparison"]
    assert (comparison.a, comparison.b) == (a, b)  # older is the baseline
    ttft = next(row for row in comparison.requests if row.label == "Time to first token")
    p50 = next(c for c in ttft.changes if c.stat == "p50")
    # A: ttft 1101, 1201 -> p50 1151 µs; B: 1101..1401 -> p50 1251 µs.
    assert (p50.a, p50.b) == pytest.approx((1.151, 1.251))
    assert p50.change == pytest.approx(0.1 / 1.151)
    decode = next(row for row in comparison.phases if row.label == "decode")
    counts = next(c for c in decode.changes if c.stat == "count")
    assert (counts.a, counts.b, counts.change) == (4, 20, pytest.approx(4.0))
    assert "Phase durations" in text and "+400.0%" in text


@pytest.mark.parametrize("selected", [1, 3])
def test_compare_needs_exactly_two(admin_client, selected):
    records = [save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo") for _ in range(selected)]
    response = admin_client.post(reverse(LIST), {"action": "compare_traces",
                                                 "_selected_action": [r.pk for r in records]}, follow=True)
    assert f"Select exactly two trace records to compare ({selected} selected)." in response.text


def test_compare_view_with_bad_ids(admin_client, saved_trace):
    record, _ = saved_trace
    url = reverse("admin:engines_tracerecord_compare")
    for query in (f"?a={record.pk}&b={record.pk}", f"?a={record.pk}&b=999999", "?a=x&b=", "",
                  # Unicode digits int() refuses, and ids past any integer column.
                  f"?a=\u00b2&b={record.pk}", f"?a={10**30}&b={record.pk}"):
        response = admin_client.get(url + query, follow=True)
        assert "Compare needs two different existing trace records" in response.text


@pytest.mark.parametrize("stats", [
    {"requests": {"ttft_us": 5, "e2e_us": [1]}, "phases": [5, {"phase": "decode", "count": "many"}]},
    {"requests": {"completion_tokens": {"total": "12"}}},
    "not statistics",
])
def test_malformed_statistics_render_not_a_500(admin_client, saved_trace, stats):
    record, _ = saved_trace
    other = save_trace(serving_trace(num_requests=2), engine="eng-a", model="demo")
    TraceRecord.objects.filter(pk=record.pk).update(stats=stats)
    assert admin_client.get(change_url(record)).status_code == 200
    compare = reverse("admin:engines_tracerecord_compare") + f"?a={record.pk}&b={other.pk}"
    assert admin_client.get(compare).status_code == 200


def verify(client, *records: TraceRecord):
    """The list's "Verify stored payloads" action on ``records``: the page it ends on."""
    return client.post(reverse(LIST), {"action": "verify_payloads", "_selected_action": [r.pk for r in records]},
                       follow=True)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip"])
def test_corrupt_payload_is_reported_not_a_500(admin_client, saved_trace, damage):
    """The record's page never reads the payload (so it cannot tell); every read of it checks
    it and says what is wrong, and the verify action checks it on request."""
    record, _ = saved_trace
    intact = save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo")
    payload = bytes(record.payload)
    broken = {"truncate": payload[: len(payload) // 2], "garbage": b"not gzip at all",
              "flip": payload[:20] + bytes([payload[20] ^ 0xFF]) + payload[21:]}[damage]
    TraceRecord.objects.filter(pk=record.pk).update(payload=broken)

    detail = admin_client.get(change_url(record))
    assert detail.status_code == 200 and "Download .json" in detail.text
    for kind in ("json", "gz"):
        response = download(admin_client, record, kind)
        assert response.status_code == 409
        assert "cannot be downloaded" in response.text
    data = admin_client.get(reverse("dashboard-trace-data", args=[record.pk]))
    assert data.status_code == 409 and "The stored trace payload" in data.json()["error"]

    checked = verify(admin_client, record, intact).text
    assert "Checked 2 trace records: 1 damaged." in checked
    assert f"#{record.pk}: The stored trace payload" in checked and f"#{intact.pk}:" not in checked
    assert "every stored payload is intact" in verify(admin_client, intact).text


def test_the_detail_page_never_reads_the_payload(admin_client, saved_trace):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    record, _ = saved_trace
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(change_url(record)).status_code == 200
    assert not any('"payload"' in q["sql"] for q in queries.captured_queries)


def test_payload_without_checksum_is_checked_by_inflating(admin_client, saved_trace):
    record, trace = saved_trace
    TraceRecord.objects.filter(pk=record.pk).update(payload_crc32=None)
    assert orjson.loads(body(download(admin_client, record, "json"))) == trace
    assert "no checksum" in admin_client.get(change_url(record)).text
    assert "every stored payload is intact" in verify(admin_client, record).text
    truncated = bytes(record.payload)[:-12]
    TraceRecord.objects.filter(pk=record.pk).update(payload=truncated, compressed_bytes=len(truncated))
    assert download(admin_client, record, "json").status_code == 409
    assert f"#{record.pk}: The stored payload ends early" in verify(admin_client, record).text


def test_request_list_filters_sorts_and_links_back(admin_client, saved_trace):
    record, _ = saved_trace
    b = TraceBuilder(engine="eng-b")
    b.add("slow", "request added to engine", T0).add("slow", "first token", T0 + 99_000)
    b.add("slow", "finish", T0 + 100_000, {"finish_reason": "stop"})
    b.add("cut", "request added to engine", T0)
    other = save_trace(b.export(), engine="eng-b", model="demo")

    page = admin_client.get(reverse(REQUESTS))
    assert page.status_code == 200
    assert change_url(record) in page.text and change_url(other) in page.text

    def ids(**params) -> list[str]:
        return [s.request_id for s in admin_client.get(reverse(REQUESTS), params).context["cl"].result_list]

    assert ids(engine="eng-b") == ["cut", "slow"]
    assert ids(finish_reason="stop") == ["slow"]
    assert ids(finish_reason="-") == ["cut"]
    assert ids(finish_reason="length", o="7") == ["req-0", "req-1", "req-2"]  # column 7: TTFT ascending
    assert ids(trace__id__exact=str(record.pk), o="-11") == ["req-2", "req-1", "req-0"]  # column 11: e2e descending
    assert ids(q="req-1") == ["req-1"]


def test_request_columns_are_declared_once(admin_client, saved_trace):
    """engines.history.columns is the one list of request columns: the trace page's table, its
    request statistics, the request list and a summary's own page all follow it."""
    record, _ = saved_trace
    headers = [c.header for c in REQUEST_COLUMNS]
    assert headers[:2] == ["request id", "finish reason"] and "TTFT (ms)" in headers

    detail = admin_client.get(change_url(record)).context
    assert [h["label"] for h in detail["request_headers"]] == headers
    assert [row.label for row in detail["report"].requests] == [c.statistic for c in STATISTIC_COLUMNS]
    assert set(record.stats["requests"]) == {c.field for c in STATISTIC_COLUMNS}

    listed = list(result_headers(admin_client.get(reverse(REQUESTS)).context["cl"]))
    assert [h["text"] for h in listed] == [headers[0], "trace", "engine", "server", *headers[1:], "diagnosis"]
    # Across all history only indexed columns sort (a million rows); one trace's table sorts by any.
    assert {h["text"] for h in listed if h["sortable"]} == {
        "request id", "trace", "engine", "server", "finish reason", "queue (ms)", "TTFT (ms)", "e2e (ms)"}

    summary = RequestSummary.objects.get(trace=record, request_id="req-0")
    page = admin_client.get(reverse("admin:engines_requestsummary_change", args=[summary.pk]))
    assert page.status_code == 200
    assert all(f"{capfirst(header)}:</label>" in page.text for header in headers)
    assert f"{summary.e2e_us / 1000:,.1f}" in page.text  # durations in ms, as in the list


def test_finish_reason_filter_offers_the_engines_finish_reasons(admin_client, saved_trace):
    changelist = admin_client.get(reverse(REQUESTS)).context["cl"]
    spec = next(f for f in changelist.filter_specs if f.parameter_name == "finish_reason")
    assert [value for value, _ in spec.lookup_choices] == [*(r.value for r in FinishReason), "-"]
    assert {"stop", "length", "abort", "preempt"} <= {value for value, _ in spec.lookup_choices}


def test_list_pages_do_not_query_per_row(admin_client, django_assert_max_num_queries):
    for _ in range(25):
        save_trace(serving_trace(num_requests=4), engine="eng-a", model="demo", retention=False)
    # Session, user, page rows, count, one distinct per filter: fixed, whatever the row count.
    with django_assert_max_num_queries(10):
        assert admin_client.get(reverse(LIST)).status_code == 200
    with django_assert_max_num_queries(8):
        assert admin_client.get(reverse(REQUESTS)).status_code == 200


def test_list_query_never_selects_the_payload(admin_client, saved_trace, django_assert_max_num_queries):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        admin_client.get(reverse(LIST))
        admin_client.get(reverse(REQUESTS))
    selects = [q["sql"] for q in queries.captured_queries if "engines_tracerecord" in q["sql"]]
    assert selects and not any('"payload"' in sql for sql in selects)


def test_metrics_snapshots_admin(admin_client):
    snap = save_metrics_snapshot("eng-a", "demo", {"num_running": 3, "<k>": "<v>"})
    assert admin_client.get(reverse("admin:engines_metricssnapshot_changelist")).status_code == 200
    detail = admin_client.get(reverse("admin:engines_metricssnapshot_change", args=[snap.pk]))
    assert detail.status_code == 200 and "num_running" in detail.text and "&lt;k&gt;" in detail.text
    assert MetricsSnapshot.objects.count() == 1


@pytest.mark.django_db(transaction=True)
async def test_json_download_streams_asynchronously_under_asgi(async_client, django_user_model):
    from asgiref.sync import sync_to_async

    trace = serving_trace(num_requests=2)
    record = await sync_to_async(save_trace)(trace, engine="eng-a", model="demo")
    user = await django_user_model.objects.acreate(username="root", is_staff=True, is_superuser=True)
    await async_client.aforce_login(user)
    response = await async_client.get(reverse("admin:engines_tracerecord_download_json", args=[record.pk]))
    assert response.status_code == 200 and response.is_async
    assert int(response["Content-Length"]) == record.payload_bytes
    assert orjson.loads(b"".join([piece async for piece in response.streaming_content])) == trace


def test_request_summary_detail_links_trace_without_loading_payload(admin_client, saved_trace):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    record, _ = saved_trace
    summary = RequestSummary.objects.get(trace=record, request_id="req-1")
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse("admin:engines_requestsummary_change", args=[summary.pk]))
    assert page.status_code == 200
    assert change_url(record) in page.text and "req-1" in page.text
    assert not any('"payload"' in q["sql"] for q in queries.captured_queries)


def test_trace_list_shows_the_retention_limits(admin_client, settings):
    settings.TRACE_RETENTION_MAX_RECORDS, settings.TRACE_RETENTION_MAX_BYTES = 7, 3 << 20
    settings.TRACE_RETENTION_MAX_DAYS = 12
    page = admin_client.get(reverse("admin:engines_tracerecord_changelist"))
    assert page.status_code == 200
    limits = page.text[page.text.index('id="retention-limits"'):]
    limits = limits[:limits.index("</p>")]
    assert "the newest 7 records" in limits and "3.0\xa0MB" in limits and "older than 12 days" in limits
    settings.TRACE_RETENTION_MAX_RECORDS = settings.TRACE_RETENTION_MAX_BYTES = settings.TRACE_RETENTION_MAX_DAYS = 0
    limits = admin_client.get(reverse("admin:engines_tracerecord_changelist")).text
    assert "any number of records" in limits and "any size" in limits and "of any age" in limits


def test_the_admin_bounds_the_note_as_the_api_does(admin_client, saved_trace):
    record, _ = saved_trace
    from engines.history import MAX_NOTE_CHARS

    response = admin_client.post(change_url(record), {"note": "n" * (MAX_NOTE_CHARS + 1), "tags": ""})
    assert response.status_code == 200 and response.context["adminform"].form.errors["note"]
    assert TraceRecord.objects.get(pk=record.pk).note == record.note
    admin_client.post(change_url(record), {"note": "n" * MAX_NOTE_CHARS, "tags": ""})
    assert len(TraceRecord.objects.get(pk=record.pk).note) == MAX_NOTE_CHARS


def test_statistics_of_a_thousand_and_more_drop_their_decimals(db):
    """A trace page's statistics: figures under 1,000 with two decimals, larger ones without (noise
    at that size; eight columns of "13,106.67" overflowed the page beside the sidebar at 900 px)."""
    from types import SimpleNamespace

    from django.template.loader import render_to_string

    row = SimpleNamespace(label="Decode time", unit="ms",
                          values={"count": 1234, "mean": 13106.674, "p50": 48.634, "p90": -2500.4, "max": None})
    html = render_to_string("admin/engines/includes/stat_table.html", {
        "rows": [row], "stats": list(row.values), "label_header": "metric", "empty_text": "none"})
    cells = re.findall(r'<td class="numeric">([^<]*)</td>', html)
    assert cells == ["1,234", "13,107", "48.63", "-2,500", "—"]

"""What the history lists and a trace record's page show a person: note, tags and capture source on
the trace list with a link into the timeline, readable capture windows, the profile list's links,
and none of it costing a query per row. (How the lists fit the screen: tests/browser/test_history_pages.py.)"""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

import pytest
from django.contrib.admin.templatetags.admin_list import result_headers
from django.urls import reverse

from engines.admin.cells import LIST_NOTE_CHARS, capture_window_text
from engines.history import save_trace
from engines.history.profiles import save_profile
from engines.models import TraceRecord
from tests.history.trace_builder import T0, serving_trace
from tests.server.test_profile_page_edges import small_profile

pytestmark = pytest.mark.django_db

TRACES = "admin:engines_tracerecord_changelist"
PROFILES = "admin:engines_profilerecord_changelist"


def us(*when: int) -> int:
    return int(datetime(*when, tzinfo=dt_timezone.utc).timestamp() * 1_000_000)


def test_the_trace_list_shows_note_tags_source_and_a_timeline_link(admin_client, django_assert_max_num_queries):
    long_note = "batch 64, chunk 512: " + "the long story of this run " * 20
    noted = save_trace(serving_trace(num_requests=1), engine="eng-a", model="SmolLM2-135M", note=long_note,
                       tags="baseline, <ci>", source="dashboard")
    plain = save_trace(serving_trace(num_requests=1), engine="eng-a", model="eng-a", source="automatic")
    with django_assert_max_num_queries(10):
        page = admin_client.get(reverse(TRACES))
    html = page.content.decode()
    headers = [h["text"] for h in result_headers(page.context["cl"])]
    assert headers[1:] == ["trace", "engine", "server", "captured, source", "duration (ms)", "events", "requests",
                           "size", "note and tags", "timeline"]
    for record in (noted, plain):
        assert f'<a href="/dashboard/traces/{record.pk}/timeline/">open</a>' in html
    assert "Dashboard" in html and "Automatic" in html
    assert '<span class="engines-tag">baseline</span><span class="engines-tag">&lt;ci&gt;</span>' in html
    shown = html.split('<span class="engines-note" title="')[1].split("</span>")[0]
    title, text = shown.split('">')
    assert title == long_note and len(text) == LIST_NOTE_CHARS and text.endswith("…")
    assert '<span class="engines-quiet">SmolLM2-135M</span>' in html  # the model, where the engine's name is not it
    assert f"{noted.captured_at:%Y-%m-%d}" in html and f"{noted.captured_at:%H:%M:%S}" in html
    # The source still filters, the note and tags still search.
    assert list(admin_client.get(reverse(TRACES), {"source": "automatic"}).context["cl"].result_list) == [plain]
    assert list(admin_client.get(reverse(TRACES), {"q": "<ci>"}).context["cl"].result_list) == [noted]


def test_a_trace_records_capture_window_reads_as_times_and_a_duration(admin_client):
    record = save_trace(serving_trace(num_requests=2), engine="eng-a", model="demo")
    html = admin_client.get(reverse("admin:engines_tracerecord_change", args=[record.pk])).content.decode()
    window = capture_window_text(record.first_event_ts, record.last_event_ts)
    assert window == "2023-11-14 22:13:20.000 – 22:13:20.003 UTC (3 ms)"
    assert window in html and str(record.first_event_ts) not in html
    assert record.first_event_ts == T0


@pytest.mark.parametrize("first, last, text", [
    (us(2026, 3, 1, 9, 5, 7) + 250_000, us(2026, 3, 1, 9, 5, 9) + 999_999,
     "2026-03-01 09:05:07.250 – 09:05:09.999 UTC (2.75 s)"),
    (us(2026, 3, 1, 23, 59, 30), us(2026, 3, 2, 0, 2, 50),
     "2026-03-01 23:59:30.000 – 2026-03-02 00:02:50.000 UTC (3 min 20 s)"),
    (us(2026, 3, 1), us(2026, 3, 1) + 850, "2026-03-01 00:00:00.000 – 00:00:00.000 UTC (850 µs)"),
    (us(2026, 3, 1), us(2026, 3, 1, 2, 30), "2026-03-01 00:00:00.000 – 02:30:00.000 UTC (2 h 30 min)"),
    (None, None, "no events"),
])
def test_capture_windows(first, last, text):
    assert capture_window_text(first, last) == text


def test_capture_windows_follow_the_sites_time_zone(settings):
    settings.TIME_ZONE = "Europe/Paris"
    assert capture_window_text(us(2026, 7, 1, 10), us(2026, 7, 1, 10, 0, 1)) == \
        "2026-07-01 12:00:00.000 – 12:00:01.000 CEST (1 s)"


def test_the_profile_list_links_each_profile_and_its_download(admin_client, django_assert_max_num_queries):
    records = [save_profile(small_profile(), engine="demo", note=f"run {i} <b>") for i in range(3)]
    with django_assert_max_num_queries(8):
        page = admin_client.get(reverse(PROFILES))
    html = page.content.decode()
    headers = [h["text"] for h in result_headers(page.context["cl"])]
    assert headers[1:] == ["profile", "engine", "server", "started, source", "duration", "steps", "kernel calls",
                           "stopped by", "note", "open"]
    for record in records:
        assert f'<a href="/dashboard/profiles/{record.pk}/">profile</a>' in html
        assert f'<a href="/dashboard/profiles/{record.pk}/profile.json.gz">.json.gz</a>' in html
    assert "run 0 &lt;b&gt;" in html and "<b>" not in html
    assert '<span class="engines-quiet">cpu</span>' in html and "API" in html


def test_history_lists_load_their_layout(admin_client):
    save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo")
    for name in ("tracerecord", "requestsummary", "profilerecord", "metricssnapshot"):
        html = admin_client.get(reverse(f"admin:engines_{name}_changelist")).content.decode()
        assert "engines/css/history.css" in html, name
    assert TraceRecord.objects.count() == 1

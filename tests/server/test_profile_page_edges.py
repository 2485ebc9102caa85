"""The profile pages' edges: missing or unnamed profiles answer with what is wrong (a page in the
admin's frame, or JSON for the data URLs), the compare form offers this engine's other
profiles or an id, the profile's timeline has no request controls, and user text stays text.

The pages' main paths against a real engine's profile are in ``test_profile_pages.py``;
these use a small profile made by the profiler's own serialiser (``ProfileResult.to_json``).
"""
from __future__ import annotations

import json
import re
import time
import zlib

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from engines.history import save_trace
from engines.history.profiles import save_profile
from engines.models import ProfileRecord
from engines.runtime.telemetry.profiler import PHASES, ProfileResult
from tests.history.trace_builder import serving_trace

pytestmark = pytest.mark.django_db
HOSTILE = '<script>alert(1)</script> "><img src=x onerror=alert(2)>'
MISSING = 987654


def kernel(name: str, calls: int, mean_us: float) -> dict:
    return {"name": name, "calls": calls, "total_us": calls * mean_us, "mean_us": mean_us, "p50_us": mean_us,
            "p99_us": 2 * mean_us, "bytes": 1 << 20, "flops": 1 << 21, "gbs": 12.345678901234, "gflops": 3.14159,
            "share_of_steps": 0.123456789, "peak_fraction": 0.5}


def small_profile(engine: str = "demo") -> dict:
    """Two kernels over three steps, with stacks: the shape ``ProfileResult.to_json`` saves. Taken
    now: retention drops old profiles as they are saved."""
    now = time.time_ns() // 1000
    steps = [[i, now + 1000 * i, 900.0, 2, 2, 0] + [50.0] * len(PHASES) for i in range(3)]
    return ProfileResult(
        engine=engine, model="demo", backend="cpu", device="cpu (2 cores)", started_at_us=now,
        duration_us=3000, stopped_by="max_steps", peak_gbs=20.0, peak_source="measured",
        kernels=[kernel("matmul 512x512", 24, 40.0), kernel("attention", 8, 25.0)], steps=steps,
        spans=[("decode step", 0, now, 900), ("matmul 512x512", 2, now + 100, 40)],
        spans_dropped=0, stacks={"interval_ms": 5, "samples": 3, "folded": [["engine:step;llama:forward", 3]]},
        config={"max_num_seqs": 4},
    ).to_json()


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(User.objects.create_user("staff", password="pw", is_staff=True, is_superuser=True))
    return client


def test_missing_profiles_are_named_on_a_page_in_the_admins_frame(staff: Client) -> None:
    record = save_profile(small_profile(), engine="demo")
    for path in (f"/dashboard/profiles/{MISSING}/", f"/dashboard/profiles/{MISSING}/timeline/",
                 f"/dashboard/profiles/compare/?a={record.pk}&b={MISSING}",
                 f"/dashboard/profiles/compare/?a={MISSING}&b={record.pk}"):
        page = staff.get(path)
        assert page.status_code == 404, path
        html = page.content.decode()
        assert f"There is no profile #{MISSING}" in html and 'class="breadcrumbs"' in html, path
        assert 'href="/admin/engines/profilerecord/"' in html
    # An id past the database's integers is as missing as any other, not a 500.
    huge = 10 ** 25
    assert staff.get(f"/dashboard/profiles/compare/?a={record.pk}&b={huge}").status_code == 404
    assert staff.get(f"/dashboard/profiles/{huge}/data.json").status_code == 404


def test_a_compare_without_two_ids_says_how_to_name_them(staff: Client) -> None:
    for query in ("", "?a=1", "?a=1&b=x", "?a=%3Cscript%3E&b=2"):
        page = staff.get(f"/dashboard/profiles/compare/{query}")
        assert page.status_code == 400, query
        assert "?a=&lt;id&gt;&amp;b=&lt;id&gt;" in page.content.decode()


def test_the_data_urls_answer_a_missing_profile_in_json(staff: Client) -> None:
    for name in ("data.json", "trace.json", "profile.json.gz"):
        response = staff.get(f"/dashboard/profiles/{MISSING}/{name}")
        assert response.status_code == 404 and response["Content-Type"] == "application/json", name
        assert not response.has_header("Content-Encoding")
        assert f"no profile #{MISSING}" in json.loads(response.content)["error"]


def test_staff_without_the_view_permission_are_refused() -> None:
    record = save_profile(small_profile(), engine="demo")
    client = Client()
    client.force_login(User.objects.create_user("clerk", password="pw", is_staff=True))
    for path in ("", "data.json", "profile.json.gz", "trace.json", "timeline/"):
        assert client.get(f"/dashboard/profiles/{record.pk}/{path}").status_code == 403, path
    client.force_login(user := User.objects.create_user("viewer", password="pw", is_staff=True))
    user.user_permissions.add(Permission.objects.get(codename="view_profilerecord"))
    assert client.get(f"/dashboard/profiles/{record.pk}/").status_code == 200


def test_the_compare_form_offers_this_engines_other_profiles_or_an_id(staff: Client) -> None:
    alone = save_profile(small_profile("solo"), engine="solo")
    html = staff.get(f"/dashboard/profiles/{alone.pk}/").content.decode()
    assert '<input type="number" name="b" id="compare-b"' in html and f'name="a" value="{alone.pk}"' in html

    first = save_profile(small_profile(), engine="demo", note=HOSTILE)
    second = save_profile(small_profile(), engine="demo")
    html = staff.get(f"/dashboard/profiles/{second.pk}/").content.decode()
    assert '<select name="b" id="compare-b"' in html
    assert f'<option value="{first.pk}">' in html and f'<option value="{second.pk}">' not in html
    assert f'<option value="{alone.pk}">' not in html  # another engine's profile is not offered
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html


def test_the_kernel_table_prints_units_not_floats(staff: Client) -> None:
    record = save_profile(small_profile(), engine="demo")
    html = staff.get(f"/dashboard/profiles/{record.pk}/").content.decode()
    row = html[html.index('<td data-sort="matmul 512x512">'):]
    row = row[:row.index("</tr>")]
    shown = re.sub(r' data-sort="[^"]*"', "", row)  # the sort keys keep full precision; the text does not
    assert re.findall(r">([^<>]*)</td>", shown) == [
        "matmul 512x512", "24", "960 µs", "40 µs", "40 µs", "80 µs", "12.3 %", "12.3", "3.14", "50.0 %"]


def test_the_profiles_timeline_has_no_request_controls(staff: Client) -> None:
    record = save_profile(small_profile(), engine=HOSTILE)
    page = staff.get(f"/dashboard/profiles/{record.pk}/timeline/")
    html = page.content.decode()
    assert page.status_code == 200
    assert 'id="timeline-search"' not in html and 'id="filter-e2e"' not in html and 'id="fit"' in html
    assert "click a lane: its summary" not in html
    source = json.loads(html.split('<script id="timeline-source" type="application/json">')[1].split("</script>")[0])
    assert source["kind"] == "profile" and source["data_url"] == f"/dashboard/profiles/{record.pk}/trace.json"
    assert source["requests_url"] is None and source["engine"] == HOSTILE
    assert "<script>alert(1)" not in html

    # A trace record's timeline keeps them.
    trace = save_trace(serving_trace(engine="demo", num_requests=2), engine="demo", model="demo")
    html = staff.get(f"/dashboard/traces/{trace.pk}/timeline/").content.decode()
    assert 'id="timeline-search"' in html and 'id="filter-e2e"' in html and "click a lane: its summary" in html


def test_a_damaged_profile_is_named_by_every_read_not_a_500(staff: Client) -> None:
    """Profiles are stored as traces are (gzip with a CRC): each read of the payload checks it,
    the record's pages that do not read it still open, and the admin's verify action finds it."""
    record = save_profile(small_profile(), engine="demo")
    other = save_profile(small_profile(), engine="demo")
    assert record.payload_crc32 == zlib.crc32(bytes(record.payload))
    payload = bytes(record.payload)
    ProfileRecord.objects.filter(pk=record.pk).update(payload=payload[:20] + bytes([payload[20] ^ 0xFF]) + payload[21:])
    for name in ("data.json", "trace.json", "profile.json.gz"):
        response = staff.get(f"/dashboard/profiles/{record.pk}/{name}")
        assert response.status_code == 409 and not response.has_header("Content-Encoding"), name
        assert "The stored profile payload fails its checksum" in json.loads(response.content)["error"], name
    assert staff.get(f"/dashboard/profiles/{record.pk}/").status_code == 200
    compare = staff.get(f"/dashboard/profiles/compare/?a={other.pk}&b={record.pk}")
    assert compare.status_code == 409 and "fails its checksum" in compare.content.decode()
    verified = staff.post("/admin/engines/profilerecord/", {"action": "verify_payloads",
                                                            "_selected_action": [record.pk, other.pk]}, follow=True)
    assert f"#{record.pk}: The stored profile payload fails its checksum" in verified.content.decode()
    assert staff.get(f"/dashboard/profiles/{other.pk}/profile.json.gz")["Content-Disposition"].startswith(
        f'attachment; filename="profile-demo-{other.pk}-')

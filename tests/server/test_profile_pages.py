"""The profile pages: staff only, the kernel table from the record, the data and downloads as
stored, two profiles compared with the changes marked, and user text escaped everywhere."""
from __future__ import annotations

import copy
import gzip
import re

import orjson
import pytest
from django.test import Client

from engines.history.profiles import save_profile
from engines.models import ProfileRecord
from engines.runtime.core.request import GenerationRequest
from engines.runtime.core.warm_up import warm_up
from engines.runtime.core.sampler import SamplingParams

pytestmark = pytest.mark.django_db
HOSTILE = '<script>alert(1)</script> "><img src=x onerror=alert(2)>'


@pytest.fixture(scope="module")
def profile(make_engine_for_pages) -> dict:
    """A real profile of the demo engine, with its stacks; one frame named with markup."""
    engine = make_engine_for_pages
    warm_up(engine)
    engine.start_profile(max_steps=12, stack_sampling=True)
    for i in range(3):
        engine.add_request(GenerationRequest(f"r{i}", engine.tokenizer.encode("profile pages " * 4),
                                             SamplingParams(max_tokens=16, ignore_eos=True), None, None))
    while engine.profiling.running is not None:
        engine.step()
    result = engine.stop_profile("demo").to_json()
    result["stacks"]["folded"].append([f"engine:step;{HOSTILE}", 1])
    result["stacks"]["samples"] += 1
    return result


@pytest.fixture(scope="module")
def make_engine_for_pages():
    from engines.runtime.core.engine import Engine, EngineConfig
    from engines.runtime.model.checkpoint import load_checkpoint
    from engines.runtime.model.demo_model import demo_checkpoint_path
    from engines.runtime.model.llama import LlamaModel

    ckpt = load_checkpoint(demo_checkpoint_path())
    return Engine(LlamaModel.from_checkpoint(ckpt, backend="cpu"), ckpt,
                  EngineConfig(max_num_seqs=4, num_pages=64, prefill_chunk_size=64))


@pytest.fixture
def staff() -> Client:
    from django.contrib.auth.models import User

    client = Client()
    client.force_login(User.objects.create_user("staff", password="pw", is_staff=True, is_superuser=True))
    return client


def test_the_page_shows_every_kernel_with_its_calls(staff: Client, profile: dict) -> None:
    record = save_profile(profile, engine=HOSTILE, note=HOSTILE)
    page = staff.get(f"/dashboard/profiles/{record.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    for kernel in profile["kernels"]:
        assert f'<td data-sort="{kernel["name"]}">{kernel["name"]}</td>' in html
        assert f'data-sort="{kernel["calls"]}">{kernel["calls"]:,}</td>' in html
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'class="breadcrumbs"' in html and "engines/js/profile/page.js" in html
    assert f'/dashboard/profiles/{record.pk}/timeline/' in html


def test_a_profile_that_started_itself_says_what_started_it(staff: Client, profile: dict) -> None:
    plain = save_profile(profile, engine="demo")
    assert plain.trigger == ""
    assert 'id="profile-trigger"' not in staff.get(f"/dashboard/profiles/{plain.pk}/").content.decode()
    record = save_profile({**profile, "trigger": {"trigger": f"request {HOSTILE!r} arriving",
                                                  "fired_by": "request 'x' arrived"}}, engine="demo")
    html = staff.get(f"/dashboard/profiles/{record.pk}/").content.decode()
    assert '<th>Started by</th><td colspan="5" id="profile-trigger">' in html
    assert "fired: request &#x27;x&#x27; arrived" in html and "<script>alert(1)</script>" not in html


def test_anonymous_users_go_to_the_login(profile: dict) -> None:
    record = save_profile(profile, engine="demo")
    for path in ("", "data.json", "profile.json.gz", "trace.json", "timeline/"):
        response = Client().get(f"/dashboard/profiles/{record.pk}/{path}")
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_data_download_and_trace_are_the_stored_profile(staff: Client, profile: dict) -> None:
    record = save_profile(profile, engine="demo")
    data = staff.get(f"/dashboard/profiles/{record.pk}/data.json")
    assert data["Content-Encoding"] == "gzip" and data["Content-Type"] == "application/json"
    assert orjson.loads(gzip.decompress(data.content)) == orjson.loads(orjson.dumps(profile))
    download = staff.get(f"/dashboard/profiles/{record.pk}/profile.json.gz")
    assert download.content == bytes(ProfileRecord.objects.get(pk=record.pk).payload)
    assert "attachment" in download["Content-Disposition"] and ".json.gz" in download["Content-Disposition"]
    trace = orjson.loads(gzip.decompress(staff.get(f"/dashboard/profiles/{record.pk}/trace.json").content))
    assert trace == profile["trace"]
    timeline = staff.get(f"/dashboard/profiles/{record.pk}/timeline/").content.decode()
    assert "Profile records" in timeline and f"/dashboard/profiles/{record.pk}/trace.json" in timeline


def test_missing_profiles_are_404(staff: Client) -> None:
    for path in ("/dashboard/profiles/999999/", "/dashboard/profiles/999999/data.json",
                 "/dashboard/profiles/compare/?a=999998&b=999999"):
        assert staff.get(path).status_code == 404
    assert staff.get("/dashboard/profiles/compare/?a=x").status_code == 400


def test_compare_marks_a_kernel_that_got_slower(staff: Client, profile: dict) -> None:
    slower = copy.deepcopy(profile)
    target = next(k for k in slower["kernels"] if k["name"] == "attention")
    target["mean_us"] *= 1.5
    target["total_us"] *= 1.5
    slower["kernels"].append({**target, "name": f"new {HOSTILE}"})
    a, b = save_profile(profile, engine="demo"), save_profile(slower, engine="demo", note=HOSTILE)
    page = staff.get(f"/dashboard/profiles/compare/?a={a.pk}&b={b.pk}")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<tr class="change-slower" data-kernel="attention">' in html and "+50.0 %" in html
    assert 'class="change-same" data-kernel="embedding"' in html
    assert "change-only-b" in html and "only in B" in html
    assert "<script>alert(1)</script>" not in html
    for phase in profile["phases"]:
        assert f"<td>{phase}</td>" in html


def test_the_compare_title_headers_and_every_change_say_b_against_a(staff: Client, profile: dict) -> None:
    """One direction everywhere, as on the trace compare: B is measured against A, the baseline;
    the title names B first, the headers say (B − A) / A, and so does every percentage, both ways round."""
    slower = copy.deepcopy(profile)
    for i, kernel in enumerate(slower["kernels"]):
        kernel["mean_us"] *= 1 + 0.2 * (i % 3)  # the same, 20 % and 40 % slower
    fields = slower["step_rows"]["fields"]
    timed = [fields.index(name) for name in ["total_us", *slower["phases"]]]
    for row in slower["step_rows"]["rows"]:
        for column in timed:
            row[column] *= 1.5
    saved = {record.pk: data for record, data in ((save_profile(profile, engine="demo"), profile),
                                                  (save_profile(slower, engine="demo"), slower))}
    first, second = saved

    def phase_means(data: dict) -> dict[str, float]:
        rows = data["step_rows"]["rows"]
        return {name: sum(r[fields.index(column)] for r in rows) / len(rows)
                for name, column in [("step", "total_us"), *((p, p) for p in data["phases"])]}

    for a, b in ((first, second), (second, first)):
        html = staff.get(f"/dashboard/profiles/compare/?a={a}&b={b}").content.decode()
        measured, baseline = map(int, re.search(r"<h1>Profile #(\d+) against #(\d+)</h1>", html).groups())
        assert (measured, baseline) == (b, a)
        assert f'A (baseline): <a href="/dashboard/profiles/{a}/">profile #{a}</a>' in html
        assert f'B: <a href="/dashboard/profiles/{b}/">profile #{b}</a>' in html
        assert f'<th class="num">A: #{a}</th><th class="num">B: #{b}</th><th class="num">(B − A) / A</th>' in html
        assert ">A mean</th>" in html and ">B mean</th>" in html
        assert "mean, (B − A) / A</th>" in html and "Change is (B − A) / A" in html
        means = {pk: {k["name"]: k["mean_us"] for k in data["kernels"]} for pk, data in saved.items()}
        kernels = re.findall(r'data-kernel="([^"]+)">.*?<td class="num change[^"]*">([^<]*)</td>', html, re.S)
        assert len(kernels) == len(profile["kernels"])
        for name, shown in kernels:
            assert shown == f"{100 * (means[measured][name] / means[baseline][name] - 1):+.1f} %", name
        phases = re.findall(r"<tr><td>([^<]+)</td>(?:<td[^>]*>[^<]*</td>){2}<td class=\"num change\">([^<]*)</td>",
                            html)
        steps = {pk: phase_means(data) for pk, data in saved.items()}
        assert [name for name, _ in phases] == list(steps[a])
        for name, shown in phases:
            assert shown == f"{100 * (steps[measured][name] / steps[baseline][name] - 1):+.1f} %", name
        assert {shown for _, shown in phases} == ({"+50.0 %"} if b == second else {"-33.3 %"})


def test_the_admin_lists_profiles_and_compares_two(staff: Client, profile: dict) -> None:
    a, b = save_profile(profile, engine="demo"), save_profile(profile, engine="other")
    listing = staff.get("/admin/engines/profilerecord/?engine__exact=demo").content.decode()
    assert f"/dashboard/profiles/{a.pk}/" in listing and f"/dashboard/profiles/{b.pk}/" not in listing
    response = staff.post("/admin/engines/profilerecord/", {"action": "compare_two", "_selected_action": [a.pk, b.pk]})
    assert response.status_code == 302 and response["Location"] == f"/dashboard/profiles/compare/?a={a.pk}&b={b.pk}"
    change = staff.get(f"/admin/engines/profilerecord/{a.pk}/change/").content.decode()
    assert "Open the profile" in change and "not served by this server now" in change


def test_retention_keeps_each_engines_newest_profiles(profile: dict, settings) -> None:
    settings.TRACE_RETENTION_MAX_RECORDS = 2
    kept = [save_profile(profile, engine="demo") for _ in range(4)][-2:]
    save_profile(profile, engine="other")
    assert sorted(ProfileRecord.objects.filter(engine="demo").values_list("pk", flat=True)) == [r.pk for r in kept]
    assert ProfileRecord.objects.filter(engine="other").count() == 1

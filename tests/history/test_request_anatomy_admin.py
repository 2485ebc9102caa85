"""A saved request's anatomy in the admin: its waterfall and diagnosis on its page, and the slow
requests list (a TTFT or E2E threshold, per engine or across all history) with each diagnosis."""
from __future__ import annotations

import re

import pytest
from django.urls import reverse

from engines.history import save_trace
from engines.models import RequestSummary
from engines.runtime import PHASES
from tests.history.trace_builder import T0, TraceBuilder

pytestmark = pytest.mark.django_db

REQUESTS = "admin:engines_requestsummary_changelist"
QUEUED = "queued 1.9 s: all 64 sequence slots busy"
BEHIND = "waited 7.6 s behind one 3,855-token prefill (chunk 512)"


def breakdown(**seconds: float) -> dict[str, float]:
    return {phase: seconds.get(phase, 0.0) for phase in PHASES}


def anatomy_trace(engine: str) -> dict:
    """Three requests of ``engine``: TTFT 0.2 s, 2.5 s and 9.7 s, the slow two with a diagnosis; and one
    from a server that did not record its anatomy."""
    b = TraceBuilder(engine=engine)
    cases = {
        "quick": (200_000, breakdown(prefill=0.15, decode=0.3), []),
        "queued": (2_500_000, breakdown(queued=1.9, prefill=0.6, decode=0.5), [QUEUED]),
        "behind": (9_700_000, breakdown(server=0.05, behind_prefill=7.6, prefill=2.05, decode=0.3),
                   [BEHIND, "decode stretched 0.3 s by other requests' prefill chunks"]),
    }
    for rid, (ttft, parts, diagnosis) in cases.items():
        b.add(rid, "start queue", T0, {"prompt_tokens": 36})
        b.add(rid, "first token", T0 + ttft)
        b.add(rid, "finish", T0 + int(sum(parts.values()) * 1e6), {
            "finish_reason": "stop", "prompt_tokens": 36, "completion_tokens": 4,
            "time_breakdown": parts, "diagnosis": diagnosis})
    b.add("old", "start queue", T0)
    b.add("old", "first token", T0 + 5_000_000)
    b.add("old", "finish", T0 + 6_000_000, {"finish_reason": "stop"})
    return b.export()


@pytest.fixture
def saved() -> dict[str, RequestSummary]:
    record = save_trace(anatomy_trace("eng-a"), engine="eng-a", model="demo")
    save_trace(anatomy_trace("eng-b"), engine="eng-b", model="demo")
    return {s.request_id: s for s in RequestSummary.objects.filter(trace=record)}


def change_page(client, summary: RequestSummary) -> str:
    page = client.get(reverse("admin:engines_requestsummary_change", args=[summary.pk]))
    assert page.status_code == 200
    return page.text


def test_a_request_page_draws_its_waterfall_and_diagnosis(admin_client, saved) -> None:
    text = change_page(admin_client, saved["behind"])
    section = text[text.index('id="anatomy"'):]
    rows = re.findall(r'<tr data-phase="(\w+)">', section)
    assert rows == ["server", "prefill", "behind_prefill", "decode"]  # the phases that took time, in order
    bars = re.findall(r'data-phase="(\w+)" style="margin-left: ([\d.]+)%; width: ([\d.]+)%"', section)
    # Each bar starts where the one before it ended, and the last ends at 100 %.
    end = 0.0
    for _, offset, width in bars:
        assert float(offset) == pytest.approx(end, abs=1e-3)
        end = float(offset) + float(width)
    assert end == pytest.approx(100.0, abs=1e-2)
    assert "10.000 s" in section and "7.600" in section and "76 %" in section
    assert BEHIND in section and "decode stretched 0.3 s" in section
    assert "Timeline of its trace" in text and '<label>Time breakdown' not in text  # drawn, not dumped as JSON


def test_a_quick_request_says_nothing_stands_out_and_an_old_one_says_it_was_not_recorded(admin_client, saved) -> None:
    quick = change_page(admin_client, saved["quick"])
    assert "Nothing stands out" in quick and 'data-phase="decode"' in quick
    old = change_page(admin_client, saved["old"])
    assert "does not record where a request" in old and "anatomy-bar" not in old


def test_the_slow_requests_list_filters_by_threshold_per_engine_and_shows_why(admin_client, saved) -> None:
    def listed(**params: str) -> list[tuple[str, str]]:
        page = admin_client.get(reverse(REQUESTS), params)
        assert page.status_code == 200
        return sorted((s.engine, s.request_id) for s in page.context["cl"].result_list)

    assert listed(ttft_over="2") == [("eng-a", "behind"), ("eng-a", "old"), ("eng-a", "queued"),
                                     ("eng-b", "behind"), ("eng-b", "old"), ("eng-b", "queued")]
    assert listed(ttft_over="2", engine="eng-a") == [("eng-a", "behind"), ("eng-a", "old"), ("eng-a", "queued")]
    assert listed(ttft_over="9.5") == [("eng-a", "behind"), ("eng-b", "behind")]  # any number, not only a choice
    assert listed(e2e_over="5") == [("eng-a", "behind"), ("eng-a", "old"), ("eng-b", "behind"), ("eng-b", "old")]
    page = admin_client.get(reverse(REQUESTS), {"ttft_over": "2", "engine": "eng-a", "o": "-8"})
    cells = re.findall(r'class="engines-one-line engines-diagnosis" title="([^"]*)">([^<]*)<', page.text)
    assert cells == [(f"{BEHIND}\ndecode stretched 0.3 s by other requests&#x27; prefill chunks", f"{BEHIND} (+1)"),
                     (QUEUED, QUEUED)]  # slowest first (o=-8: TTFT descending)
    # The filter offers its thresholds; a threshold that is not seconds is refused, not ignored.
    spec = next(f for f in page.context["cl"].filter_specs if f.parameter_name == "ttft_over")
    assert [value for value, _ in spec.lookup_choices] == ["0.5", "1", "2", "5", "10"]
    custom = admin_client.get(reverse(REQUESTS), {"ttft_over": "9.5"}).context["cl"]
    spec = next(f for f in custom.filter_specs if f.parameter_name == "ttft_over")
    assert spec.lookup_choices[-1] == ("9.5", "over 9.5 s")  # shown as the one chosen
    for bad in ("soon", "-1", "nan"):
        refused = admin_client.get(reverse(REQUESTS), {"ttft_over": bad})
        assert refused.status_code == 302 and refused["Location"].endswith("?e=1"), bad

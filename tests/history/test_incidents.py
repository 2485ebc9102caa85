"""Stall incidents in the history: the watchdog's listener writes each as it stands (evidence and
close in either order), the admin lists them, lays one's evidence out and downloads it whole."""
from __future__ import annotations

import time

import orjson
import pytest
from django.urls import reverse

from engines.history.incidents import IncidentRecorder
from engines.models import StallIncidentRecord
from engines.watchdog.detector import StallIncident

pytestmark = pytest.mark.django_db

EVIDENCE = {
    "progress": {"steps": 41, "step_started_at": None, "work": 2},
    "thresholds": {"no_progress_s": 60.0, "step_s": 120.0, "loop_lag_s": 5.0},
    "server_stacks": 'Thread 1 (MainThread):\n  File "x.py", line 3, in parked_here\n    time.sleep(60)\n',
    "requests": [{"request_id": "r-\x00-1", "state": "decoding", "age_s": 75.5, "queued_s": 0.1, "prompt_tokens": 30,
                  "left_tokens": 0, "output_tokens": 12, "max_output_tokens": 600, "kv_pages": 3}],
    "requests_total": 1,
    "metrics": {"ttft_s": float("nan")},
    "missing": {"engine_stacks": "py-spy dump: Failed to suspend process", "trace": "tracing is off"},
}


def incident(**changes) -> StallIncident:
    fields = {"engine": "eng-a", "reason": "no_progress", "detail": "2 request(s) waiting and no step finished "
              "for 61.0 s (limit 60 s)", "opened_at": time.monotonic(), "opened_wall": 1_796_000_000.0}
    return StallIncident(**(fields | changes))


@pytest.mark.parametrize("order", ["evidence-then-close", "close-then-evidence"])
def test_the_row_ends_as_the_incident_ended_whichever_word_comes_first(order) -> None:
    record = IncidentRecorder()
    seen = incident()
    if order == "evidence-then-close":
        seen.evidence = EVIDENCE
        record(seen)
        seen.closed_at = seen.opened_at + 12.5
        record(seen)
    else:
        seen.closed_at = seen.opened_at + 12.5
        record(seen)
        seen.evidence = EVIDENCE
        record(seen)
    (row,) = StallIncidentRecord.objects.all()
    assert row.pk == record.record_pk(seen)
    assert (row.engine, row.reason, row.duration_s) == ("eng-a", "no_progress", 12.5)
    assert (row.closed_at - row.opened_at).total_seconds() == pytest.approx(12.5)
    # Kept as both databases can: NUL replaced, NaN as null.
    assert row.evidence["requests"][0]["request_id"] == "r-\ufffd-1" and row.evidence["metrics"]["ttft_s"] is None
    other = incident(opened_at=seen.opened_at + 100)
    record(other)
    assert StallIncidentRecord.objects.count() == 2 and record.record_pk(other) != row.pk


def test_the_admin_lists_an_incident_lays_its_evidence_out_and_downloads_it(admin_client) -> None:
    record = IncidentRecorder()
    seen = incident()
    seen.evidence = EVIDENCE
    record(seen)
    row = StallIncidentRecord.objects.get()
    listing = admin_client.get(reverse("admin:engines_stallincidentrecord_changelist"), {"reason": "no_progress"})
    assert listing.status_code == 200 and f"#{row.pk}" in listing.text
    assert "open (or its server ended first)" in listing.text and "no step finished" in listing.text
    page = admin_client.get(reverse("admin:engines_stallincidentrecord_change", args=[row.pk]))
    text = page.text
    assert page.status_code == 200
    assert "41 steps finished; no step in flight; 2 request(s) held" in text
    assert "Failed to suspend process" in text and "tracing is off" in text  # what was not taken, and why
    assert "r-\ufffd-1" in text and "12 / 600" in text  # the requests in flight
    assert "in parked_here" in text  # the stacks
    download = admin_client.get(reverse("admin:engines_stallincidentrecord_download", args=[row.pk]))
    assert download["Content-Disposition"] == f'attachment; filename="stall-eng-a-{row.pk}.json"'
    bundle = orjson.loads(download.content)
    assert bundle["evidence"]["server_stacks"] == EVIDENCE["server_stacks"] and bundle["duration_s"] is None
    assert admin_client.get(reverse("admin:engines_stallincidentrecord_add")).status_code == 403

"""One time format across the product: ``2026-12-01 20:02:56`` (24-hour), in the templates and the
admin as on the pages' scripts (static/engines/js/format.js; the browser tests check those)."""
from __future__ import annotations

from datetime import datetime, timezone

from django.contrib.admin.utils import display_for_value
from django.template import Context, Template

from engines.admin.cells import when_cell

MOMENT = datetime(2026, 12, 1, 20, 2, 56, tzinfo=timezone.utc)  # the site's zone is UTC


def test_templates_print_dates_and_times_in_the_one_format() -> None:
    shown = Template("{{ t }}|{{ t|date }}|{{ t|time }}|{{ t|date:'SHORT_DATETIME_FORMAT' }}").render(
        Context({"t": MOMENT}))
    assert shown == "2026-12-01 20:02:56|2026-12-01|20:02:56|2026-12-01 20:02"


def test_the_admin_prints_a_datetime_field_in_the_one_format() -> None:
    """A datetime column or read-only field (a fleet job's times, a record's capture time)."""
    assert display_for_value(MOMENT, "-") == "2026-12-01 20:02:56"
    assert when_cell(MOMENT) == '<span class="engines-when">2026-12-01 <span>20:02:56</span></span>'

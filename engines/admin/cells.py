"""How the history's admin pages print a value: durations, times, notes and tags, a trace's
capture window, the link to an engine's live page. Shared by every admin of the package."""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

from django.urls import reverse
from django.utils import timezone
from django.utils.formats import date_format, time_format
from django.utils.html import format_html, format_html_join
from django.utils.text import Truncator

from engines.models import ServerRecord
from engines.registry import registry
from engines.server.server_identity import server_id

__all__ = ["LIST_NOTE_CHARS", "capture_window_text", "engine_dashboard_link", "ms_text", "note_cell", "one_line_cell",
           "when_cell"]

#: How much of a note a list row shows (the whole note is the cell's tooltip and on the record).
LIST_NOTE_CHARS = 90


def engine_dashboard_link(record: ServerRecord, engine: str) -> str:
    """A link to the live dashboard page of ``record``'s engine, when this server wrote the record
    and serves the engine (another server's engine of that name is another engine)."""
    if record.server != server_id():
        return "recorded by another server"
    if registry.get(engine) is None:
        return "not served by this server now"
    return format_html('<a href="{}">{}</a>', reverse("dashboard-engine", args=[engine]), f"{engine}, live")


def ms_text(value_us: int | None) -> str:
    """Microseconds as milliseconds, or a dash for none."""
    return "—" if value_us is None else f"{value_us / 1000:,.1f}"


def note_cell(note: str, tags: list[str] | None = None) -> str:
    """A list cell with the start of ``note`` (whole in its tooltip) and ``tags`` as labels."""
    text = format_html('<span class="engines-note" title="{}">{}</span>', note,
                       Truncator(note).chars(LIST_NOTE_CHARS)) if note else ""
    labels = format_html_join("", '<span class="engines-tag">{}</span>', ((tag,) for tag in tags or ()))
    return format_html("{}{}", text, format_html('<span class="engines-tags">{}</span>', labels) if labels else "")


def one_line_cell(text: str) -> str:
    """A list cell with ``text`` on one line, cut short with an ellipsis where the column is too
    narrow for it (history.css) and whole in its tooltip: ids and names that broke over many
    lines, or pushed the table past its box, at 900 px."""
    return format_html('<span class="engines-one-line" title="{}">{}</span>', text, text)


def when_cell(moment: datetime, below: str = "") -> str:
    """A list cell with a date and time to the second in the site's time zone (the site's formats:
    debugsite/formats), the time under the date, and ``below`` under both."""
    local = timezone.localtime(moment)
    under = format_html('<span class="engines-quiet">{}</span>', below) if below else ""
    return format_html('<span class="engines-when">{} <span>{}</span></span>{}', date_format(local, "DATE_FORMAT"),
                       time_format(local, "TIME_FORMAT"), under)


def _local_time(us: int) -> datetime:
    return timezone.localtime(datetime.fromtimestamp(us / 1e6, tz=dt_timezone.utc))


def _seconds_text(us: float) -> str:
    """A duration as a person reads it: 850 µs, 12.3 ms, 7.23 s, 3 min 20 s."""
    if us < 1000:
        return f"{us:.0f} µs"
    if us < 1e6:
        return f"{us / 1000:.3g} ms"
    if us < 60e6:
        return f"{us / 1e6:.3g} s"
    minutes, seconds = divmod(round(us / 1e6), 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def capture_window_text(first_us: int | None, last_us: int | None) -> str:
    """A trace's window (µs since the epoch) in the site's time zone, to the millisecond, and its
    length: ``2026-11-27 08:41:36.398 – 08:41:43.631 UTC (7.23 s)``."""
    if first_us is None or last_us is None:
        return "no events"
    first, last = _local_time(first_us), _local_time(last_us)
    end_format = "%H:%M:%S" if first.date() == last.date() else "%Y-%m-%d %H:%M:%S"
    return (f"{first:%Y-%m-%d %H:%M:%S}.{first.microsecond // 1000:03d} – "
            f"{last.strftime(end_format)}.{last.microsecond // 1000:03d} {first.tzname()} "
            f"({_seconds_text(last_us - first_us)})")

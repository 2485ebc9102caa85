"""Saving the built-in profiler's results (``ProfileResult``) as :class:`ProfileRecord` rows.

The profile's JSON is stored as a trace's is (gzip with its CRC: both are ``PayloadRecord`` s); the
row keeps the per-kernel table for the admin's list and the compare page. Retention follows the
trace limits.
"""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
from typing import Any

import orjson
from django.db import transaction

from engines.history.capture import _finite_json, server_fields, validate_note
from engines.history.payload import compress_json
from engines.history.retention import apply_profile_retention
from engines.models import ProfileRecord
from engines.server.db_calls import in_db_thread

__all__ = ["asave_profile", "aset_profile_note", "save_profile"]


def save_profile(profile: dict[str, Any], *, engine: str, source: str = ProfileRecord.Source.API, note: str = "",
                 retention: bool = True, server: str | None = None, fleet: str | None = None) -> ProfileRecord:
    """Store ``profile`` (``ProfileResult.to_json()``) for ``engine``, taken on ``server``
    (default: this one, ``capture.server_fields``); applies retention after."""
    if source not in ProfileRecord.Source.values:
        raise ValueError(f"source must be one of {', '.join(ProfileRecord.Source.values)}, got {source!r}")
    note = validate_note(note)
    where = server_fields(server, fleet)
    profile = _finite_json(profile)  # a kernel that never ran gives no inf/nan to the JSON
    raw = orjson.dumps(profile)
    stored = compress_json(raw)
    stacks = profile.get("stacks") or {}
    trigger = profile.get("trigger") or {}
    record = ProfileRecord(
        engine=engine, model=str(profile.get("model", "")), backend=str(profile.get("backend", "")),
        device=str(profile.get("device", ""))[:200], source=source,
        captured_at=datetime.fromtimestamp(profile["started_at_us"] / 1e6, tz=dt_timezone.utc),
        duration_us=int(profile.get("duration_us", 0)), steps=int(profile.get("steps", 0)),
        kernel_calls=sum(int(k["calls"]) for k in profile.get("kernels", [])),
        stopped_by=str(profile.get("stopped_by", "")), stack_samples=int(stacks.get("samples", 0)),
        kernels=profile.get("kernels", []), note=note, **stored.record_fields(), **where,
        trigger=f"{trigger['trigger']}; fired: {trigger['fired_by']}" if trigger else "",
    )
    with transaction.atomic():
        record.save(force_insert=True)
    if retention:
        apply_profile_retention(engine)
    return record


async def asave_profile(profile: dict[str, Any], *, engine: str, source: str = ProfileRecord.Source.API,
                        note: str = "", retention: bool = True, server: str | None = None,
                        fleet: str | None = None) -> ProfileRecord:
    """:func:`save_profile` on a worker thread with its own database connection."""
    save = in_db_thread(save_profile)
    return await save(profile, engine=engine, source=source, note=note, retention=retention, server=server,
                      fleet=fleet)


async def aset_profile_note(pk: int, note: str) -> None:
    """Put ``note`` on profile record ``pk`` (a profile that stopped by itself and was saved before
    its stop asked for the note)."""
    note = validate_note(note)
    await ProfileRecord.objects.filter(pk=pk).aupdate(note=note)

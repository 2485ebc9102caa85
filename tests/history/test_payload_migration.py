"""The migration that gave traces and profiles one stored-payload model (0003) keeps every row:
it adds the profiles' checksum column (empty on rows saved before it) and changes help texts only."""
from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from engines.history.downloads import read_payload
from engines.history.payload import compress_json
from engines.models import ProfileRecord, TraceRecord

BEFORE = [("engines", "0002_profile_records")]


@pytest.mark.django_db(transaction=True)
def test_rows_saved_before_the_migration_keep_their_payloads_and_are_checked_by_inflating() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    stored = compress_json(b'{"trace": {"traceEvents": []}, "kernels": []}')
    fields = {"payload": stored.data, "payload_bytes": stored.raw_size, "compressed_bytes": len(stored.data)}
    profile = old.get_model("engines", "ProfileRecord").objects.create(engine="old", model="m", **fields)
    trace = old.get_model("engines", "TraceRecord").objects.create(engine="old", model="m",
                                                                   payload_crc32=stored.crc32, **fields)

    executor = MigrationExecutor(connection)  # a fresh loader sees the database at 0002
    executor.migrate(executor.loader.graph.leaf_nodes())  # back to where every other test expects it

    kept = ProfileRecord.objects.get(pk=profile.pk)
    assert kept.payload_crc32 is None and bytes(kept.payload) == stored.data
    assert read_payload(kept) == stored.data  # no checksum yet: inflated to check it
    assert read_payload(TraceRecord.objects.get(pk=trace.pk)) == stored.data

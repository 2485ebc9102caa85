"""The admin's helpers for large tables: a filter's choices listed through an index, one
combination of columns at a time on PostgreSQL (a loose index scan), in order, on both databases."""
from __future__ import annotations

import pytest

from engines.admin.large_tables import distinct_rows, distinct_values
from engines.history import save_trace
from engines.models import TraceRecord
from tests.history.trace_builder import serving_trace


@pytest.mark.django_db
def test_distinct_rows_lists_each_combination_once_in_the_index_order() -> None:
    assert distinct_rows(TraceRecord, "engine", "model") == []
    for engine, model in (("b", "m2"), ("a", "m1"), ("b", "m1"), ("a", "m1"), ("b", "m2")):
        save_trace(serving_trace(engine=engine, num_requests=1), engine=engine, model=model, retention=False)
    assert distinct_values(TraceRecord, "engine") == ["a", "b"]
    assert distinct_rows(TraceRecord, "engine") == [("a",), ("b",)]
    assert distinct_rows(TraceRecord, "engine", "model") == [("a", "m1"), ("b", "m1"), ("b", "m2")]

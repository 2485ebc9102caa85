"""Fixtures for the trace history tests: users and saved traces."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User

from engines.history import save_trace
from engines.models import TraceRecord
from tests.history.trace_builder import serving_trace


@pytest.fixture(scope="session", autouse=True)
def _close_async_worker_connections(async_db_connections_closed):
    """Every history test may touch the database from async code (see tests/conftest.py)."""


@pytest.fixture
def saved_trace(db):
    """A saved three-request trace and the dict it was saved from."""
    trace = serving_trace(engine="eng-a", num_requests=3)
    record = save_trace(trace, engine="eng-a", model="demo", note="baseline run", tags="nightly, ci")
    return record, trace


@pytest.fixture
def viewer_client(client, django_user_model):
    """Staff who may view trace history but not change or delete it."""
    user: User = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="engines", codename__startswith="view_"))
    client.force_login(user)
    return client


def newest_first(engine: str) -> list[int]:
    return list(TraceRecord.objects.filter(engine=engine).order_by("-captured_at", "-id")
                .values_list("pk", flat=True))

"""Test-wide setup.

The CUDA simulator must be switched on before numba is first imported, so it
happens here, at the top of the first module pytest loads. On a machine with a
real GPU set ``ENGINES_TEST_GPU=1`` to run the CUDA kernels for real instead.
"""
import os
from collections.abc import Iterator

import pytest

if os.environ.get("ENGINES_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


@pytest.fixture(scope="session")
def async_db_connections_closed(django_db_setup, django_db_blocker) -> Iterator[None]:
    """For modules whose async tests use the database: at the end of the session, close the
    connection asgiref's worker thread keeps open, or PostgreSQL refuses to drop the test
    database (docs/reference.md, stack pitfall 6). Requested by those modules only, so the
    tests that need no database don't create one."""
    yield
    from asgiref.sync import SyncToAsync
    from django.db import connections

    if SyncToAsync.single_thread_executor is not None:
        SyncToAsync.single_thread_executor.submit(connections.close_all).result()

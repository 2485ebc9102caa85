"""Test-wide setup.

The CUDA simulator must be switched on before numba is first imported, so it
happens here, at the top of the first module pytest loads. On a machine with a
real GPU set ``ENGINES_TEST_GPU=1`` to run the CUDA kernels for real instead.
"""
import os
from collections.abc import Iterator

import pytest
from django.conf import settings

from debugsite.settings import FAST_TEST_PASSWORD_HASHERS

# Fast password hashing for the suite's throwaway accounts (debugsite/settings.py): in every server
# a test starts, which inherits the environment, and in this process, whose settings pytest-django
# has read already.
os.environ["DEBUGSITE_TEST_FAST_PASSWORD_HASHING"] = "1"
settings.PASSWORD_HASHERS = FAST_TEST_PASSWORD_HASHERS

if os.environ.get("ENGINES_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    from tests.cudasim_shared_arrays import make_shared_arrays_once

    make_shared_arrays_once()


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


#: Fixtures that give a test the database (pytest-django's, and this suite's); not
#: ``django_db_blocker``, which pytest-django's own autouse fixtures pull into every test.
DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_setup", "live_server",
                               "async_db_connections_closed"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--database-only", action="store_true",
                     help="run only the tests that use the database (the PostgreSQL pass of scripts/test.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--database-only``, keep the tests that touch the database; then order the files slow
    ones first (``long_files_first``)."""
    if config.getoption("--database-only"):
        keep_database_tests(config, items)
    long_files_first(items)


def keep_database_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests that touch the database: a ``django_db`` mark or a database fixture. (Server
    subprocesses get ``DATABASE_URL`` only where a test gives it one, and those tests use
    PostgreSQL in both passes.)"""
    kept, dropped = [], []
    for item in items:
        uses = (item.get_closest_marker("django_db") is not None
                or bool(DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))))
        (kept if uses else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def long_files_first(items: list[pytest.Item]) -> None:
    """Order the files: those with a ``slow`` test first, then by their number of tests, most
    first; a file's tests keep their order. xdist's workers take a file at a time in this order
    (``scripts/test.sh`` passes ``--no-loadscope-reorder``, or xdist would sort by count alone and
    send the one-test files, the soak and the browser pages among them, last: the run's tail)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple[bool, int]:
        return (not any(test.get_closest_marker("slow") for test in tests), -len(tests))

    items[:] = [item for tests in sorted(files.values(), key=weight) for item in tests]

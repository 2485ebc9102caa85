"""The fleet's tests use the machine's Redis (scripts/services.sh starts it here and in CI), in a
fleet of their own each, and a fake foreign server on a free port."""
from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from engines.fleet.store import RedisFleetStore
from tests.fleet.fake_server import FakeServer

REDIS_URL = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/1")


@pytest.fixture
async def store() -> AsyncIterator[RedisFleetStore]:
    """A fleet of its own in the shared Redis (heartbeats every 0.4 s: gone after 0.6 s), its keys
    deleted after."""
    client = aioredis.from_url(REDIS_URL)
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield RedisFleetStore(client, name, heartbeat_s=0.4)
    keys = [k async for k in client.scan_iter(f"fleet:{name}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.close()

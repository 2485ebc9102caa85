"""An engine socket's live feed while the channel layer is away (issue 42): the socket says
``interrupted`` (not the last numbers as if live), stays open, and says ``live`` when snapshots
come again, with no reconnect; the fleet socket stays open too."""
from __future__ import annotations

import pytest

from engines.dashboard import feed as feed_module
from engines.dashboard.sampler import hub_for
from engines.registry import registry
from tests.own_services import OwnRedis
from tests.server.conftest import TRACED
from tests.server.test_dashboard_sockets import connected, next_message, of_type

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def redis_layer(settings, tmp_path):
    """A Redis of the test's own as the channel layer (the samplers this test starts use it)."""
    redis = OwnRedis(tmp_path)
    redis.start()
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [redis.url]}}}
    yield redis
    redis.stop()


async def test_redis_stopped_under_a_page_interrupts_its_feed_and_its_return_makes_it_live(dashboard,
                                                                                            redis_layer) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/")
    assert (await next_message(socket, of_type("feed")))["state"] == "live"
    await next_message(socket, of_type("snapshot"))  # through Redis: the sampler had none to send at once
    fleet = await connected("/ws/fleet/")

    redis_layer.stop()
    interrupted = await next_message(socket, of_type("feed"), timeout=10)
    assert interrupted["state"] == "interrupted"
    assert interrupted["reason"].startswith("the channel layer (Redis) does not answer (")
    # The fleet page's socket reads nothing from the layer: Redis going away does not end it.
    await next_message(fleet, of_type("fleet"))
    await fleet.disconnect()
    # A page opened meanwhile: the last snapshot this process took, and the word that it is not live.
    late = await connected(f"/ws/engines/{TRACED}/")
    await next_message(late, of_type("snapshot"))
    assert (await next_message(late, of_type("feed")))["state"] == "interrupted"

    # Restarted empty, as Redis without persistence does: the sockets' group is forgotten, and
    # joined again by the sockets themselves.
    redis_layer.start()
    for page in (socket, late):
        assert (await next_message(page, of_type("feed"), timeout=15))["state"] == "live"
    first, second = [await next_message(socket, of_type("snapshot")) for _ in range(2)]
    assert 0 < second["at"] - first["at"] < 2  # flowing again, several a second
    await socket.disconnect()
    await late.disconnect()


async def test_snapshots_that_stop_coming_interrupt_the_feed_until_they_come_again(dashboard,
                                                                                    monkeypatch) -> None:
    """The sampler's sends fail while the socket's own reads do not (Redis back before the socket
    noticed, its group gone): the silence is what the socket sees, and says."""
    monkeypatch.setattr(feed_module, "STALE_S", 0.6)
    socket = await connected(f"/ws/engines/{TRACED}/")
    assert (await next_message(socket, of_type("feed")))["state"] == "live"
    await next_message(socket, of_type("snapshot"))
    sampler = hub_for(registry).samplers[TRACED]
    layer = sampler.layer

    class Refusing:
        async def group_send(self, group: str, message: dict) -> None:
            raise ConnectionError("Connection refused")

    sampler.layer = Refusing()
    interrupted = await next_message(socket, of_type("feed"), timeout=5)
    assert (interrupted["state"], interrupted["reason"]) == ("interrupted", "no snapshot came for 0.6 s")
    sampler.layer = layer
    assert (await next_message(socket, of_type("feed"), timeout=5))["state"] == "live"
    await socket.disconnect()

"""The engine pages while Redis (the channel layer) is away, in a real browser (issue 42): a real
server on a Redis of the test's own, stopped under an open engine page and the overview, which
say their feed is interrupted and fade their figures, then clear both by themselves when it is
started again. Screenshots in ``var/screenshots/feed-*.png``."""
from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.browser.conftest import PASSWORD, SHOTS, LiveServer, free_port, sign_in
from tests.own_services import OwnRedis
from tests.processes import migrate_and_add_admin

pytestmark = pytest.mark.slow

NOTICE = "#feed-notice"
STORY = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 16}


@pytest.fixture(scope="module")
def redis_and_server(tmp_path_factory) -> Iterator[tuple[OwnRedis, LiveServer]]:
    redis = OwnRedis(tmp_path_factory.mktemp("redis"))
    redis.start()
    var = tmp_path_factory.mktemp("feed-var")
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env |= {"DEBUGSITE_VAR_DIR": str(var), "PYTHONUNBUFFERED": "1", "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
            "REDIS_URL": redis.url, "FLEET_NAME": f"feed-{uuid.uuid4().hex[:8]}"}
    manage = [sys.executable, "manage.py"]
    migrate_and_add_admin(env)
    port = free_port()
    command = manage + ["serve", "--model", "demo", "--port", str(port), "--backend", "cpu",
                        "--max-num-seqs", "4", "--max-total-tokens", "1024", "--drain-timeout", "1"]
    server = LiveServer(command, env, f"http://127.0.0.1:{port}")
    yield redis, server
    server.stop()
    redis.stop()


async def feed_is(page, state: str, timeout: float = 20000) -> None:
    await page.wait_for_function(f"() => document.body.dataset.feed === {state!r}", timeout=timeout)


async def test_the_engine_pages_say_their_feed_is_interrupted_while_redis_is_down(redis_and_server, browser) -> None:
    redis, server = redis_and_server
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    engine = await context.new_page()
    errors = await sign_in(engine, server.base, "/dashboard/engines/demo/")
    overview = await context.new_page()
    overview_errors: list[str] = []
    overview.on("pageerror", lambda exc: overview_errors.append(str(exc)))
    await overview.goto(f"{server.base}/dashboard/")
    for page in (engine, overview):
        await feed_is(page, "live")
        assert await page.is_hidden(NOTICE)
    await engine.wait_for_function("() => Number(document.getElementById('charts').dataset.samples) > 2")
    http = httpx.AsyncClient(base_url=server.base, timeout=60)
    assert (await http.post("/v1/completions", json=STORY)).status_code == 200
    await engine.wait_for_selector("#recent tbody tr:not(.empty)")  # figures to fade

    redis.stop()
    try:
        assert (await http.post("/v1/completions", json=STORY)).status_code == 200  # the API serves on
        for page in (engine, overview):
            await feed_is(page, "interrupted")
            notice = await page.text_content(NOTICE)
            assert notice.startswith("The live feed is interrupted: the channel layer (Redis) does not answer"), notice
            assert "they come back by themselves" in notice
            assert re.search(r"The figures below are from \d\d:\d\d:\d\d;", notice), notice  # 24-hour
            assert await page.text_content("#connection") == "live feed interrupted"
        # The figures are faded, not shown as if live; the page's socket stays open (no reconnect).
        assert await engine.eval_on_selector("#charts", "el => getComputedStyle(el).opacity") == "0.5"
        assert await overview.eval_on_selector("#engines-module", "el => getComputedStyle(el).opacity") == "0.5"
        assert await engine.evaluate("document.body.dataset.live") == "open"
        await engine.screenshot(path=str(SHOTS / "feed-engine-interrupted.png"), full_page=True)
        await overview.screenshot(path=str(SHOTS / "feed-overview-interrupted.png"), full_page=True)
    finally:
        redis.start()

    for page in (engine, overview):
        await feed_is(page, "live")
        assert await page.is_hidden(NOTICE)
        assert await page.text_content("#connection") == "live"
    samples = await engine.evaluate("Number(document.getElementById('charts').dataset.samples)")
    await engine.wait_for_function(f"() => Number(document.getElementById('charts').dataset.samples) > {samples}")
    assert await engine.eval_on_selector("#charts", "el => getComputedStyle(el).opacity") == "1"
    await engine.screenshot(path=str(SHOTS / "feed-engine-back.png"))
    assert errors == [] and overview_errors == []
    await http.aclose()
    await context.close()

"""The history's pages while PostgreSQL is away (issue 42): a real server (Daphne) on a PostgreSQL
of the test's own, stopped under a signed-in staff member. Pages answer a clear 503 (the admin's
look in the browser, the JSON shapes for scripts and the playground), a socket is closed with a
code, the log says it once (no traceback), and the page comes back by itself when the database is
started again, no restart. Screenshot: ``var/screenshots/history-unavailable.png``."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from engines.dashboard.consumers import CLOSE_UNAVAILABLE
from tests.browser.conftest import CHROMIUM, SHOTS
from tests.own_services import OwnPostgres
from tests.processes import REPO, free_port, migrate_and_add_admin
from tests.server.conftest import assert_error

PASSWORD = "outage-test-pw"
CHANGELIST = "/admin/engines/tracerecord/"
BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
SAID = "history: the database does not answer"
#: What psycopg says of a stopped server, on its first line.
REFUSED = re.compile(r"The history database does not answer: connection failed: .*(Connection refused|No such file)")


class Site:
    """Daphne serving ``debugsite.asgi`` (no engine: the history needs none) on ``postgres``,
    its output in a file, and an httpx client signed in as a superuser."""

    def __init__(self, postgres: OwnPostgres, var: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DJANGO_SETTINGS_MODULE", "REDIS_URL")}
        env |= {"DATABASE_URL": postgres.url, "DEBUGSITE_VAR_DIR": str(var), "PYTHONUNBUFFERED": "1",
                "DJANGO_SUPERUSER_PASSWORD": PASSWORD}
        migrate_and_add_admin(env)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = var / "server.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "debugsite.asgi:application"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.base, timeout=30)
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                login = self.http.get("/admin/login/")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.1)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text)
        assert token is not None
        signed_in = self.http.post("/admin/login/?next=/admin/", data={
            "username": "admin", "password": PASSWORD, "csrfmiddlewaretoken": token.group(1), "next": "/admin/"})
        assert signed_in.status_code == 302 and "sessionid" in self.http.cookies

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def postgres_and_site(tmp_path) -> Iterator[tuple[OwnPostgres, Site]]:
    postgres = OwnPostgres()
    try:
        postgres.start()
        site = Site(postgres, tmp_path)
        try:
            yield postgres, site
        finally:
            site.stop()
    finally:
        postgres.remove()


async def socket_close_code(site: Site) -> int | None:
    """The close code of an engines socket opened with the staff session."""
    headers = {"Cookie": f"sessionid={site.http.cookies['sessionid']}"}
    async with websockets.connect(f"ws://127.0.0.1:{site.port}/ws/engines/", origin=websockets.Origin(site.base),
                                  additional_headers=headers, open_timeout=10) as socket:
        try:
            await asyncio.wait_for(socket.recv(), 10)
        except websockets.ConnectionClosed:
            pass
        return socket.close_code


@pytest.mark.slow
async def test_history_pages_answer_503_while_postgres_is_down_and_come_back_by_themselves(postgres_and_site) -> None:
    from playwright.async_api import async_playwright

    postgres, site = postgres_and_site
    http = site.http
    assert http.get(CHANGELIST, headers=BROWSER).status_code == 200
    SHOTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM)
        context = await browser.new_context(viewport={"width": 1400, "height": 700})
        await context.add_cookies([{"name": "sessionid", "value": http.cookies["sessionid"], "url": site.base}])
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        postgres.stop()
        answer = await page.goto(site.base + CHANGELIST)
        assert answer is not None and answer.status == 503 and answer.headers["retry-after"] == "5"
        message = await page.text_content("#history-unavailable")
        assert message is not None and REFUSED.match(message), message
        assert message.endswith(". Live pages already open and the API keep working; this page comes back by itself "
                                "when it does.")
        # The admin's frame, without the user tools (the user is in the database too).
        assert await page.text_content("#site-name") == "LLM engine debug server"
        assert await page.query_selector("#logout-form") is None
        await page.screenshot(path=str(SHOTS / "history-unavailable.png"))

        assert http.get(CHANGELIST, headers=BROWSER).status_code == 503  # a second request: not logged again
        # A dashboard page's script (fetch sends */*): the dashboard's data shape.
        data = http.get("/dashboard/traces/1/data.json")
        assert data.status_code == 503 and REFUSED.match(data.json()["error"])
        # The playground's endpoint answers in the API's error shape, which its page reads.
        chat = http.post("/dashboard/playground/v1/chat/completions", json={"model": "demo", "messages": []},
                         headers={"X-CSRFToken": http.cookies["csrftoken"]})
        assert REFUSED.match(assert_error(chat, 503)["message"])
        # A dashboard socket: closed with its code (the page tries again), not a 500 at the handshake.
        assert await socket_close_code(site) == CLOSE_UNAVAILABLE

        postgres.start()
        # The page asks again by itself and is the changelist, signed in: no reload, no restart.
        await page.wait_for_selector("#changelist", timeout=15000)
        assert page.url == site.base + CHANGELIST and await page.query_selector("#logout-form") is not None
        assert errors == []
        await browser.close()

    log = site.log.read_text()
    # (Bare Daphne's root handler prints each of our lines a second time, without the logger's name.)
    assert log.count(f"engines.history.outage: {SAID}") == 1, log
    assert "Traceback" not in log and " ERROR " not in log, log  # Django's per-request lines left out too
    assert "engines.history.outage: history: the database answers again" in log, log

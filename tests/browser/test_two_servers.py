"""Two servers on one host in one browser: each signed in by its own one-time link, both stay
signed in. A browser keeps cookies per host, not per port, so servers that shared the cookie
name ``sessionid`` signed each other's users out (and the other's one-time link was spent)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.browser.conftest import SHOTS
from tests.processes import Server, start_server

pytestmark = pytest.mark.slow

SERVE = ["--model", "demo", "--backend", "cpu", "--engine-mode", "thread", "--max-total-tokens", "512"]


def login_link(server: Server) -> str:
    """The one-time dashboard link the server printed."""
    assert server.process.stdout is not None
    for line in server.process.stdout:
        if line.startswith("Dashboard"):
            return line.split()[1]
    raise AssertionError("the server printed no dashboard link")


@pytest.fixture
def two_servers(tmp_path) -> Iterator[tuple[Server, Server]]:
    """Two demo servers on two ports of 127.0.0.1, each with its own database."""
    first = start_server(SERVE, tmp_path / "first")
    try:
        second = start_server(SERVE, tmp_path / "second")
    except BaseException:
        first.stop()
        raise
    yield first, second
    first.stop()
    second.stop()


SOCKET_FIRST_MESSAGE = """async path => await new Promise(resolve => {
  const socket = new WebSocket(`ws://${location.host}${path}`);
  socket.onmessage = event => { resolve(JSON.parse(event.data).type); socket.close(); };
  socket.onclose = event => resolve(`closed ${event.code}`);
})"""


async def test_two_servers_on_one_host_keep_both_logins(two_servers, browser) -> None:
    first, second = two_servers
    links = [login_link(first), login_link(second)]
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    page = await context.new_page()
    for link in links:
        await page.goto(link)
        await page.wait_for_url("**/dashboard/")
    for server in (first, second):  # the first server's login survived the second's
        await page.goto(f"{server.base}/dashboard/")
        assert page.url == f"{server.base}/dashboard/", page.url  # not the login page
        await page.wait_for_selector('tr.engine-row[data-engine="demo"]')
        first_message = await page.evaluate(SOCKET_FIRST_MESSAGE, "/ws/engines/")
        assert not first_message.startswith("closed"), first_message  # 4403: not signed in
        await page.screenshot(path=str(SHOTS / f"two-servers-{server.port}.png"))
    names = {cookie["name"] for cookie in await context.cookies()}
    assert {f"sessionid_{first.port}", f"sessionid_{second.port}"} <= names, names
    await context.close()

"""The browser tests' live server and page: ``manage.py serve`` (Daphne, the engine in its own process)
on a free port, once per test module, and a logged-in page of Debian's chromium (async Playwright) on it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import child_pids, migrate_and_add_admin

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "var" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
PASSWORD = "dashboard-test-pw"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """``manage.py serve`` in a subprocess: its command and environment, to start it again."""

    def __init__(self, command: list[str], env: dict[str, str], base: str) -> None:
        self.command, self.env, self.base = command, env, base
        self.process = self.start()

    def start(self) -> subprocess.Popen:
        process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        with httpx.Client(timeout=2) as http:  # one client: each makes an SSL context, ~50 ms of CPU
            while True:
                if process.poll() is not None:
                    pytest.fail(f"serve exited: {process.stdout.read() if process.stdout else ''}")
                try:
                    if http.get(f"{self.base}/health").status_code == 200:
                        return process
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def engine_pid(self, name: str = "demo") -> int:
        """The pid of engine ``name``'s process (its command line ends with ``engine=NAME``)."""
        named = [pid for pid in child_pids(self.process.pid)
                 if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-2:-1] == [f"engine={name}".encode()]]
        assert len(named) == 1, named
        return named[0]


@pytest.fixture(scope="module")
def dashboard_server(tmp_path_factory, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """The built-in models served with a superuser; a test module's ``SERVE_MODELS`` (``serve
    --model`` values) replace the models, its ``EXTRA_SERVE_ARGS`` add to ``serve``'s arguments."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: scripts/test.sh installs Debian's chromium")
    var = tmp_path_factory.mktemp("var")
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env |= {"DEBUGSITE_VAR_DIR": str(var), "PYTHONUNBUFFERED": "1", "DJANGO_SUPERUSER_PASSWORD": PASSWORD}
    manage = [sys.executable, "manage.py"]
    migrate_and_add_admin(env)
    port = free_port()
    # The built-in models, as scripts/serve.sh serves them (the real one first, the demo beside it),
    # or a test module's SERVE_MODELS: the real model's engine is 11 of a start's 18 CPU-seconds.
    served = getattr(request.module, "SERVE_MODELS", ("smollm2", "demo"))
    models = [arg for model in served for arg in ("--model", model)]
    command = manage + ["serve", *models, "--enable-debug", "--enable-tracing",
                        "--port", str(port), "--backend", "cpu",
                        "--max-num-seqs", "8", "--max-total-tokens", "4096", "--drain-timeout", "1",
                        *getattr(request.module, "EXTRA_SERVE_ARGS", [])]
    server = LiveServer(command, env, f"http://127.0.0.1:{port}")
    yield server
    server.stop()


async def sign_in(page, base: str, next_path: str = "/dashboard/") -> list[str]:
    """Sign ``page`` in as the test's superuser and land on ``next_path``; the list that collects
    the page's script errors (a test asserts it stays empty)."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"{base}/admin/login/?next={next_path}")
    await page.fill("#id_username", "admin")
    await page.fill("#id_password", PASSWORD)
    await page.click("input[type=submit]")
    await page.wait_for_url(f"**{next_path}")
    return errors


@pytest.fixture
async def browser() -> AsyncIterator:
    """Debian's chromium under Playwright, closed after the test."""
    from playwright.async_api import async_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM)
        yield browser
        await browser.close()


@pytest.fixture
async def page(dashboard_server: LiveServer, browser) -> AsyncIterator:
    """A 1400 px page signed in as the superuser; the test fails on any script error."""
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    errors = await sign_in(page, dashboard_server.base)
    yield page
    assert errors == [], errors  # no script error on any page


# The WCAG contrast ratio of an element's text colour against its background (its own, or the
# nearest ancestor's that is not transparent): 4.5 or more reads as body text should.
_CONTRAST = """element => {
  const rgb = text => text.match(/[\\d.]+/g).map(Number);
  const luminance = ([r, g, b]) => [r, g, b].map(v => v / 255)
    .map(v => (v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4))
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  let box = element;
  while (box && rgb(getComputedStyle(box).backgroundColor)[3] === 0) box = box.parentElement;
  const [fg, bg] = [getComputedStyle(element).color, box ? getComputedStyle(box).backgroundColor : "rgb(255,255,255)"]
    .map(c => luminance(rgb(c)));
  return (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
}"""


async def contrast(page, selector: str) -> float:
    """The contrast ratio of the first element ``selector`` finds (text against its background)."""
    return await page.locator(selector).first.evaluate(_CONTRAST)


# Each element's text, whether it takes more than one line, and whether the whole text is in its
# tooltip when it is cut short (an ellipsis: its content is wider than its box).
_LINES = """elements => elements.filter(e => e.getBoundingClientRect().width > 0).map(e => {
  const line = parseFloat(getComputedStyle(e).lineHeight) || 1.2 * parseFloat(getComputedStyle(e).fontSize);
  return {text: e.textContent, lines: Math.round(e.getBoundingClientRect().height / line),
          cut: e.scrollWidth > e.clientWidth, tooltip: e.title};
})"""


async def text_lines(page, selector: str) -> list[dict]:
    """Every visible element ``selector`` finds: ``text``, ``lines`` it takes, whether it is ``cut``
    short, and its ``tooltip``."""
    return await page.eval_on_selector_all(selector, _LINES)


def load(base: str, stop: threading.Event, clients: int = 4) -> threading.Thread:
    """Streaming requests in the background until ``stop``."""
    def run() -> None:
        body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 200, "stream": True, "debug_config": {"ignore_eos": True}}

        def client() -> None:
            with httpx.Client(base_url=base, timeout=60) as http:
                while not stop.is_set():
                    with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        for _ in response.iter_lines():
                            if stop.is_set():
                                break

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread

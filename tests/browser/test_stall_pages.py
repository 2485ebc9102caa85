"""A stall in the browser: the engine process SIGSTOPped, the engine page's banner says so and
links the incident, whose page lays out its evidence; the banner goes when the engine runs again.
Screenshots ``stall-*.png`` at 1400 and 900 px in ``var/screenshots/``."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.browser.conftest import SHOTS, LiveServer
from tests.browser.test_live_debugger import shots_that_fit, streams

pytestmark = pytest.mark.slow
SERVE_MODELS = ("demo",)
# --capture-text too: the live row then shows its text (README, "What each capture holds").
EXTRA_SERVE_ARGS = ["--stall-no-progress-s", "2", "--capture-text"]


async def test_the_banner_links_the_incident_and_its_evidence(page, dashboard_server: LiveServer) -> None:
    base = dashboard_server.base
    await page.goto(f"{base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
    finished: dict[str, list] = {}
    stop = threading.Event()
    threads = streams(base, ["held-up"], finished, stop)
    pid = dashboard_server.engine_pid("demo")
    try:
        await page.wait_for_selector('#live tbody tr[data-request-id="held-up"]', timeout=60000)
        said = await page.text_content('#live tbody tr[data-request-id="held-up"] .request-text')
        assert said.startswith("“") and "tides" in said
        await page.locator("#live-module").screenshot(path=str(SHOTS / "live-requests-text-1400.png"))
        # ... and the prefix cache's entries their first words (the chat template's start).
        await page.wait_for_selector("#kv-entries td.kv-words", timeout=15000)
        assert (await page.text_content("#kv-entries td.kv-words")).startswith("“")
        await page.locator("#kv-module").screenshot(path=str(SHOTS / "kv-cache-text-1400.png"))
        os.kill(pid, signal.SIGSTOP)
        try:
            banner = page.locator("#stall-banner")
            await banner.wait_for(state="visible", timeout=30000)
            assert "Stalled since" in await banner.text_content()
            assert "no step finished" in await banner.text_content()
            # Once the evidence is kept, the banner links its incident.
            await page.wait_for_selector("#stall-banner a[href*='/stallincidentrecord/'][href$='/change/']",
                                         timeout=30000)
            await page.screenshot(path=str(SHOTS / "stall-banner-1400.png"))
            # The banner is redrawn with each snapshot (4 Hz): follow its link rather than race a click.
            await page.goto(base + await page.get_attribute("#stall-banner a", "href"))
            await page.wait_for_selector("#incident-evidence")
            # Its evidence comes once taken (py-spy's read of a stopped process takes seconds).
            for _ in range(60):
                if "Not taken" in await page.text_content("#incident-evidence"):
                    break
                await page.wait_for_timeout(1000)
                await page.reload()
            text = await page.text_content("#incident-evidence")
            assert "Not taken" in text and "did not answer" in text  # the stopped engine answered nothing
            assert "held-up" in text  # ... but the server knows whom it waits on
            await shots_that_fit(page, "stall-incident")
        finally:
            os.kill(pid, signal.SIGCONT)
        await page.goto(f"{base}/dashboard/engines/demo/")
        await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
        await page.wait_for_timeout(1500)
        assert await page.locator("#stall-banner").is_hidden()
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    await page.goto(f"{base}/admin/engines/stallincidentrecord/")
    assert "open (or its server ended first)" not in await page.text_content("#result_list")
    await page.screenshot(path=str(SHOTS / "stall-incidents-1400.png"), full_page=True)

"""``GET /metrics`` under Prometheus' own linter (``promtool check metrics``, issue 60), its prefix
(``--metrics-prefix``) and its vLLM-named aliases (``--metrics-vllm-aliases``)."""
from __future__ import annotations

import re

import httpx
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from prometheus_client.parser import text_string_to_metric_families

from engines.fleet.server_kinds import QUANTITIES, ServerKind
from engines.fleet.foreign import ForeignReader
from engines.server.loop_lag import LoopLagMonitor
from engines.prometheus_names import DEFAULT_METRICS_PREFIX, VLLM_ALIASES
from engines.registry import RegistryError, configure, registry
from engines.startup import configure_from_env
from engines.views import metrics as metrics_view
from tests.promtool import promtool
from tests.server.conftest import TRACED, UNTRACED

# vLLM's names hold colons, which promtool flags on any exposition (they are for recording rules).
COLON = re.compile(r"^(vllm:[a-z0-9_]+) metric names should not contain ':'$")


@pytest.fixture
async def every_series(client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> httpx.AsyncClient:
    """The client after requests that leave every family with samples: a finished request of
    several decode steps (histograms, MLC's sums and its decode step times, the last finished
    request), and the event loop probed."""
    monitor = LoopLagMonitor(interval_s=0.01)
    monitor.start()
    body = {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "debug_config": {"ignore_eos": True}}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    await monitor.stop()
    monkeypatch.setattr(metrics_view, "loop_lag", monitor)
    return client


def families_of(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


async def test_promtool_finds_nothing_to_complain_of(every_series: httpx.AsyncClient) -> None:
    text = (await every_series.get("/metrics")).text
    families = families_of(text)
    assert [name for name, family in families.items() if not family.samples] == []  # every series present
    assert {f.type for f in families.values()} == {"gauge", "counter", "histogram", "summary"}
    assert all(name.startswith(DEFAULT_METRICS_PREFIX) for name in families)
    checked = promtool("check", "metrics", stdin=text)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


async def test_vllm_aliases_repeat_our_figures_under_vllms_names(serve, every_series: httpx.AsyncClient) -> None:
    ours = families_of((await every_series.get("/metrics")).text)
    async with serve(metrics_vllm_aliases=True) as http:
        text = (await http.get("/metrics")).text
    families = families_of(text)
    aliases = {alias: DEFAULT_METRICS_PREFIX + name for name, names in VLLM_ALIASES.items() for alias in names}
    assert set(families) == set(ours) | set(aliases)
    for alias, name in aliases.items():
        alias_family, family = families[alias], families[name]
        assert alias_family.type == family.type
        # The same samples, under vLLM's names and model label.
        assert [(s.name.removeprefix(alias), s.labels, s.value) for s in alias_family.samples] == \
            [(s.name.removeprefix(name), {("model_name" if k == "model" else k): v for k, v in s.labels.items()},
              s.value) for s in family.samples]
    # promtool flags the colons of vLLM's names, and nothing else.
    checked = promtool("check", "metrics", stdin=text)
    complaints = (checked.stdout + checked.stderr).splitlines()
    assert checked.returncode == 3 and complaints
    flagged = {m[1] for line in complaints if (m := COLON.match(line))}
    assert len(flagged) == len(complaints)
    assert flagged == {alias + ("_total" if families[alias].type == "counter" else "") for alias in aliases}


async def test_a_prefix_names_every_family_and_the_fleet_reads_it(serve) -> None:
    async with serve(metrics_prefix="acme_llm_", metrics_vllm_aliases=True) as http:
        body = {"model": TRACED, "prompt": "hello", "max_tokens": 3}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        text = (await http.get("/metrics")).text
    families = families_of(text)
    assert "acme_llm_up" in families and "acme_llm_time_to_first_token_seconds" in families
    assert all(name.startswith(("acme_llm_", "vllm:")) for name in families)
    # Another of our servers reads it as ours, whatever its prefix, vLLM's names beside them or not.
    reading = ForeignReader().read(text)
    assert reading.kind is ServerKind.OURS and reading.error is None
    assert reading.not_exported == () and set(reading.sources) == set(QUANTITIES)
    assert set(reading.models) == {TRACED, UNTRACED}


@pytest.mark.parametrize("prefix", ["", "llm", "1llm_", "llm:", "llm-engine_", "vllm:"])
def test_a_prefix_that_cannot_start_a_name_is_refused(prefix: str) -> None:
    """By ``serve`` (before any engine loads), a bare ASGI deployment's variable and ``configure``."""
    with pytest.raises(CommandError, match="--metrics-prefix: metrics prefix .* must be letters, digits"):
        call_command("serve", "--metrics-prefix", prefix)
    with pytest.raises(RegistryError, match="ENGINES_METRICS_PREFIX: .* end with '_'"):
        configure_from_env({"ENGINES_MODELS": "demo", "ENGINES_METRICS_PREFIX": prefix})
    with pytest.raises(RegistryError, match="must be letters, digits and underscores"):
        configure([], metrics_prefix=prefix, start=False)
    assert registry.options.metrics_prefix == DEFAULT_METRICS_PREFIX  # the registry as it was

"""The alert and recording rules in ``docs/prometheus/`` (issue 60): valid to ``promtool check
rules``, their unit tests (the files whose names hold ``test``) passing under ``promtool test
rules``, every alert tested firing, and every series they read one that ``/metrics`` exports."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from engines.prometheus_names import DEFAULT_METRICS_PREFIX
from engines.runtime import EngineMetrics
from engines.views.metrics import EngineReading, exposition_registry
from tests.promtool import promtool

RULES_DIR = Path(__file__).resolve().parents[1] / "docs" / "prometheus"


def rule_files() -> list[Path]:
    return sorted(p for p in RULES_DIR.glob("*.yml") if "test" not in p.name)


def unit_test_files() -> list[Path]:
    return sorted(p for p in RULES_DIR.glob("*.yml") if "test" in p.name)


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for path in rule_files() for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


def test_the_rules_pass_promtool_check_rules() -> None:
    assert rule_files() and unit_test_files()
    checked = promtool("check", "rules", *map(str, rule_files()))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout and "WARNING" not in checked.stdout + checked.stderr


def test_the_rules_unit_tests_pass_promtool_test_rules() -> None:
    tested = promtool("test", "rules", *map(str, unit_test_files()), timeout_s=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "FAILED" not in tested.stdout + tested.stderr


def test_every_alert_of_the_issue_is_there_and_tested_firing() -> None:
    fired: set[str] = set()
    for path in unit_test_files():
        for case in yaml.safe_load(path.read_text())["tests"]:
            fired.update(t["alertname"] for t in case.get("alert_rule_test", ()) if t.get("exp_alerts"))
    assert set(alerts()) == fired
    # Issue 60's list: error ratio, TTFT p99 over a target, KV-cache saturation, requests waiting
    # with no progress, an engine restarting, the target absent.
    assert {"LLMEngineRequestErrors", "LLMEngineSlowFirstToken", "LLMEngineKVCacheSaturated", "LLMEngineStalled",
            "LLMEngineRestarted", "LLMEngineTargetAbsent"} <= fired
    assert all(rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
               for rule in alerts().values())


def exported_names() -> set[str]:
    """Every sample name our ``/metrics`` gives for an engine that has served (the collector over
    a real :class:`EngineMetrics`, the engine itself stood in for by its attributes)."""
    engine = SimpleNamespace(name="m", checkpoint=SimpleNamespace(name="c"), backend_name="cpu", dtype="float32",
                             tracing_enabled=False, is_alive=True,
                             status=SimpleNamespace(state=SimpleNamespace(value="running"), restarts=0))
    metrics = EngineMetrics()
    reading = EngineReading(engine, metrics.as_dict(), metrics.histograms())  # type: ignore[arg-type]
    return {s.name for family in exposition_registry([reading], [engine]).collect()  # type: ignore[list-item]
            for s in family.samples}


def test_the_rules_read_series_that_metrics_exports() -> None:
    """promtool cannot tell a misspelt name from a series not scraped yet: held to the exposition."""
    exported = exported_names()
    assert DEFAULT_METRICS_PREFIX + "time_to_first_token_seconds_bucket" in exported  # the stand-in works
    exprs = [rule["expr"] for path in rule_files() for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"]]
    # Our names, not the recorded ones made of them (model:llm_engine_..._ratio:rate5m).
    ours = re.compile(rf"(?<![\w:]){DEFAULT_METRICS_PREFIX}[a-z0-9_]+\b(?!:)")
    read = {name for expr in exprs for name in ours.findall(expr)}
    assert len(read) == 12 and read - exported == set()

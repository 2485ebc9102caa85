"""scripts/commits_ab.py's verdicts: every round's paired ratio on one side of 1 is beyond noise,
ratios on both sides are not, and one round has no spread to judge by."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import orjson


def _load_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "commits_ab.py"
    spec = importlib.util.spec_from_file_location("commits_ab", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


commits_ab = _load_script()
figures, table = commits_ab.figures, commits_ab.table


def rows(path, values, metric="ours") -> None:
    path.write_text("".join(orjson.dumps({"bench": "decode", "metric": metric, "value": v, "unit": "tok/s",
                                          "params": {"batch": 1}}).decode() + "\n" for v in values))


def test_apart_overlapping_and_one_round(tmp_path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows(a, [100, 50, 101])  # a load halved round 2: for both sides
    rows(b, [90, 46, 92])
    assert "| 0.911 |" in table(figures(a), figures(b)) and "beyond noise" in table(figures(a), figures(b))
    rows(b, [99, 52, 101])
    assert "within noise" in table(figures(a), figures(b))
    rows(a, [100])
    assert "one round: no spread" in table(figures(a), figures(b))

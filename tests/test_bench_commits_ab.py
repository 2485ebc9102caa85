"""bench/commits_ab.py's verdicts: two sides' rounds apart is beyond noise, overlapping is not, and
one round a side has no spread to judge by."""
from __future__ import annotations

import orjson

from bench.commits_ab import figures, table


def rows(path, values, metric="ours") -> None:
    path.write_text("".join(orjson.dumps({"bench": "decode", "metric": metric, "value": v, "unit": "tok/s",
                                          "params": {"batch": 1}}).decode() + "\n" for v in values))


def test_apart_overlapping_and_one_round(tmp_path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows(a, [100, 102, 101])
    rows(b, [90, 91, 92])
    assert "| 0.901 |" in table(figures(a), figures(b)) and "beyond noise" in table(figures(a), figures(b))
    rows(b, [99, 103, 101])
    assert "within noise" in table(figures(a), figures(b))
    rows(a, [100])
    assert "one round: no spread" in table(figures(a), figures(b))

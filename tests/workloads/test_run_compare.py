"""The regression report (issue 62, part 3): the same configuration twice says "no change"; a run
whose TTFT is worse by more than its spread says "slower beyond noise"; the outputs compared."""
from __future__ import annotations

import numpy as np
import orjson
import pytest
from django.core.management import CommandError, call_command

from engines.workloads.replay import RUN_FORMAT
from engines.workloads.run_compare import RunError, compare_runs, markdown


def run(ttft: np.ndarray, texts: list[str] | None = None, duration: float = 10.0) -> dict:
    rows = [{"request_id": f"r{i}", "error": None, "ttft_s": float(t), "itl_s": [0.02, 0.021],
             "e2e_s": float(t) + 0.05, "completion_tokens": 3, "text": (texts or ["same"] * len(ttft))[i]}
            for i, t in enumerate(ttft)]
    return {"format": RUN_FORMAT, "version": 1, "target": "t", "model": "m", "duration_s": duration,
            "requests": rows}


def verdicts(report: dict, figure: str) -> dict[str, str]:
    return {r["stat"]: r["verdict"] for r in report["figures"] if r["figure"] == figure}


def test_the_same_configuration_twice_is_no_change_and_a_slower_one_is_beyond_noise() -> None:
    rng = np.random.default_rng(1)
    before, again = rng.normal(0.20, 0.02, 200), rng.normal(0.20, 0.02, 200)
    same = compare_runs(run(before), run(again))
    assert set(verdicts(same, "TTFT").values()) == {"no change"}
    assert same["outputs_identical"] == same["outputs_compared"] == 200 and same["first_divergence"] is None
    slower = compare_runs(run(before), run(before * 1.5))
    assert verdicts(slower, "TTFT") == {"p50": "slower beyond noise", "p90": "slower beyond noise",
                                        "p99": "slower beyond noise"}
    p90 = next(r for r in slower["figures"] if r["figure"] == "TTFT" and r["stat"] == "p90")
    assert 0 < p90["ci_low"] <= p90["delta"] <= p90["ci_high"]
    assert verdicts(compare_runs(run(before * 1.5), run(before)), "TTFT")["p50"] == "faster beyond noise"
    assert compare_runs(run(before), run(before)) == compare_runs(run(before), run(before))  # seeded: repeatable


def test_outputs_that_differ_are_counted_with_the_first_divergence() -> None:
    ttft = np.full(3, 0.1)
    report = compare_runs(run(ttft, ["alpha beta", "gamma", "delta"]), run(ttft, ["alpha beta", "gamma!", "delta"]))
    assert (report["outputs_identical"], report["outputs_compared"]) == (2, 3)
    assert report["first_divergence"]["request_id"] == "r1" and report["first_divergence"]["at_char"] == 5
    assert verdicts(report, "TTFT") == {"p50": "no change", "p90": "no change", "p99": "no change"}


def test_the_command_writes_markdown_or_json_and_refuses_what_is_not_a_run(tmp_path, capsys) -> None:
    rng = np.random.default_rng(2)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(orjson.dumps(run(rng.normal(0.2, 0.01, 50))))
    b.write_bytes(orjson.dumps(run(rng.normal(0.4, 0.01, 50))))
    call_command("compare_runs", str(a), str(b))
    text = capsys.readouterr().out
    assert "| TTFT p90 |" in text and "slower beyond noise" in text and "Outputs identical: 50 of 50" in text
    call_command("compare_runs", str(a), str(b), "--json")
    assert orjson.loads(capsys.readouterr().out)["figures"][0]["ci_low"] > 0
    (tmp_path / "bad.json").write_bytes(b'{"format": "x"}')
    with pytest.raises(CommandError, match="not a run"):
        call_command("compare_runs", str(a), str(tmp_path / "bad.json"))
    with pytest.raises(RunError):
        compare_runs({}, {})
    assert markdown(compare_runs(run(np.full(5, 0.1)), run(np.full(5, 0.1)))).startswith("Run B")

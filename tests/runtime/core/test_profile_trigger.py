"""Profiles that start themselves (issue 61, item 6): each trigger fires on its event and only
after the delay, the profile covers the steps after the firing, one profile at a time, and the
trigger is kept with the result."""
from __future__ import annotations

import pytest

from engines.runtime.core.engine import Engine
from engines.runtime.core.profile_trigger import ArmedTrigger, ProfileTrigger, nearest_rank
from engines.runtime.core.request import GenerationRequest
from engines.runtime.core.sampler import SamplingParams
from engines.runtime.core.warm_up import warm_up
from engines.runtime.telemetry.profiler import ProfilerStateError


def request(engine: Engine, rid: str, max_tokens: int = 4, user: str | None = None,
            client_id: str | None = None) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return GenerationRequest(rid, engine.tokenizer.encode(f"trigger {rid} " * 4), params, None, None,
                             user=user, client_request_id=client_id)


def test_a_slow_step_fires_only_after_the_delay() -> None:
    armed = ArmedTrigger(ProfileTrigger(delay_steps=2, step_over_s=0.5))
    assert armed.on_step(0.9) is None and armed.on_step(0.9) is None  # held back by the delay
    assert armed.on_step(0.1) is None
    assert armed.on_step(0.6) == "step 4 took 600 ms (over 500 ms)"
    assert armed.on_step(0.9) is None and armed.fired_by == "step 4 took 600 ms (over 500 ms)"  # once


def test_the_delay_alone_fires_after_its_steps() -> None:
    armed = ArmedTrigger(ProfileTrigger(delay_steps=3))
    assert [armed.on_step(0.01) for _ in range(3)] == [None, None, "3 steps passed"]


def test_ttft_p99_counts_the_window_only() -> None:
    armed = ArmedTrigger(ProfileTrigger(ttft_p99_over_s=1.0, ttft_window_s=60.0))
    assert armed.on_first_token(0.5, now=0.0) is None
    assert armed.on_first_token(0.9, now=10.0) is None
    fired = armed.on_first_token(1.5, now=20.0)
    assert fired == "TTFT p99 of the last 60 s reached 1500 ms over 3 requests (over 1000 ms)"
    # A slow TTFT that has left the window no longer counts.
    armed = ArmedTrigger(ProfileTrigger(ttft_p99_over_s=1.0, ttft_window_s=5.0))
    armed._ttfts.append((0.0, 9.0))
    assert armed.on_first_token(0.2, now=10.0) is None and len(armed._ttfts) == 1


def test_a_request_fires_by_our_id_the_clients_id_or_its_user() -> None:
    by_id = ArmedTrigger(ProfileTrigger(request_id="abc"))
    assert by_id.on_request("other", None, None) is None
    assert by_id.on_request("x1", "abc", None) == "request 'abc' arrived"
    by_user = ArmedTrigger(ProfileTrigger(user="alice"))
    assert by_user.on_request("r1", None, "bob") is None
    assert by_user.on_request("r2", None, "alice") == "request 'r2' of user 'alice' arrived"


def test_nearest_rank() -> None:
    assert nearest_rank([3.0], 0.99) == 3.0
    assert nearest_rank([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert nearest_rank([float(i) for i in range(1, 201)], 0.99) == 198.0


def run_until_idle(engine: Engine) -> list[int]:
    """Step until no work; whether a profile runs after each step (1: it does)."""
    profiled = []
    while engine.has_work:
        engine.step()
        profiled.append(int(engine.profiling.running is not None))
    return profiled


def test_an_armed_profile_starts_with_the_step_after_its_request(make_engine) -> None:
    engine = make_engine()
    warm_up(engine)
    status = engine.start_profile(max_steps=3, trigger=ProfileTrigger(request_id="target"))
    assert status.armed and not status.running and status.trigger == "request 'target' arriving"
    engine.add_request(request(engine, "before", max_tokens=6))
    for _ in range(3):
        engine.step()
    assert engine.profiling.running is None and engine.profiling.armed is not None
    engine.add_request(request(engine, "r-target", client_id="target"))
    assert engine.profiling.status().fired_by == "request 'target' arrived"
    run_until_idle(engine)
    result = engine.stop_profile("demo").to_json()
    assert result["steps"] == 3 and result["stopped_by"] == "max_steps"
    assert result["trigger"] == {"trigger": "request 'target' arriving", "fired_by": "request 'target' arrived"}
    # The first profiled step is the one that prefilled the target: it holds prefill tokens.
    assert result["step_rows"]["rows"][0][result["step_rows"]["fields"].index("prefill_tokens")] > 0


def test_delay_steps_then_a_bounded_profile(make_engine) -> None:
    engine = make_engine()
    warm_up(engine)
    engine.start_profile(max_steps=2, trigger=ProfileTrigger(delay_steps=3))
    engine.add_request(request(engine, "long", max_tokens=10))
    running_after = run_until_idle(engine)
    # Steps 1-3 ran plain; the profile started with the 4th and its step limit ended it with the 5th.
    assert running_after[:6] == [0, 0, 0, 1, 0, 0]
    result = engine.stop_profile("demo").to_json()
    assert (result["steps"], result["stopped_by"]) == (2, "max_steps")
    assert result["trigger"]["fired_by"] == "3 steps passed"


def test_one_profile_at_a_time_and_a_stop_disarms(make_engine) -> None:
    engine = make_engine()
    engine.start_profile(trigger=ProfileTrigger(user="nobody"))
    with pytest.raises(ProfilerStateError, match="armed"):
        engine.start_profile()
    with pytest.raises(ProfilerStateError, match="disarmed"):
        engine.stop_profile("demo")
    assert engine.profiling.armed is None and not engine.profiling.status().armed
    engine.start_profile(max_steps=1)  # free again: a plain profile starts
    assert engine.profiling.running is not None and engine.stop_profile("demo").trigger is None

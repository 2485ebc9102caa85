"""The typed messages between AsyncEngine and the engine core, and the core's dispatch on them."""
from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.disagg.kv_http import KVListenSpec
from engines.runtime.core.disagg.transfer import KVBlock, KVDelivery, ModelIdentity
from engines.runtime.core.live_view import KVCacheDump, LiveRequest, LiveRequests, PrefixCacheEntry, RequestPages
from engines.runtime.core.request import ChoiceDelta, FinishReason, RequestOutput
from engines.runtime.frontend import messages as m
from engines.runtime.frontend.engine_core import EngineCore
from tests.runtime.demo_engine import request

LIVE = LiveRequests([LiveRequest("r2", "alice", None, "decoding", 1.5, 0.1, 40, 16, 40, 0, 3, 8, 12.5, 0.2, 3,
                                  "json_object", 0.7, 1.0, 1, 0, None)], 1)
KV = KVCacheDump(16, 64, 3, 2, 59, 0, 80, 32, 0.4, 1, 0, [RequestPages("r2", 3, "0-2")],
                 [PrefixCacheEntry(32, 2, 1, 1, 0.5, 0, False)], 1)
INFO = m.EngineInfo("cpu", "float32", 4096, 2048, True, kv_bytes_per_token=1024, kv_port=9100)
SAMPLES = [
    m.AddRequest(request("r1", [5, 6, 7], max_tokens=3, response_format={"type": "json_object"})),
    m.AbortRequest("r1"),
    m.ServerTraceEvents((m.ServerTraceEvent(("r1",), "receive request", {"bytes": 12}, 123),)),
    m.Call(7, m.ResetCall(clear_trace=True)),
    m.Call(18, m.ResetPrefixCacheCall()),
    m.Call(8, m.MetricsCall(with_histograms=True)),
    m.Call(9, m.DumpTraceCall(clear=True, skip_empty=False)),
    m.Call(11, m.DashboardCall()),
    m.Call(10, m.CudaProfilerCall(start=False)),
    m.Call(12, m.TraceSinceCall(cursor=42)),
    m.Call(13, m.ProfileCall("start", max_steps=5, max_seconds=2.5, stack_sampling=True)),
    m.Call(14, m.ProfileStatusCall()),
    m.Call(15, m.PrepareReceiveCall("r1", (5, 6, 7, 8), end=-1, timeout_s=5.0)),
    m.Call(16, m.ReceiveKVCall(KVBlock("r1", "ticket", 0, 3, ModelIdentity("ab" * 16, "float32", 16, 2, 1, 4),
                                       np.arange(24, dtype=np.float32).reshape(2, 1, 3, 4),
                                       np.ones((2, 1, 3, 4), dtype=np.float32)))),
    m.Call(17, m.ReleaseReceiveCall("r1")),
    m.Call(18, m.LiveRequestsCall(limit=5)),
    m.Call(19, m.KVCacheDumpCall(max_entries=3)),
    m.Call(20, m.AbortCall("r1")),
    m.Call(21, m.DumpWorkloadCall("demo")),
    m.Shutdown(),
    m.Ready(INFO),
    m.StepOutputs([RequestOutput("r1", [ChoiceDelta(0, "hi", [5], None, FinishReason.STOP)], {"prompt_tokens": 3},
                                 cached_prompt_tokens=2)]),
    m.StepOutputs([RequestOutput("r1", [], {"prompt_tokens": 3}, kv_delivery=KVDelivery(
        "http://127.0.0.1:9100", 96, 10, 20, 400, "KV from another model"))]),
    m.Aborted("r1"),
    m.Reply(7, True, {"ttft_s": 0.1}),
    m.Reply(11, True, m.DashboardReading({"ttft_s": 0.1}, live=LIVE, ended=[{"request_id": "r1"}], kv=KV)),
    m.Dead("RuntimeError('boom')"),
    m.EngineSpec(Path("/tmp/model"), "demo", EngineConfig(max_num_seqs=4)),
    m.EngineSpec(Path("/tmp/model"), "demo", EngineConfig(max_num_seqs=4),
                 kv_listen=KVListenSpec("127.0.0.1", 0, "key")),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: type(s).__name__)
def test_every_message_is_frozen_and_crosses_a_process_boundary_intact(message) -> None:
    assert pickle.loads(pickle.dumps(message)) == message
    field = dataclasses.fields(message)[0].name if dataclasses.fields(message) else None
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(message, field, None)


def test_every_message_class_is_covered_by_the_samples() -> None:
    classes = {getattr(m, name) for name in m.__all__ if dataclasses.is_dataclass(getattr(m, name))}
    covered = {type(s) for s in SAMPLES} | {type(s.call) for s in SAMPLES if isinstance(s, m.Call)}
    # Failed and Rejected carry an exception, which compares by identity: checked below;
    # ServerTraceEvent, EngineInfo and DashboardReading travel inside ServerTraceEvents, Ready and a
    # Reply (sampled above); LocalCall never leaves its process (tests/runtime/frontend/test_kv_http.py);
    # EngineCall is the calls' base.
    assert classes - covered == {m.Failed, m.Rejected, m.ServerTraceEvent, m.EngineInfo, m.LocalCall,
                                 m.DashboardReading, m.EngineCall}


def test_every_call_carries_its_own_handler() -> None:
    calls = [c for name in m.__all__ if isinstance(c := getattr(m, name), type) and issubclass(c, m.EngineCall)
             and c is not m.EngineCall]
    assert len(calls) == 16
    for call in calls:
        assert call.run is not m.EngineCall.run, f"{call.__name__} has no handler"


def test_error_messages_keep_their_exception() -> None:
    for message in (m.Failed(ValueError("no weights")), m.Rejected("r1", ValueError("bad prompt"))):
        back = pickle.loads(pickle.dumps(message))
        assert type(back.error) is ValueError and str(back.error) == str(message.error)


def test_only_metrics_calls_are_answered_mid_step() -> None:
    immediate = [s for s in SAMPLES if EngineCore.is_immediate(s)]
    assert immediate == [m.Call(8, m.MetricsCall(with_histograms=True)), m.Call(11, m.DashboardCall()),
                         m.Call(12, m.TraceSinceCall(cursor=42)), m.Call(14, m.ProfileStatusCall()),
                         m.Call(18, m.LiveRequestsCall(limit=5)), m.Call(19, m.KVCacheDumpCall(max_entries=3)),
                         m.Call(21, m.DumpWorkloadCall("demo"))]
    assert EngineCore.is_immediate(m.Call(1, m.MetricsCall()))


def test_profile_calls_start_stop_and_report(make_engine) -> None:
    core = EngineCore(make_engine(), "demo")
    sent: list[m.CoreMessage] = []
    for call_id, call in enumerate([m.ProfileCall("start", max_steps=2), m.ProfileStatusCall(),
                                    m.ProfileCall("start"), m.ProfileCall("stop", engine_name="demo"),
                                    m.ProfileCall("stop")]):
        core.handle(m.Call(call_id, call), sent.append)
    started, status, again, stopped, none = sent
    assert started.ok and started.value.running and started.value.max_steps == 2
    assert status.ok and status.value.running and status.value.steps == 0
    assert not again.ok and "already running" in str(again.value)
    assert stopped.ok and stopped.value.engine == "demo" and stopped.value.stopped_by == "request"
    assert not none.ok and "no profile is running" in str(none.value)
    assert pickle.loads(pickle.dumps(stopped)).value == stopped.value  # crosses the process boundary


def test_an_abort_call_ends_a_live_request_and_says_whether_it_was_there(make_engine) -> None:
    engine = make_engine()
    core = EngineCore(engine, "demo")
    engine.add_request(request("victim", [5, 6, 7], max_tokens=50, ignore_eos=True))
    engine.step()
    sent: list[m.CoreMessage] = []
    core.handle(m.Call(1, m.AbortCall("victim")), sent.append)
    core.handle(m.Call(2, m.AbortCall("victim")), sent.append)
    outputs, first, second = sent
    assert isinstance(outputs, m.StepOutputs) and outputs.outputs[-1].finished
    assert outputs.outputs[-1].choices[-1].finish_reason == FinishReason.ABORT
    assert (first.value, second.value) == (True, False)  # gone once aborted
    assert not engine.has_work


def test_a_call_that_fails_is_replied_with_its_error(make_engine) -> None:
    core = EngineCore(make_engine(tracing=False))
    sent: list[m.CoreMessage] = []
    assert core.handle(m.Call(3, m.DumpTraceCall()), sent.append)
    [reply] = sent
    assert isinstance(reply, m.Reply) and reply.call_id == 3 and not reply.ok
    assert isinstance(reply.value, ValueError) and "tracing is off" in str(reply.value)


def test_calls_are_carried_out(make_engine) -> None:
    core = EngineCore(make_engine(tracing=True))
    sent: list[m.CoreMessage] = []
    core.handle(m.Call(1, m.MetricsCall()), sent.append)
    core.handle(m.Call(2, m.MetricsCall(with_histograms=True)), sent.append)
    core.handle(m.Call(3, m.DumpTraceCall(skip_empty=True)), sent.append)
    core.handle(m.Call(4, m.CudaProfilerCall(start=True)), sent.append)
    metrics, pair, empty, profiler = sent
    assert metrics.ok and "engine_prefill_time_sum" in metrics.value
    assert pair.ok and isinstance(pair.value, tuple) and pair.value[0].keys() == metrics.value.keys()
    assert empty.ok and empty.value is None
    assert not profiler.ok and "cuda backend" in str(profiler.value)


def test_adding_a_bad_request_is_rejected_alone(make_engine) -> None:
    core = EngineCore(make_engine())
    sent: list[m.CoreMessage] = []
    assert core.handle(m.AddRequest(request("bad", [])), sent.append)
    [rejected] = sent
    assert isinstance(rejected, m.Rejected) and rejected.request_id == "bad"
    assert "prompt is empty" in str(rejected.error)


def test_an_unknown_command_is_an_error_and_kills_the_loop_visibly(make_engine) -> None:
    core = EngineCore(make_engine())
    with pytest.raises(TypeError, match="not an engine command"):
        core.handle(("add", None), lambda message: None)  # the old tuple form is not a command
    with pytest.raises(TypeError, match="not an engine call"):
        core.call("metrics", lambda message: None)
    commands = iter([("abort", "x")])
    sent: list[m.CoreMessage] = []
    core.run(lambda timeout: next(commands), sent.append)
    assert isinstance(sent[-1], m.Dead) and "not an engine command" in sent[-1].reason

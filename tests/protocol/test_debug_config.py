"""DebugConfig and DisaggConfig: MLC's fields and defaults, serialisation, and every check."""
from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from engines.protocol import DebugConfig, DisaggConfig, validation_error_message, validation_error_param


def metadata(values: object) -> str:
    """kv_append_metadata as MLC sends it: base64 of JSON."""
    return base64.b64encode(json.dumps(values).encode()).decode()


def error_of(cls: type, data: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return validation_error_message(info.value), validation_error_param(info.value)


# ------------------------------------------------------------------ defaults, round trips


def test_defaults_are_mlcs():
    config = DebugConfig()
    assert config.ignore_eos is False
    assert config.pinned_system_prompt is False
    assert config.special_request is None
    assert config.grammar_execution_mode == "jump_forward"
    assert config.disagg_config is None
    assert DisaggConfig().model_dump() == {}


def test_default_dump_leaves_out_unset_special_request_and_disagg_config():
    assert DebugConfig().model_dump() == {
        "ignore_eos": False,
        "pinned_system_prompt": False,
        "grammar_execution_mode": "jump_forward",
    }
    assert json.loads(DebugConfig().model_dump_json()) == DebugConfig().model_dump()


def test_disagg_config_without_kind_is_left_out():
    assert "disagg_config" not in DebugConfig(disagg_config=DisaggConfig()).model_dump()


def test_full_config_round_trips():
    config = DebugConfig(
        ignore_eos=True,
        pinned_system_prompt=True,
        special_request="query_engine_metrics",
        grammar_execution_mode="constraint",
        disagg_config=DisaggConfig(kind="start_generation", kv_window_begin=-1),
    )
    dumped = config.model_dump()
    assert dumped == {
        "ignore_eos": True,
        "pinned_system_prompt": True,
        "special_request": "query_engine_metrics",
        "grammar_execution_mode": "constraint",
        "disagg_config": {"kind": "start_generation", "kv_window_begin": -1},
    }
    assert DebugConfig.model_validate(dumped) == config
    assert DebugConfig.model_validate_json(config.model_dump_json()) == config


def test_explicit_nulls_are_accepted_like_mlc():
    config = DebugConfig.model_validate({"special_request": None, "disagg_config": None})
    assert config == DebugConfig()


# ---------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"ignore_eos": "yes"}, "ignore_eos: Input should be a valid boolean"),
        # strict, like MLC's C++ JSON reader: neither a string nor a number is a boolean
        ({"ignore_eos": "true"}, "ignore_eos: Input should be a valid boolean"),
        ({"pinned_system_prompt": 1}, "pinned_system_prompt: Input should be a valid boolean"),
        ({"special_request": "dump_everything"}, "special_request: Input should be 'query_engine_metrics'"),
        ({"grammar_execution_mode": "fast"}, "grammar_execution_mode: Input should be 'constraint' or 'jump_forward'"),
        ({"disagg_config": {"kind": "teleport"}}, "disagg_config.kind: Input should be 'prepare_receive'"),
        ({"disagg_config": {"kind": "start_generation", "kv_window_begin": 1.5}}, "disagg_config.kv_window_begin:"),
        ({"disagg_config": "prepare_receive"}, "disagg_config: Input should be a valid dictionary"),
    ],
)
def test_wrong_type_or_value_names_the_field(data, expected):
    message, _ = error_of(DebugConfig, data)
    assert message.startswith(expected), message


def test_bad_value_is_shown_back():
    message, param = error_of(DebugConfig, {"grammar_execution_mode": "fast"})
    assert message.endswith("(got 'fast')")
    assert param == "grammar_execution_mode"


def test_unknown_field_is_refused_by_name_with_the_accepted_ones():
    message, param = error_of(DebugConfig, {"ignore_eso": True})
    assert message == (
        "unknown field 'ignore_eso'; DebugConfig accepts: ignore_eos, pinned_system_prompt, "
        "special_request, grammar_execution_mode, disagg_config"
    )
    assert param == "ignore_eso"


def test_unknown_fields_are_all_named():
    message, _ = error_of(DebugConfig, {"ignore_eso": True, "verbose": 1})
    assert "unknown fields 'ignore_eso', 'verbose'" in message


def test_unknown_disagg_field_is_refused_with_its_path():
    message, param = error_of(DebugConfig, {"disagg_config": {"kind": "prepare_receive", "kv_window_end": 4, "end": 3}})
    assert message.startswith("disagg_config: unknown field 'end'; DisaggConfig accepts: kind, kv_append_metadata")
    assert param == "disagg_config.end"


def test_unknown_field_is_refused_on_direct_construction_too():
    with pytest.raises(ValidationError):
        DebugConfig(ignore_eso=True)  # type: ignore[call-arg]


# ------------------------------------------------------------------------ disagg windows


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "prepare_receive", "kv_window_end": 10},
        {"kind": "prepare_receive", "kv_window_begin": 0, "kv_window_end": -1},
        {"kind": "prepare_receive", "kv_window_begin": 0, "kv_window_end": 0},
        {"kind": "remote_send", "kv_window_begin": 0, "kv_window_end": 4, "kv_append_metadata": metadata([1, 0, 4]),
         "dst_group_offset": 1},
        # with a negative end the window length depends on the prompt: the engine checks it
        {"kind": "remote_send", "kv_window_begin": 2, "kv_window_end": -1, "kv_append_metadata": metadata([1, 0, 9])},
        {"kind": "start_generation", "kv_window_begin": 7},
        {"kind": "start_generation", "kv_window_begin": -1},
        {},
    ],
)
def test_consistent_windows_are_accepted(data):
    assert DisaggConfig.model_validate(data).model_dump() == data


@pytest.mark.parametrize(
    ("data", "expected", "param"),
    [
        (
            {"kind": "prepare_receive", "kv_window_begin": 3, "kv_window_end": 8},
            'kind "prepare_receive" requires kv_window_begin to be 0 or null (got 3)',
            "kv_window_begin",
        ),
        (
            {"kind": "prepare_receive"},
            "Prefill the full input on the remote machine is not supported.",
            "kv_window_end",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": 5, "kv_window_end": 5, "kv_append_metadata": metadata([0])},
            '"begin >= end" is not supported by remote prefill',
            "kv_window_end",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": 6, "kv_window_end": 2, "kv_append_metadata": metadata([0])},
            '"begin >= end" is not supported by remote prefill',
            "kv_window_end",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": -2, "kv_window_end": 4},
            'kind "remote_send" requires kv_window_begin >= 0 (got -2)',
            "kv_window_begin",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": 0},
            "Prefill the full input on the remote machine is not supported.",
            "kv_window_end",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": 0, "kv_window_end": 4},
            'kind "remote_send" requires kv_append_metadata',
            "kv_append_metadata",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": 0, "kv_window_end": 4,
             "kv_append_metadata": metadata([1, 0, 3])},
            "kv_append_metadata of model 0 covers 3 tokens but the window [0:4] holds 4",
            "kv_append_metadata",
        ),
        (
            {"kind": "start_generation"},
            'kind "start_generation" requires kv_window_begin',
            "kv_window_begin",
        ),
        (
            {"kind": "start_generation", "kv_window_begin": 3, "kv_window_end": 9},
            'kind "start_generation" requires kv_window_end to be null (got 9)',
            "kv_window_end",
        ),
        (
            {"kv_window_end": 9},
            "kv_window_end has no meaning without kind; "
            'set kind to "prepare_receive", "remote_send" or "start_generation"',
            "kind",
        ),
        (
            {"kind": "remote_send", "kv_window_begin": 0, "kv_window_end": 1, "kv_append_metadata": metadata([1, 0, 1]),
             "dst_group_offset": -1},
            "dst_group_offset must be >= 0 (got -1)",
            "dst_group_offset",
        ),
    ],
)
def test_inconsistent_windows_are_refused(data, expected, param):
    message, got_param = error_of(DebugConfig, {"disagg_config": data})
    assert message.startswith("disagg_config: "), message
    assert expected in message
    assert got_param == f"disagg_config.{param}"


# ------------------------------------------------------------------- kv_append_metadata


def test_metadata_decodes_into_segments_per_model():
    config = DisaggConfig(
        kind="remote_send",
        kv_window_begin=0,
        kv_window_end=5,
        # two models, each the same 5 tokens: one in two segments, one in one
        kv_append_metadata=metadata([2, 0, 3, 16, 2, 1, 32, 5]),
    )
    assert config.kv_append_metadata_segments() == [[(0, 3), (16, 2)], [(32, 5)]]
    assert DisaggConfig().kv_append_metadata_segments() == []


def test_empty_segment_list_is_valid():
    # prepare_receive with nothing to receive answers [0] (MLC's "{0}" shape)
    config = DisaggConfig(kind="prepare_receive", kv_window_end=0, kv_append_metadata=metadata([0]))
    assert config.kv_append_metadata_segments() == [[]]


@pytest.mark.parametrize(
    ("encoded", "expected"),
    [
        ("not base64!", "kv_append_metadata parse error: not valid base64"),
        (base64.b64encode(b"[1, 2").decode(), "kv_append_metadata parse error: "),
        (base64.b64encode(b"\xff\xfe").decode(), "kv_append_metadata parse error: "),
        (metadata({"segments": [0]}), "kv_append_metadata is not array of integer."),
        (metadata(7), "kv_append_metadata is not array of integer."),
        (metadata([1, "0", 4]), "Invalid kv append metadata value in kv_append_metadata array"),
        (metadata([1, 0.5, 4]), "Invalid kv append metadata value in kv_append_metadata array"),
        (metadata([1, True, 4]), "Invalid kv append metadata value in kv_append_metadata array"),
        (metadata([2, 0, 4]), "Invalid kv append metadata compression in kv_append_metadata"),
        (metadata([-1]), "Invalid kv append metadata compression in kv_append_metadata"),
        # Nested past the JSON parser's recursion limit: a RecursionError, not a ValueError.
        (base64.b64encode(b"[" * 100_000 + b"]" * 100_000).decode(), "kv_append_metadata parse error: "),
    ],
)
def test_malformed_metadata_gets_mlcs_message(encoded, expected):
    message, param = error_of(
        DebugConfig, {"disagg_config": {"kind": "prepare_receive", "kv_window_end": 4, "kv_append_metadata": encoded}}
    )
    assert message.startswith(f"disagg_config: {expected}"), message
    assert param == "disagg_config.kv_append_metadata"


def test_microserving_flow_bodies_validate():
    """The three configs MLC's microserving endpoints build for one request."""
    prep = DebugConfig(disagg_config=DisaggConfig(kind="prepare_receive", kv_window_begin=0, kv_window_end=-1))
    layout = metadata([1, 128, 40])
    send = DebugConfig(
        disagg_config=DisaggConfig(
            kind="remote_send", kv_window_begin=0, kv_window_end=40, kv_append_metadata=layout, dst_group_offset=1
        )
    )
    start = DebugConfig(disagg_config=DisaggConfig(kind="start_generation", kv_window_begin=40))
    for config in (prep, send, start):
        assert DebugConfig.model_validate_json(config.model_dump_json()) == config


def test_our_metadata_object_carries_mlcs_segments():
    """``KVAppendMetadata`` (MLC's array plus the receiver) passes where MLC's bare array does,
    and its segments are checked the same way."""
    from engines.protocol.microserving import KVAppendMetadata, KVReceiverAddress

    receiver = KVReceiverAddress(url="http://decode:8000/", server="s", engine="demo", request_id="r", ticket="t")
    ours = KVAppendMetadata.for_window([(128, 24), (512, 16)], receiver, {"weights": "ab"}).encode()
    config = DisaggConfig(kind="remote_send", kv_window_begin=0, kv_window_end=40, kv_append_metadata=ours)
    assert config.kv_append_metadata_segments() == [[(128, 24), (512, 16)]]
    assert KVAppendMetadata.decode(ours).receiver == receiver
    message, _ = error_of(DebugConfig, {"disagg_config": {
        "kind": "remote_send", "kv_window_begin": 0, "kv_window_end": 30, "kv_append_metadata": ours}})
    assert "covers 40 tokens" in message

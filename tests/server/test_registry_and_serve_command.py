"""The registry (MLC's ServerContext) and the serve command's checks that run before any engine loads
(start-up's own parts, ``engines.startup``: ``test_startup.py``)."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from engines.management.commands.serve import is_loopback
from engines.registry import EngineRegistry, RegistryError, ServerOptions
from engines.startup import ModelSpec
from tests.processes import Server, start_server

REPO = Path(__file__).resolve().parents[2]


class FakeEngine:
    """Only what the registry itself touches; the API tests use real engines."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = self.stopped = False

    @property
    def is_alive(self) -> bool:
        return self.started and not self.stopped

    def start(self) -> None:
        self.started = True

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture
def any_port(monkeypatch) -> None:
    """``serve``'s port check passes: for tests of other steps, whatever holds this machine's ports
    (port 8000, the default, or an address that is not this machine's); the cookie names that
    ``serve`` then sets from its port are put back after the test."""
    from django.conf import settings

    from engines.management.commands import serve

    monkeypatch.setattr(serve, "check_port_free", lambda host, port: None)
    for name in ("SESSION_COOKIE_NAME", "CSRF_COOKIE_NAME"):
        monkeypatch.setattr(settings, name, getattr(settings, name))


def test_serve_serves_both_built_in_models_by_default_and_takes_kv_cache_bytes(monkeypatch, any_port) -> None:
    from engines.management.commands.serve import Command

    seen: dict = {}
    monkeypatch.setattr(Command, "_apply_migrations", lambda self: None)
    monkeypatch.setattr(Command, "_run_daphne", lambda *args, **kwargs: None)
    monkeypatch.setattr(Command, "_load_engines",
                        lambda self, specs, options: seen.update(specs=specs, options=options))
    call_command("serve", "--kv-cache-bytes", "256MiB")
    assert seen["specs"] == [ModelSpec("smollm2"), ModelSpec("demo")]
    assert seen["options"]["kv_cache_bytes"] == 256 << 20
    with pytest.raises(CommandError):  # one way of sizing the KV cache at a time
        call_command("serve", "--kv-cache-bytes", "1G", "--num-pages", "8")
    assert seen["options"]["keep_quantized"]  # a GGUF's types kept unless --weights-dtype says otherwise
    call_command("serve", "--weights-dtype", "gguf")
    assert seen["options"]["weights_dtype"] == "gguf" and seen["options"]["keep_quantized"]
    call_command("serve", "--weights-dtype", "float32")
    assert not seen["options"]["keep_quantized"]
    call_command("serve", "--dtype", "float16")  # the KV cache in float16, the GGUF still in its types
    assert seen["options"]["keep_quantized"]
    with pytest.raises(CommandError, match="dequantized weights are stored in --dtype"):
        call_command("serve", "--weights-dtype", "float16")  # with --dtype float32


@pytest.mark.parametrize("flags, models, weights, quantized_units", [
    ([], ["smollm2"], "Q4_1 x210, Q8_0 x1", True),  # the default: the file's types
    (["--weights-dtype", "gguf"], ["smollm2"], "Q4_1 x210, Q8_0 x1", True),
    (["--weights-dtype", "float32"], ["smollm2"], "float32", False),
    ([], ["demo"], "float32", False),  # a Hugging Face folder: floats whatever the choice
])
def test_serve_holds_a_gguf_in_its_types_by_default(monkeypatch, any_port, precompiled, flags, models, weights,
                                                    quantized_units) -> None:
    """``serve`` down to the engines it builds (on a thread, not started): the weights each holds,
    as its start-up line says them, and whether the cold start's compile was asked for the
    kept-quantized units."""
    import io
    from functools import partial

    from engines import registry as registry_module
    from engines.management.commands import serve

    monkeypatch.setattr(serve.Command, "_apply_migrations", lambda self: None)
    monkeypatch.setattr(serve.Command, "_run_daphne", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve, "configure", partial(registry_module.configure, start=False))
    out = io.StringIO()
    try:
        call_command("serve", "--backend", "cpu", "--engine-mode", "thread", *flags,
                     *[arg for model in models for arg in ("--model", model)], stdout=out)
    finally:
        registry_module.registry.shutdown_all()
        registry_module.registry.options = ServerOptions()
    assert f"  {models[0]}: cpu backend, weights {weights}, tracing off, server thread;" in out.getvalue()
    assert precompiled == [quantized_units]


def test_registry_lookup_never_guesses() -> None:
    reg = EngineRegistry()
    reg.replace([FakeEngine("a")], ServerOptions())
    assert reg.get("a").name == "a"
    assert reg.get("b") is None and reg.get(None) is None  # a lone engine is not returned for other names
    assert reg.first().name == "a"


def test_registry_order_duplicates_and_lifecycle() -> None:
    reg = EngineRegistry()
    engines = [FakeEngine("b"), FakeEngine("a")]
    reg.replace(engines, ServerOptions(enable_debug=True))
    assert reg.model_names() == ["b", "a"] and reg.options.enable_debug
    with pytest.raises(RegistryError, match="Model a already running."):
        reg.add(FakeEngine("a"))
    reg.start_all()
    assert all(e.is_alive for e in engines)
    reg.shutdown_all()
    reg.shutdown_all()  # twice is harmless (signal handler, then finally)
    assert all(e.stopped for e in engines) and len(reg) == 0


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True), ("127.0.0.2", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.com", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_serve_refuses_a_public_host_without_a_key(monkeypatch) -> None:
    monkeypatch.delenv("API_KEY", raising=False)
    with pytest.raises(CommandError, match="refusing to listen on 0.0.0.0 without an API key"):
        call_command("serve", "--host", "0.0.0.0")  # a blank key: test_serve_api_key.py


@pytest.mark.parametrize("host, allowed", [("0.0.0.0", "0.0.0.0"), ("::", "[::]"), ("192.0.2.7", "192.0.2.7")])
def test_serve_allows_the_host_it_listens_on(monkeypatch, settings, host, allowed, any_port) -> None:
    """The URL serve prints must work: Django refuses a Host header missing from ALLOWED_HOSTS."""
    from engines.management.commands.serve import Command

    for step in ("_apply_migrations", "_load_engines", "_run_daphne"):
        monkeypatch.setattr(Command, step, lambda *args, **kwargs: None)
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    call_command("serve", "--host", host, "--api-key", "k")
    assert settings.ALLOWED_HOSTS == ["127.0.0.1", allowed]


def test_serve_rejects_a_bad_model_spec() -> None:
    with pytest.raises(CommandError, match="served name"):
        call_command("serve", "--model", "demo:")


def test_serve_reports_a_bad_checkpoint_and_exits(tmp_path) -> None:
    """A wrong --model path ends the command with the loader's message, not a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "API_KEY")}
    env["DEBUGSITE_VAR_DIR"] = str(tmp_path)
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "manage.py", "serve", "--model", f"{missing}:mine", "--port", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "CommandError" in result.stderr and str(missing) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_servers_started_together_on_a_fresh_machine_share_its_database(tmp_path):
    """A prefill and a decode server started at once with one new var folder: the first run's
    migrations happen once, under a lock, and both come up (they raced before)."""
    var = tmp_path / "shared-var"
    started: list[Server] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            started.append(start_server(["--model", "demo", "--backend", "cpu", "--max-total-tokens", "512"], var))
        except BaseException as exc:  # noqa: BLE001 - pytest.fail raises an outcome, reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    try:
        assert not errors, errors
        assert len(started) == 2 and all(s.http.get("/health").status_code == 200 for s in started)
    finally:
        for s in started:
            s.stop()
    check = subprocess.run([sys.executable, "manage.py", "migrate", "--check"], cwd=REPO, capture_output=True,
                           env={**{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},  # as the servers
                                "DEBUGSITE_VAR_DIR": str(var)})
    assert check.returncode == 0, check.stdout + check.stderr


def test_serve_on_a_port_in_use_says_so_before_loading_models(tmp_path) -> None:
    """The port is checked before any model loads (minutes for a large one), and no link is
    printed that would lead to whatever else holds the port."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "API_KEY")}
    env["DEBUGSITE_VAR_DIR"] = str(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "manage.py", "serve", "--model", "demo", "--port", str(port)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
        )
    assert result.returncode == 1
    assert f"could not listen on 127.0.0.1:{port}" in result.stderr
    assert "Dashboard" not in result.stdout and "Quit with CONTROL-C" not in result.stdout
    assert "Loading" not in result.stdout and "migration" not in result.stdout, result.stdout


def test_serve_gives_daphne_the_body_only_request_class(monkeypatch, any_port) -> None:
    """Daphne builds each connection's requests from ``BodyOnlyRequest`` under ``serve``
    (engines/server/daphne_requests.py: Twisted's form parsing off)."""
    from daphne import http_protocol

    from engines.server import daphne_requests
    from engines.management.commands import serve

    monkeypatch.setattr(http_protocol, "WebRequest", http_protocol.WebRequest)  # restored after the test
    for step in ("_apply_migrations", "_load_engines"):
        monkeypatch.setattr(serve.Command, step, lambda *args, **kwargs: None)
    seen: list[type] = []

    class Daphne:
        """Stands in for Daphne's server: notes the request class its factory would use, and stops."""

        listening_addresses = [("127.0.0.1", 1)]

        def __init__(self, **kwargs: object) -> None:
            pass

        def run(self) -> None:
            seen.append(http_protocol.WebRequest)

    monkeypatch.setattr(serve, "Server", Daphne)
    loop = asyncio.new_event_loop()  # Daphne's run() would have set one up; serve tidies it after
    asyncio.set_event_loop(loop)
    try:
        call_command("serve", "--port", "1")
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    assert seen == [daphne_requests.BodyOnlyRequest]

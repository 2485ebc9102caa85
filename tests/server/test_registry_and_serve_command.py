"""The registry (MLC's ServerContext) and the serve command's checks that run before any engine loads."""
from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from engines.management.commands.serve import is_loopback
from engines.registry import EngineRegistry, ModelSpec, RegistryError, ServerOptions


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
        call_command("serve", "--host", "0.0.0.0", "--api-key", "")


def test_serve_rejects_a_bad_model_spec() -> None:
    with pytest.raises(CommandError, match="served name"):
        call_command("serve", "--model", "demo:")

"""``serve`` refuses an API key that protects nothing, before any engine loads."""
from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize("key", ["", " ", "\t \n"])
def test_serve_refuses_a_blank_api_key(monkeypatch, host: str, key: str) -> None:
    from engines.management.commands.serve import Command

    for step in ("_apply_migrations", "_load_engines", "_run_daphne"):  # must never be reached
        monkeypatch.setattr(Command, step, lambda *args, _step=step, **kwargs: pytest.fail(f"{_step} ran"))
    with pytest.raises(CommandError, match="empty or only whitespace"):
        call_command("serve", "--host", host, "--api-key", key)


def test_configure_from_env_refuses_a_whitespace_api_key() -> None:
    from engines.registry import RegistryError
    from engines.startup import configure_from_env

    with pytest.raises(RegistryError, match="only whitespace"):
        configure_from_env({"ENGINES_MODELS": "demo", "API_KEY": "  "})

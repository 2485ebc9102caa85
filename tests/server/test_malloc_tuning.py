"""glibc's allocator settings for the server (engines.server.malloc_tuning): taken (the project runs on
Linux, with glibc), harmless twice."""
from __future__ import annotations

import ctypes

import pytest

from engines.server import malloc_tuning


def test_glibc_takes_the_settings_and_trims() -> None:
    assert malloc_tuning.tune_malloc() is True
    assert malloc_tuning.tune_malloc() is True  # serve may run twice in one process (tests)
    freed = [ctypes.create_string_buffer(4096) for _ in range(20000)]  # ~80 MB in small blocks, then freed
    del freed
    assert isinstance(malloc_tuning.trim_malloc(), bool)


def test_off_glibc_both_are_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc_tuning, "_LIBC", None)
    assert malloc_tuning.tune_malloc() is False
    assert malloc_tuning.trim_malloc() is False

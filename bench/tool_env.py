"""What the benches that run other people's tools need: a virtualenv of the tools' own under ``var/``
(their pinned requirements, apart from the server's) and a Hugging Face tokenizer folder made from
a served model's own tokenizer, offline."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tool_venv(name: str, requirements: Path, first: tuple[str, ...] = ()) -> Path:
    """``var/NAME``, a virtualenv with ``requirements`` installed, made the first time (and again when
    the file changes). ``first`` is installed alone before it: ``torch==2.13.0``, the CPU build on
    this machine's disk, which a tool's bare ``torch`` would otherwise fetch as a CUDA build."""
    venv = REPO / "var" / name
    digest = hashlib.sha256(requirements.read_bytes() + "\n".join(first).encode()).hexdigest()[:12]
    stamp = venv / f".installed-{digest}"
    if not stamp.exists():
        print(f"installing {requirements.relative_to(REPO)} into var/{name} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = str(venv / "bin" / "pip")
        if first:
            subprocess.run([pip, "install", "-q", *first], check=True)
        subprocess.run([pip, "install", "-q", "-r", str(requirements)], check=True)
        stamp.touch()
    return venv


def write_tokenizer(model: str, folder: Path) -> Path:
    """A Hugging Face tokenizer folder for aiperf, guidellm and lm-eval, from the model's own
    tokenizer: its tokenizer.json (a GGUF's vocabulary as the engine reads it) and the settings
    beside it; no hub, no torch."""
    sys.path.insert(0, str(REPO))
    from engines.runtime import BUILTIN_MODEL_NAMES, builtin_model_path, load_checkpoint

    path = builtin_model_path(model) if model in BUILTIN_MODEL_NAMES else Path(model)
    tokenizer = load_checkpoint(path, load_weights=False).tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tokenizer.chat_template,
              **tokenizer.special_tokens}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


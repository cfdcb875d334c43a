"""What a server is started with: its `ServerConfig`, and the check of the model directory it
serves (`check_model_dir`), made before any server starts. No torch: the batching server's
front end and the model server's launcher run it before an engine loads anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fish_sm.errors import CheckpointError
from fish_sm.settings import Settings

REQUIRED = ("config.json", "tokenizer.tiktoken", "special_tokens.json")


@dataclass(frozen=True)
class ServerConfig:
    model_dir: Path
    port: int = 8080
    host: str = "127.0.0.1"
    workers: int | None = None  # default: one per GPU, or one on the CPU
    response_timeout: int = 900  # seconds for one request: long texts on a busy worker


def check_model_dir(model_dir: Path, verify: bool = True) -> None:
    """A package directory (every file verified against its manifest.json, and against
    FISH_SM_MANIFEST_SHA256 when set) or a plain checkpoint directory: the checkpoint files at the top.
    `verify=False`: the files' presence only (the batching server hashes the package once its
    engine cores are starting, and they read nothing until it has)."""
    from fish_sm.package.verify import verify_package

    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    missing = [f for f in REQUIRED if not (model_dir / f).is_file()]
    for stem in ("model", "codec"):
        if not any((model_dir / (stem + s)).is_file() for s in (".pth", ".safetensors")):
            missing.append(stem + ".pth")
    if missing:
        raise CheckpointError(f"{model_dir}: not a checkpoint or package directory (missing {', '.join(missing)})")
    if verify:  # before Java or any engine starts; load_model's own check in this process then finds it verified
        verify_package(model_dir, Settings.from_env().manifest_sha256)

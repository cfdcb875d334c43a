"""The package directory a SageMaker model is made from (it becomes model.tar.gz).

    config.json model.pth codec.pth tokenizer.tiktoken special_tokens.json   the checkpoint, unchanged
    code/inference.py code/requirements.txt code/fish_sm/                  for the stock PyTorch container
    code/lib/                                                              its dependencies, vendored (instead of requirements.txt)
    voices/<id>/                                                           precomputed reference voices
    adapters/<name>.safetensors                                            LoRA fine-tunes, checked against the base
    compile_cache/                                                         kernels from an earlier start
    manifest.json                                                          versions, voices, sha256 of every file

The checkpoint is validated before anything is written: config, tokenizer, and every
tensor's name and shape in both weight files; so is every adapter, against the checkpoint's
config. manifest.json carries config.json's contents too, so the AWS side can check an adapter
against an endpoint's base model from the manifest alone (one ranged GET of model.tar.gz).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import fish_sm
from fish_sm.errors import CheckpointError, InputError
from fish_sm.model.checkpoint import FILES, find_model_file
from fish_sm.model.config import ModelConfig
from fish_sm.model.tokenizer import Tokenizer

PACKAGE_ROOT = Path(fish_sm.__file__).parent
ENTRY_POINT = PACKAGE_ROOT / "serving" / "mms" / "entry_point.py"
STOCK_REQUIREMENTS = PACKAGE_ROOT / "serving" / "stock_requirements.txt"
COMPILE_CACHE_META = "cache.json"  # in compile_cache/: the GPU architecture and torch its kernels were built for
Progress = Callable[[str, int, int], None]  # (what, done, total)


def validate_checkpoint(checkpoint: Path) -> dict:
    """Check every file of a checkpoint directory; returns a summary for the manifest."""
    from fish_sm.model.codec import codec_from_state_dict
    from fish_sm.model.dual_ar import checked_weights
    from fish_sm.model.weights import read_state_dict

    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: not a directory")
    config = ModelConfig.from_file(checkpoint / "config.json")
    tokenizer = Tokenizer.from_dir(checkpoint)
    if tokenizer.num_semantic != config.codebook_size:
        raise CheckpointError(f"{checkpoint}: special_tokens.json has {tokenizer.num_semantic} semantic tokens, "
                              f"config.json's codebook_size is {config.codebook_size}")
    checked_weights(find_model_file(checkpoint, "model"), config)
    codec_path = find_model_file(checkpoint, "codec")
    codec = codec_from_state_dict(read_state_dict(codec_path), device="meta", source=str(codec_path)).config
    if codec.semantic_codebook_size != config.codebook_size or 1 + codec.n_codebooks != config.num_codebooks:
        raise CheckpointError(f"{codec_path}: the codec's codebooks ({codec.semantic_codebook_size} semantic + "
                              f"{codec.n_codebooks} residual) do not match config.json")
    return {"model_type": config.model_type, "n_layer": config.n_layer, "dim": config.dim,
            "vocab_size": config.vocab_size, "num_codebooks": config.num_codebooks,
            "codec": {"sample_rate": codec.sample_rate, "frame_length": codec.frame_length}}


def checkpoint_files(checkpoint: Path) -> list[Path]:
    names = ["config.json", "tokenizer.tiktoken", "special_tokens.json"]
    return [checkpoint / n for n in names] + [find_model_file(checkpoint, "model"), find_model_file(checkpoint, "codec")]


def sha256(path: Path, progress: Progress | None = None) -> str:
    h, done, total = hashlib.sha256(), 0, path.stat().st_size
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(f"hashing {path.name}", done, total)
    return h.hexdigest()


def build_package_dir(checkpoint_dir: Path, out_dir: Path, voices: dict[str, tuple[Path, str]] | None = None,
                      compile_cache: Path | None = None, progress: Progress | None = None,
                      vendor_wheels: list[Path] | None = None,
                      adapters: dict[str, tuple[Path, float | None]] | None = None) -> dict:
    """Validate `checkpoint_dir`, then write the package layout into `out_dir`; returns the manifest.

    With `vendor_wheels` (see package/vendor.py) the stock container's dependencies are unpacked
    into code/lib/ and no code/requirements.txt is written, so the container fetches nothing at start.
    `adapters`: {name: (fine-tune file, lora_alpha or None)}, each read and checked before
    anything else is written (see `write_adapters`); a voice with an adapter's name implies it.
    """
    import torch

    from fish_sm.engine.engine import Engine
    from fish_sm.package.voices import write_voice

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    for name in (*FILES, "model.safetensors", "codec.safetensors"):  # before any of them is read
        _refuse_link_outside(checkpoint_dir / name, checkpoint_dir, "copy the files into the directory, e.g. with "
                                                                    "`huggingface-cli download --local-dir DIR`")
    summary = validate_checkpoint(checkpoint_dir)
    for voice_id, (audio, _) in (voices or {}).items():
        if not Path(audio).is_file():
            raise InputError(f"voice {voice_id}: audio file not found: {audio}")
    cache_info = None
    if compile_cache is not None:
        meta = Path(compile_cache) / COMPILE_CACHE_META
        if not meta.is_file():
            raise InputError(f"{compile_cache}: not a compile cache (no {COMPILE_CACHE_META}; point at FISH_SM_CACHE_DIR/<device> of a started server)")
        for path in sorted(Path(compile_cache).rglob("*")):
            _refuse_link_outside(path, Path(compile_cache), "point --compile-cache at a cache that holds its files")
        cache_info = json.loads(meta.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter_meta = write_adapters(checkpoint_dir, out_dir, adapters or {})
    for f in checkpoint_files(checkpoint_dir):
        shutil.copyfile(f, out_dir / f.name)
    code = out_dir / "code"
    code.mkdir(exist_ok=True)
    shutil.copyfile(ENTRY_POINT, code / "inference.py")
    vendored = None
    if vendor_wheels is None:
        shutil.copyfile(STOCK_REQUIREMENTS, code / "requirements.txt")
    else:
        from fish_sm.package.vendor import LIB_DIR, unpack_wheels

        vendored = unpack_wheels(vendor_wheels, code / LIB_DIR)
    shutil.copytree(PACKAGE_ROOT, code / "fish_sm", dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    voice_meta = {}
    if voices:
        engine = Engine.from_pretrained(out_dir, device="cpu", max_seq_len=64)
        for voice_id, (audio, transcript) in sorted(voices.items()):
            reference = engine.encode_reference(Path(audio), transcript)
            voice_meta[voice_id] = write_voice(out_dir / "voices", voice_id, Path(audio), transcript,
                                               reference.codes, engine.sample_rate)
            if voice_id in adapter_meta:  # the fine-tuned speaker's own voice speaks with its adapter
                voice_meta[voice_id]["adapter"] = voice_id
        del engine
    if compile_cache is not None:
        shutil.copytree(compile_cache, out_dir / "compile_cache", dirs_exist_ok=True)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p != out_dir / "manifest.json")
    manifest = {
        "format": 1,
        "versions": {"fish_sm": fish_sm.__version__, "torch": torch.__version__},
        "checkpoint": summary,
        "config": json.loads((checkpoint_dir / "config.json").read_text(encoding="utf-8")),
        "voices": voice_meta,
        "adapters": adapter_meta,
        "compile_cache": cache_info,
        "vendored": vendored,
        "files": {str(p.relative_to(out_dir)): {"size": p.stat().st_size, "sha256": sha256(p, progress)} for p in files},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def write_adapters(checkpoint_dir: Path, out_dir: Path, adapters: dict[str, tuple[Path, float | None]]) -> dict:
    """Each fine-tune read (torch's weights-only loader for pickles), checked tensor by tensor against
    the checkpoint's config, and written as adapters/NAME.safetensors, one at a time (a model's
    adapters can outgrow memory together); returns the manifest's "adapters" table. A bad one
    removes adapters/ again, so nothing half-written is left."""
    from fish_sm.model.lora import check_name, read_fine_tune, write_packaged

    if not adapters:
        return {}
    for name in adapters:
        check_name(name)
    config = ModelConfig.from_file(checkpoint_dir / "config.json")
    directory = out_dir / "adapters"
    meta = {}
    try:
        for name, (path, alpha) in sorted(adapters.items()):
            adapter = read_fine_tune(path, name, config, alpha)
            directory.mkdir(exist_ok=True)
            file = directory / f"{name}.safetensors"
            write_packaged(adapter, file)
            meta[name] = {"file": f"adapters/{name}.safetensors", "rank": adapter.rank, "alpha": adapter.alpha,
                          "bytes": file.stat().st_size}
            del adapter
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return meta


def _refuse_link_outside(path: Path, directory: Path, advice: str) -> None:
    """A package holds copies, never what links point at elsewhere: refuse a link that resolves outside `directory`."""
    if path.is_symlink() and not path.resolve().is_relative_to(directory.resolve()):
        raise InputError(f"{path} is a symlink to {path.resolve()}, outside {directory}; {advice}")


__all__ = ["FILES", "build_package_dir", "validate_checkpoint", "checkpoint_files", "sha256", "write_adapters"]

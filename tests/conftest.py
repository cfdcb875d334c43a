"""Shared fixtures: one tiny checkpoint (written in the official formats) per test session.
Tests are marked here too: `integration` for those that use a fixture starting a server on
loopback, `gpu` for those skipped without CUDA (see setup.cfg's markers)."""

import io
import os

import numpy as np
import pytest
import soundfile as sf

# The servers the tests start (they inherit this environment) decode every stream as fast as they
# can and hold 64 requests, as the CPU tests were written for: pacing streams to their listeners
# would make each streamed test request last as long as its audio plays. Pacing and slots by
# memory are tested where they are the subject (tests/engine/test_scheduler.py, test_batching.py).
os.environ.setdefault("FISH_SM_STREAM_HORIZON_S", "0")
os.environ.setdefault("FISH_SM_MAX_BATCH", "64")

# Fixtures that start a server on loopback (a `fish-sm serve`, the model server, moto).
SERVER_FIXTURES = {"server", "one_slot", "silent_server", "tiny_url", "moto_url", "runtime_url", "cores_server"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from fish_sm.model.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def engine(tiny_checkpoint):
    from fish_sm.engine import Engine

    return Engine.from_pretrained(tiny_checkpoint, device="cpu")


def _tone(seconds: float, rate: int, channels: int = 1, freq: float = 220.0, seed: int = 0) -> np.ndarray:
    """A voiced-sounding test signal: a few harmonics plus a little noise, [frames, channels]."""
    t = np.arange(int(seconds * rate)) / rate
    x = sum(np.sin(2 * np.pi * freq * k * t) / k for k in range(1, 6)) * 0.2
    x = x + np.random.default_rng(seed).normal(0, 0.01, t.shape)
    return np.stack([x * (1 - 0.3 * c) for c in range(channels)], axis=1).astype(np.float32)


def _encode_audio(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="session")
def tone():
    return _tone


@pytest.fixture(scope="session")
def encode_audio():
    return _encode_audio


@pytest.fixture(scope="session")
def adapter_package(tiny_checkpoint, tmp_path_factory):
    """A package of the tiny checkpoint with LoRA adapters (issue 37): "yasuo" (rank 8) with a
    packaged voice of its name that implies it, "kiri" (rank 4), and "zz-broken", a file that is
    listed and verified like the others but whose tensors do not fit the model (it fails at
    load: 422). Written as `fish-sm package --adapter` lays a package out (adapters/NAME.safetensors,
    the manifest's "adapters" table, the voice's "adapter", every file in "files")."""
    import hashlib
    import json

    import torch

    from fish_sm.model.config import ModelConfig
    from fish_sm.model.lora import FORMAT, random_adapter, write_packaged
    from fish_sm.model.weights import write_safetensors
    from fish_sm.package.build import build_package_dir

    root = tmp_path_factory.mktemp("adapter-package")
    voice = root / "yasuo.wav"
    voice.write_bytes(_encode_audio(_tone(1.0, 16000, freq=180, seed=3), 16000, "WAV"))
    out = root / "package"
    build_package_dir(tiny_checkpoint, out, voices={"yasuo": (voice, "Yasuo speaking, fine-tuned.")})
    config = ModelConfig.from_file(out / "config.json")
    (out / "adapters").mkdir()
    adapters = {}
    for name, rank, seed in (("yasuo", 8, 1), ("kiri", 4, 2)):
        # Large enough (scale) to move the tiny model's sampled codes.
        adapter = random_adapter(config, name, rank=rank, seed=seed, scale=0.2)
        write_packaged(adapter, out / "adapters" / f"{name}.safetensors")
        adapters[name] = {"rank": rank, "alpha": adapter.alpha}
    write_safetensors({"layers.0.attention.wqkv.lora_A": torch.zeros(8, 3), "layers.0.attention.wqkv.lora_B": torch.zeros(3, 8)},
                      out / "adapters" / "zz-broken.safetensors", metadata={"format": FORMAT, "rank": "8", "alpha": "16.0"})
    adapters["zz-broken"] = {"rank": 8, "alpha": 16.0}
    manifest = json.loads((out / "manifest.json").read_text())
    for name, entry in adapters.items():
        path = out / "adapters" / f"{name}.safetensors"
        entry.update(file=f"adapters/{name}.safetensors", bytes=path.stat().st_size)
        manifest["files"][entry["file"]] = {"size": path.stat().st_size,
                                            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    manifest["adapters"] = adapters
    manifest["voices"]["yasuo"]["adapter"] = "yasuo"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out

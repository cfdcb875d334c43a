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
SERVER_FIXTURES = {"server", "one_slot", "silent_server", "tiny_url", "moto_url", "runtime_url"}


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

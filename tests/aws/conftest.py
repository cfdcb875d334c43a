"""Fixtures shared by the tests that talk to a real `fish-sm serve` of the tiny random checkpoint."""

import subprocess
import sys

import pytest

from fish_sm.clients.local_server import local_server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tone, encode_audio):
    """A package directory, as SageMaker unpacks model.tar.gz: the tiny checkpoint and one voice."""
    from fish_sm.package.build import build_package_dir

    root = tmp_path_factory.mktemp("tiny-serve")
    subprocess.run([sys.executable, "-m", "fish_sm.cli", "make-checkpoint", str(root / "ckpt"), "--preset", "tiny"],
                   check=True, capture_output=True)
    voice = root / "narrator.wav"
    voice.write_bytes(encode_audio(tone(1.0, 16000), 16000, "WAV"))
    build_package_dir(root / "ckpt", root / "package", voices={"narrator": (voice, "The narrator speaking.")})
    return root / "package"


@pytest.fixture(scope="session")
def tiny_url(tiny_model, tmp_path_factory):
    """`fish-sm serve` (the batching server, its default) of the tiny package, for the whole session."""
    with local_server(tiny_model, log_path=tmp_path_factory.mktemp("tiny-url") / "serve.log",
                      startup_timeout_s=120) as url:
        yield url


"""A package directory built from the tiny checkpoint, with one packaged voice."""

import pytest


@pytest.fixture(scope="session")
def voice_audio(tmp_path_factory, tone, encode_audio):
    path = tmp_path_factory.mktemp("voice") / "narrator.wav"
    path.write_bytes(encode_audio(tone(1.5, 22050, freq=150), 22050, "WAV"))
    return path


@pytest.fixture(scope="session")
def package_dir(tiny_checkpoint, tmp_path_factory, voice_audio):
    from fish_sm.package.build import build_package_dir

    out = tmp_path_factory.mktemp("package")
    build_package_dir(tiny_checkpoint, out, voices={"narrator": (voice_audio, "This is the narrator speaking.")})
    return out


@pytest.fixture
def serving_env(monkeypatch, tmp_path):
    """Quick CPU settings for a handler in this process."""
    monkeypatch.setenv("FISH_SM_WARMUP", "1")
    monkeypatch.setenv("FISH_SM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT", "*/*")

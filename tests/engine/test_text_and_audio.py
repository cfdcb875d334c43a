import numpy as np
import pytest

from fish_sm.engine.audio import read_audio, resample
from fish_sm.engine.text import split_text
from fish_sm.errors import InputError


def test_short_text_is_one_chunk():
    assert split_text("  Hello there.  ", 100) == ["Hello there."]


def test_chunks_respect_the_limit_and_keep_every_word():
    text = " ".join(f"Sentence number {i} is here." for i in range(30)) + " 这是第一句。这是第二句！" + " word" * 50
    chunks = split_text(text, 80)
    assert all(0 < len(c) <= 80 for c in chunks)
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")
    assert chunks[0].endswith(".")  # cut at a sentence end


def test_unbreakable_text_is_cut_hard():
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


@pytest.mark.parametrize("orig, new", [(16000, 44100), (48000, 44100), (44100, 22050), (8000, 44100)])
def test_resample_preserves_a_tone(orig, new):
    t = np.arange(orig) / orig
    y = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), orig, new)
    assert len(y) == int(np.ceil(orig * new / orig))
    ref = np.sin(2 * np.pi * 440 * np.arange(len(y)) / new)
    inner = slice(len(y) // 10, -len(y) // 10)
    assert np.abs(y[inner] - ref[inner]).max() < 2e-3


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_read_audio_mixes_channels_to_mono(fmt, tone, encode_audio):
    x = tone(0.5, 48000, channels=2)
    samples, rate = read_audio(encode_audio(x, 48000, fmt))
    assert rate == 48000 and samples.ndim == 1 and len(samples) == len(x)
    tol = 0.05 if fmt == "OGG" else 1e-3
    assert np.abs(samples - x.mean(axis=1)).max() < tol


def test_undecodable_audio_is_an_input_error():
    with pytest.raises(InputError, match="cannot decode"):
        read_audio(b"definitely not audio")
    with pytest.raises(InputError, match="not found"):
        read_audio("/no/such/file.wav")

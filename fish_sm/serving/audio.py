"""Encoding synthesized audio for a response: WAV, FLAC, Ogg Vorbis, MP3, raw PCM, or JSON
around one of them; and the pieces of a streamed response (a WAV header of open length, PCM)."""

from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np
import soundfile as sf

from fish_sm.engine.audio import resample
from fish_sm.serving.errors import HTTPError

_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS"), "mp3": ("MP3", "MPEG_LAYER_III")}


def writable_formats() -> list[str]:
    """The formats this libsndfile can write (MP3 needs libsndfile 1.1 or newer)."""
    have = sf.available_formats()
    return [fmt for fmt, (container, _) in _SOUNDFILE.items() if container in have] + ["pcm"]


def pcm16(audio: np.ndarray) -> bytes:
    """16-bit little-endian PCM, rounded as libsndfile rounds when it writes PCM_16 WAV."""
    return np.rint(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def open_wav_header(sample_rate: int) -> bytes:
    """A mono 16-bit WAV header whose sizes say 'unknown' (0xFFFFFFFF), for a stream whose
    length is not known when it starts; players and libsndfile read such a file to its end."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))


def encode_audio(audio: np.ndarray, sample_rate: int, fmt: str, out_rate: int | None = None) -> tuple[bytes, int]:
    """(file bytes, their sample rate). Silence is written for empty audio so every format stays valid."""
    if fmt not in writable_formats():
        raise HTTPError(406, f"this server's libsndfile cannot write {fmt}; available: {', '.join(writable_formats())}")
    rate = out_rate or sample_rate
    if rate != sample_rate and len(audio):
        audio = resample(np.ascontiguousarray(audio, dtype=np.float32), sample_rate, rate)
    if fmt == "pcm":
        return pcm16(audio), rate
    container, subtype = _SOUNDFILE[fmt]
    buf = io.BytesIO()
    sf.write(buf, np.clip(audio, -1.0, 1.0), rate, format=container, subtype=subtype)
    return buf.getvalue(), rate


def json_document(audio_bytes: bytes, fmt: str, sample_rate: int, result) -> dict:
    """The JSON form of one synthesis: base64 audio plus what a client wants to know about it."""
    return {
        "audio": base64.b64encode(audio_bytes).decode("ascii"),
        "format": fmt,
        "sample_rate": sample_rate,
        "seconds": round(result.seconds, 4),
        "frames": result.frames,
        "rtf": round(result.rtf, 4),
        "timings": {k: round(v, 4) for k, v in result.timings.items()},
    }


def json_bytes(document) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()

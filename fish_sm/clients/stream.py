"""Streamed answers: a WAV header of open length then 16-bit PCM (or bare PCM for audio/pcm),
read piece by piece, noting when the first audio byte came."""

from __future__ import annotations

import struct
import time
from typing import Iterable

from fish_sm.clients.response import Response, pcm_rate

_OPEN_SIZE = 0xFFFFFFFF  # a streamed WAV header's RIFF and data sizes: "until the end"


def pcm_offset(head: bytes, content_type: str) -> int | None:
    """Where the PCM starts: 0 for bare PCM, after the data chunk's header for WAV; None while
    the bytes so far do not reach it."""
    if content_type.startswith("audio/pcm"):
        return 0
    if len(head) < 12:
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return 0  # not WAV after all: every byte is the answer
    pos = 12
    while pos + 8 <= len(head):
        chunk, size = head[pos : pos + 4], struct.unpack_from("<I", head, pos + 4)[0]
        if chunk == b"data":
            return pos + 8
        pos += 8 + size + (size & 1)
    return None


def read_stream(pieces: Iterable[bytes], content_type: str, t0: float) -> tuple[bytes, float | None]:
    """Join a streamed body; also the seconds from t0 to its first audio byte (None: no audio)."""
    body, start, first = bytearray(), None, None
    for piece in pieces:
        body += piece
        if first is None:
            start = pcm_offset(body, content_type) if start is None else start
            if start is not None and len(body) > start:
                first = time.perf_counter() - t0
    return bytes(body), first


def close_wav(body: bytes) -> bytes:
    """A streamed WAV with its open (0xFFFFFFFF) RIFF and data sizes set to what arrived,
    so every reader sees the right length; other bodies are returned as they are."""
    start = pcm_offset(body, "audio/wav")
    if body[:4] != b"RIFF" or not start or start > len(body):
        return body
    out = bytearray(body)
    if struct.unpack_from("<I", out, 4)[0] == _OPEN_SIZE:
        struct.pack_into("<I", out, 4, len(out) - 8)
    if struct.unpack_from("<I", out, start - 4)[0] == _OPEN_SIZE:
        struct.pack_into("<I", out, start - 4, len(out) - start)
    return bytes(out)


def stream_response(pieces: Iterable[bytes], content_type: str, t0: float, sample_rate: int | None) -> Response:
    """The joined stream, with when each piece came (a listener's playback is judged from them)."""
    arrivals: list[tuple[float, int]] = []

    def timed(pieces):
        for piece in pieces:
            arrivals.append((time.perf_counter() - t0, len(piece)))
            yield piece

    body, first = read_stream(timed(pieces), content_type, t0)
    latency = time.perf_counter() - t0
    if not content_type.startswith("audio/pcm"):
        body = close_wav(body)
    return Response(body, content_type, latency, first, sample_rate or pcm_rate(content_type), arrivals)

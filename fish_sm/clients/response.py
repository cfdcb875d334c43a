"""What comes back from a server or endpoint: the audio with its timings, or a ServiceError."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from fish_sm.aws import AWSError


class ServiceError(AWSError):
    """The endpoint or server answered with an error; `kind` groups errors in benchmark reports.

    kind "rejected": the server was full and said so at once (503 with Retry-After).
    """

    def __init__(self, message: str, kind: str, status: int | None = None, retry_after: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.retry_after = kind, status, retry_after


@dataclass
class Response:
    body: bytes
    content_type: str
    latency_s: float
    first_audio_s: float | None = None  # streamed: when the first PCM byte (after any WAV header) came
    sample_rate: int | None = None  # for bare PCM, whose bytes do not say it

    @property
    def audio_seconds(self) -> float | None:
        return audio_seconds(self.body, self.content_type, self.sample_rate)


def audio_seconds(body: bytes, content_type: str, sample_rate: int | None = None) -> float | None:
    """Duration of the returned audio: the JSON's `seconds`, the audio header's frames / rate,
    or for bare 16-bit mono PCM its bytes / (2 x the rate in the media type or `sample_rate`)."""
    if content_type.startswith("application/json"):
        try:
            return float(json.loads(body)["seconds"])
        except (ValueError, KeyError, TypeError):
            return None
    if content_type.startswith("audio/pcm"):
        rate = pcm_rate(content_type) or sample_rate
        return len(body) / (2 * rate) if rate else None
    try:
        import soundfile as sf

        info = sf.info(io.BytesIO(body))
        return info.frames / info.samplerate if info.samplerate else None
    except Exception:  # an encoder soundfile cannot parse (e.g. mp3 on old libsndfile)
        return None


def pcm_rate(content_type: str) -> int | None:
    """The `rate=` parameter of audio/pcm;rate=44100;channels=1;encoding=s16le."""
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "rate" and value.strip().isdigit():
            return int(value)
    return None


def error_text(raw: bytes | str) -> str:
    """The handler's {"error": ...} message, else the body, on one line."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and "error" in doc:
            text = str(doc["error"])
    except ValueError:
        pass
    return " ".join(text.split())[:500] or "(empty body)"

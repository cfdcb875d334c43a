"""What comes back from a server or endpoint: the audio with its timings, or a ServiceError; and
check_audio, the one test of whether an answer is the audio asked for (invoke and bench)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from fish_sm.aws import AWSError
from fish_sm.contract import AUDIO_TYPES


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
    arrivals: list[tuple[float, int]] | None = None  # streamed: (seconds since sent, bytes) of each piece as it came


NOT_AUDIO = "not audio"  # the error kind of an answer that is not audio of the format asked for

# Media types that name the same format as AUDIO_TYPES' (servers differ in what they write).
_MEDIA_FORMATS = {"audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav", "audio/x-flac": "flac",
                  "audio/mp3": "mp3", **{mime: fmt for fmt, mime in AUDIO_TYPES.items()}}
# What soundfile reports for each format; WAVEX is a WAV with an extensible format chunk.
_SOUNDFILE_FORMATS = {"wav": ("WAV", "WAVEX"), "flac": ("FLAC",), "ogg": ("OGG",), "mp3": ("MP3",)}
# S3 gives this to objects stored without a content type: it says nothing about the bytes.
UNSTATED_TYPES = ("", "binary/octet-stream", "application/octet-stream")


def check_audio(response: Response, fmt: str, source: str, *, type_stated: bool = True) -> float | None:
    """The seconds of audio in `response` (None: bare PCM of unknown rate), if it is audio of
    `fmt` (AUDIO_TYPES' keys) with at least one sample; else a ServiceError of kind NOT_AUDIO
    naming what came back.

    The media type must be fmt's, and the body must decode as fmt (soundfile; bare PCM: 16-bit,
    so a non-empty even length). type_stated=False: the media type may be S3's unstated one
    (asynchronous results), and then only the body is checked.
    """
    body, content_type = response.body, response.content_type or ""
    media = content_type.split(";")[0].strip().lower()
    if not (media in UNSTATED_TYPES and not type_stated) and _MEDIA_FORMATS.get(media) != fmt:
        raise _not_audio(response, fmt, source, f"its type is not {AUDIO_TYPES[fmt]}")
    if not body:
        raise _not_audio(response, fmt, source, "it is empty")
    if fmt == "pcm":
        if len(body) % 2:
            raise _not_audio(response, fmt, source, "an odd number of bytes is not 16-bit PCM")
        rate = pcm_rate(content_type) or response.sample_rate
        return len(body) / (2 * rate) if rate else None
    import soundfile as sf

    if fmt == "mp3" and "MP3" not in sf.available_formats():  # libsndfile before 1.1 reads no MP3
        if body[:3] == b"ID3" or (len(body) > 1 and body[0] == 0xFF and body[1] & 0xE0 == 0xE0):
            return None
        raise _not_audio(response, fmt, source, "it starts with neither an ID3 tag nor an MPEG frame")
    try:
        with sf.SoundFile(io.BytesIO(body)) as f:
            kind, rate = f.format, f.samplerate
            frames = len(f.read(dtype="int16"))  # all of it: a header alone is no proof the audio decodes
    except Exception as exc:  # soundfile's errors for bytes that are not audio it knows
        raise _not_audio(response, fmt, source, f"it does not decode ({' '.join(str(exc).split())[:120]})") \
            from None
    if kind not in _SOUNDFILE_FORMATS[fmt]:
        raise _not_audio(response, fmt, source, f"it decodes as {kind.lower()}")
    if frames == 0:
        raise _not_audio(response, fmt, source, "it holds no samples")
    return frames / rate


def _not_audio(response: Response, fmt: str, source: str, why: str) -> ServiceError:
    """One line: what came back (type, size, the server's JSON error or the first bytes) and why it is not audio."""
    body = response.body
    size = f"{len(body)} B" if len(body) < 1024 else f"{len(body) / 1024:.1f} KB"
    shown = _json_error(body)
    shown = f"error {shown!r}" if shown is not None else f"starting {body[:24]!r}" if body else "empty"
    return ServiceError(f"{source} answered {response.content_type or 'no content type'}, {size}, {shown}; "
                        f"not the {fmt} audio asked for: {why}", NOT_AUDIO)


def _json_error(body: bytes) -> str | None:
    """A JSON body's "error" (our servers) or "message" (AWS), else None."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(doc, dict):
        for key in ("error", "message", "Message"):
            if key in doc:
                return " ".join(str(doc[key]).split())[:300]
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

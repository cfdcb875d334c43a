"""The request contract: what a client may ask for, its defaults and its limits, as plain data.

The servers parse requests with it, the engine takes its `SamplingParams`, and the
clients and `aws/` build request bodies and read defaults from it; no torch here. A
problem with a request is a `RequestError` carrying the HTTP status a client can act on
(400, 403 or 413), which the servers answer as they answer every error.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

from fish_sm.errors import InputError
from fish_sm.settings import Settings

AUDIO_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg", "pcm": "audio/pcm"}
STREAM_FORMATS = ("wav", "pcm")  # formats that can be written before their length is known
SAMPLE_RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
DEFAULT_CHUNK_LENGTH = 200  # characters; upstream accepts 100..300
CHUNK_LENGTH_RANGE = (50, 1000)
DEFAULT_MAX_NEW_TOKENS = 1024  # frames per text chunk, unless FISH_SM_MAX_NEW_TOKENS is lower
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest
SAMPLING_FIELDS = ("temperature", "top_p", "repetition_penalty", "max_new_tokens", "seed", "chunk_length")
FIELDS = frozenset({"text", "voice", "adapter", "reference", "format", "sample_rate", "stream", *SAMPLING_FIELDS})
# A LoRA adapter's name: what a request, a package and an S3 key may carry.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ECHO_CHARS = 40  # how much of a rejected value an error message repeats
_S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(.+)$")


class RequestError(InputError):
    """A request that cannot be served as sent, with the HTTP status that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_p: float = 0.8
    repetition_penalty: float = 1.1
    max_new_tokens: int = 1024
    seed: int | None = None

    # Ranges upstream's API accepts.
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {"temperature": (0.1, 1.0), "top_p": (0.1, 1.0), "repetition_penalty": (0.9, 2.0)}

    def __post_init__(self):
        for name, (lo, hi) in self.RANGES.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise InputError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise InputError(f"seed must be an integer in [0, 2^64 - 1], got {str(self.seed)[:40]}")


@dataclass(frozen=True)
class ReferenceAudio:
    """A zero-shot voice: the recording (bytes, or an S3 location to fetch) and its transcript."""

    text: str
    audio: bytes | None = None
    s3_bucket: str | None = None
    s3_key: str | None = None


@dataclass(frozen=True)
class TTSRequest:
    text: str
    voice: str | None = None
    reference: ReferenceAudio | None = None
    format: str | None = None  # wav | flac | ogg | mp3 | pcm, when the client named one
    sample_rate: int | None = None
    chunk_length: int = DEFAULT_CHUNK_LENGTH
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False  # chunked audio as it is made (the batching server)
    adapter: str | None = None  # a LoRA fine-tune's name (a packaged voice may imply one)


def check_text(text: str, chunk_length: int) -> None:
    """What the engine refuses to speak (an `InputError`): no text, or a chunk length that is not a
    positive integer. Here, without torch, so a server's front end refuses it before any engine work."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("text must be a non-empty string")
    if isinstance(chunk_length, bool) or not isinstance(chunk_length, int) or chunk_length < 1:
        raise InputError(f"chunk_length must be a positive integer, got {chunk_length!r}")


def request_body(text: str, *, voice: str | None = None, reference_audio: str | None = None,
                 reference_text: str | None = None, fmt: str | None = None, stream: bool = False,
                 adapter: str | None = None, **sampling) -> dict:
    """The JSON body a client sends: `reference_audio` is base64 or an s3:// URI; sampling
    fields left None are left out, so the server's defaults apply."""
    if not text or not text.strip():
        raise InputError("the text to speak is empty")
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise InputError(f"unknown request field(s): {', '.join(unknown)}")
    if (reference_audio is None) != (reference_text is None):
        raise InputError("a reference needs both its audio and its transcript")
    if voice and reference_audio:
        raise InputError("give either a packaged voice or a reference, not both")
    body: dict = {"text": text}
    if voice:
        body["voice"] = voice
    if adapter:
        body["adapter"] = check_adapter_name(adapter, InputError)
    if reference_audio is not None:
        body["reference"] = {"audio": reference_audio, "text": reference_text}
    if fmt:
        body["format"] = fmt
    if stream:
        body["stream"] = True
    body.update({k: v for k, v in sampling.items() if v is not None})
    return body


def _echo(value) -> str:
    """A rejected value as JSON, cut short: an error message never repeats a whole payload."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def parse_request(data, settings: Settings) -> TTSRequest:
    """A decoded JSON request (a dict) checked field by field against `settings`' limits."""
    if not isinstance(data, dict):
        raise _bad("the request must be a JSON object")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise _bad(f"unknown field(s): {', '.join(unknown)}; accepted: {', '.join(sorted(FIELDS))}")
    text = data.get("text")
    if not isinstance(text, str):
        raise _bad("field 'text' is required and must be a string")
    if not text.strip():
        raise _bad("field 'text' is empty")
    if len(text) > settings.max_text_chars:
        raise RequestError(413, f"text is {len(text)} characters; the limit is {settings.max_text_chars}")
    voice = _optional(data, "voice", str)
    adapter = _optional(data, "adapter", str)
    if adapter is not None:
        check_adapter_name(adapter, _bad)
    reference = _reference(data.get("reference"), settings) if data.get("reference") is not None else None
    if voice is not None and reference is not None:
        raise _bad("give either 'voice' or 'reference', not both")
    fmt = _optional(data, "format", str)
    if fmt is not None:
        fmt = fmt.lower()
        if fmt not in AUDIO_TYPES:
            raise _bad(f"format {fmt!r} is not supported; choose one of {', '.join(AUDIO_TYPES)}")
    sample_rate = _optional(data, "sample_rate", int)
    if sample_rate is not None and sample_rate not in SAMPLE_RATES:
        raise _bad(f"sample_rate {sample_rate} is not supported; choose one of {', '.join(map(str, SAMPLE_RATES))}")
    chunk_length = _optional(data, "chunk_length", int)
    lo, hi = CHUNK_LENGTH_RANGE
    if chunk_length is not None and not lo <= chunk_length <= hi:
        raise _bad(f"chunk_length must be in [{lo}, {hi}], got {chunk_length}")
    max_new_tokens = _optional(data, "max_new_tokens", int)
    if max_new_tokens is not None and not 1 <= max_new_tokens <= settings.max_new_tokens:
        raise _bad(f"max_new_tokens must be in [1, {settings.max_new_tokens}], got {max_new_tokens}")
    sampling = {k: _optional(data, k, float) for k in ("temperature", "top_p", "repetition_penalty")}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    seed = _optional(data, "seed", int)
    stream = _optional(data, "stream", bool) or False
    if stream and fmt is not None and fmt not in STREAM_FORMATS:
        raise _bad(f"format {fmt!r} cannot be streamed; stream wav or pcm")
    if stream and sample_rate is not None:
        raise _bad("sample_rate cannot be combined with stream: streamed audio keeps the model's sample rate")
    try:
        params = SamplingParams(**sampling, max_new_tokens=max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, settings.max_new_tokens), seed=seed)
    except InputError as exc:
        raise _bad(str(exc)) from None
    return TTSRequest(text=text, voice=voice, reference=reference, format=fmt, sample_rate=sample_rate,
                      chunk_length=chunk_length or DEFAULT_CHUNK_LENGTH, sampling=params, stream=stream,
                      adapter=adapter)


def check_adapter_name(name: str, error=InputError) -> str:
    """`name` if it can name an adapter, else `error(message)` raised."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or ".." in name:
        raise error(f"adapter name {_echo(name)}: use 1-64 letters, digits, '.', '_' or '-', "
                    "starting with a letter or digit")
    return name


def _optional(data: dict, name: str, kind: type):
    value = data.get(name)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise _bad(f"field {name!r} must be true or false, got {_echo(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _bad(f"field {name!r} must be {'a number' if kind is float else 'an integer' if kind is int else 'a string'}, got {_echo(value)}")
    return value


def _reference(ref, settings: Settings) -> ReferenceAudio:
    if not isinstance(ref, dict):
        raise _bad("field 'reference' must be an object with 'audio' and 'text'")
    extra = sorted(set(ref) - {"audio", "text"})
    if extra:
        raise _bad(f"unknown field(s) in 'reference': {', '.join(extra)}")
    audio, text = ref.get("audio"), ref.get("text")
    if not isinstance(audio, str) or not audio:
        raise _bad("'reference.audio' must be base64-encoded audio or an s3://bucket/key URI")
    if not isinstance(text, str) or not text.strip():
        raise _bad("'reference.text' must be the transcript of the reference audio")
    if len(text) > settings.max_text_chars:
        raise RequestError(413, f"reference text is {len(text)} characters; the limit is {settings.max_text_chars}")
    if audio.startswith("s3://"):
        m = _S3_URI.match(audio)
        if not m:
            raise _bad(f"'reference.audio' is not a valid S3 URI: {audio[:ECHO_CHARS]!r}")
        bucket, key = m.groups()
        if bucket not in settings.allowed_buckets:  # the allow-list itself is not a client's business
            raise RequestError(403, f"references from bucket {bucket!r} are not allowed on this endpoint")
        if any(part in (".", "..") for part in key.split("/")):
            raise _bad("'reference.audio' S3 key has a '.' or '..' segment")
        return ReferenceAudio(text=text, s3_bucket=bucket, s3_key=key)
    if len(audio) > settings.max_reference_bytes * 4 // 3 + 4:
        raise RequestError(413, f"reference audio is over the {settings.max_reference_bytes} byte limit")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("'reference.audio' is not valid base64") from None
    return ReferenceAudio(text=text, audio=raw)

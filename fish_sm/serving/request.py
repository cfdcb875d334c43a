"""The one definition of a request: parsing and validating what a client sent.

Every field is checked for type and range here, before any GPU work, and every problem
is an `HTTPError` with the status a client can act on. Unknown fields are an error too:
a misspelt `temprature` must not be silently ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass, field

from fish_sm.engine.sampling import SamplingParams
from fish_sm.errors import InputError
from fish_sm.serving.errors import HTTPError, bad_request
from fish_sm.serving.settings import Settings

JSON, JSONLINES, TEXT = "application/json", "application/jsonlines", "text/plain"
JSONLINES_ALIASES = {"application/jsonlines", "application/jsonl", "application/x-jsonlines"}
AUDIO_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg", "pcm": "audio/pcm"}
STREAM_FORMATS = ("wav", "pcm")  # formats that can be written before their length is known
AUDIO_ALIASES = {"audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav", "audio/mp3": "mp3",
                 **{mime: fmt for fmt, mime in AUDIO_TYPES.items()}}
SAMPLE_RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
CHUNK_LENGTH_RANGE = (50, 1000)
_S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(.+)$")
# A request holds short scalars: digits past these can only be an attack on the parser
# (Python refuses to convert integers of over 4,300 digits, and big ones cost quadratic time).
MAX_INT_DIGITS = 20  # 2**64 has 20
MAX_FLOAT_CHARS = 32
ECHO_CHARS = 40  # how much of a rejected value an error message repeats

FIELDS = {"text", "voice", "reference", "format", "sample_rate", "temperature", "top_p", "repetition_penalty",
          "max_new_tokens", "seed", "chunk_length", "stream"}


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
    format: str | None = None  # wav | flac | ogg | mp3, when the client named one
    sample_rate: int | None = None
    chunk_length: int = 200
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False  # chunked audio as it is made (the batching server)


def media_type(header: str | None) -> str:
    """'application/json; charset=utf-8' -> 'application/json'."""
    return (header or "").split(";", 1)[0].strip().lower()


def parse_body(body: bytes | str, content_type: str | None, settings: Settings) -> list[TTSRequest]:
    """Decode a request body into one or more validated requests (several for JSON Lines,
    at most `settings.max_lines`)."""
    kind = media_type(content_type)
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("the request body is not UTF-8 text") from None
    if kind == TEXT:
        return [parse_fields({"text": body}, settings)]
    if kind == JSON or kind.endswith("+json"):
        return [parse_fields(_load_json(body, "the request body"), settings)]
    if kind in JSONLINES_ALIASES:
        lines = [(n, line) for n, line in enumerate(body.splitlines(), 1) if line.strip()]
        if not lines:
            raise bad_request("the JSON Lines body has no requests")
        if len(lines) > settings.max_lines:
            raise HTTPError(413, f"the JSON Lines body has {len(lines)} requests; the limit is {settings.max_lines} "
                                 "(FISH_SM_MAX_LINES): split it")
        out = []
        for n, line in lines:
            try:
                out.append(parse_fields(_load_json(line, f"line {n}"), settings))
            except HTTPError as exc:
                raise HTTPError(exc.status, f"line {n}: {exc.message}") from None
            if out[-1].stream:
                raise bad_request(f"line {n}: a JSON Lines request cannot stream; send one JSON request with \"stream\": true")
        return out
    supported = ", ".join([JSON, TEXT, JSONLINES])
    raise HTTPError(415, f"content type {content_type or '(none)'!r} is not supported; send one of {supported}")


class _NumberTooLarge(ValueError):
    pass


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _NumberTooLarge(f"an integer of {len(digits.lstrip('-'))} digits")
    return int(digits)


def _float(text: str) -> float:
    value = float(text)
    if len(text) > MAX_FLOAT_CHARS or not math.isfinite(value):
        raise _NumberTooLarge(f"the number {text[:ECHO_CHARS]!r}")
    return value


def _constant(name: str):
    raise _NumberTooLarge(f"{name}, which JSON does not allow")


def _load_json(text: str, what: str):
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except _NumberTooLarge as exc:
        raise bad_request(f"{what} holds {exc}; numbers in a request have at most {MAX_INT_DIGITS} digits") from None
    except RecursionError:
        raise bad_request(f"{what} is nested too deeply to be a request") from None


def _echo(value) -> str:
    """A rejected value as JSON, cut short: an error message never repeats a whole payload."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def parse_fields(data, settings: Settings) -> TTSRequest:
    if not isinstance(data, dict):
        raise bad_request("the request must be a JSON object")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}; accepted: {', '.join(sorted(FIELDS))}")
    text = data.get("text")
    if not isinstance(text, str):
        raise bad_request("field 'text' is required and must be a string")
    if not text.strip():
        raise bad_request("field 'text' is empty")
    if len(text) > settings.max_text_chars:
        raise HTTPError(413, f"text is {len(text)} characters; the limit is {settings.max_text_chars}")
    voice = _optional(data, "voice", str)
    reference = _reference(data.get("reference"), settings) if data.get("reference") is not None else None
    if voice is not None and reference is not None:
        raise bad_request("give either 'voice' or 'reference', not both")
    fmt = _optional(data, "format", str)
    if fmt is not None:
        fmt = fmt.lower()
        if fmt not in AUDIO_TYPES:
            raise bad_request(f"format {fmt!r} is not supported; choose one of {', '.join(AUDIO_TYPES)}")
    sample_rate = _optional(data, "sample_rate", int)
    if sample_rate is not None and sample_rate not in SAMPLE_RATES:
        raise bad_request(f"sample_rate {sample_rate} is not supported; choose one of {', '.join(map(str, SAMPLE_RATES))}")
    chunk_length = _optional(data, "chunk_length", int)
    lo, hi = CHUNK_LENGTH_RANGE
    if chunk_length is not None and not lo <= chunk_length <= hi:
        raise bad_request(f"chunk_length must be in [{lo}, {hi}], got {chunk_length}")
    max_new_tokens = _optional(data, "max_new_tokens", int)
    if max_new_tokens is not None and not 1 <= max_new_tokens <= settings.max_new_tokens:
        raise bad_request(f"max_new_tokens must be in [1, {settings.max_new_tokens}], got {max_new_tokens}")
    sampling = {k: _optional(data, k, float) for k in ("temperature", "top_p", "repetition_penalty")}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    seed = _optional(data, "seed", int)
    stream = _optional(data, "stream", bool) or False
    if stream and fmt is not None and fmt not in STREAM_FORMATS:
        raise bad_request(f"format {fmt!r} cannot be streamed; stream wav or pcm")
    if stream and sample_rate is not None:
        raise bad_request("sample_rate cannot be combined with stream: streamed audio keeps the model's sample rate")
    try:
        params = SamplingParams(**sampling, max_new_tokens=max_new_tokens or min(1024, settings.max_new_tokens), seed=seed)
    except InputError as exc:
        raise bad_request(str(exc)) from None
    return TTSRequest(text=text, voice=voice, reference=reference, format=fmt, sample_rate=sample_rate,
                      chunk_length=chunk_length or 200, sampling=params, stream=stream)


def _optional(data: dict, name: str, kind: type):
    value = data.get(name)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise bad_request(f"field {name!r} must be true or false, got {_echo(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, kind):
        raise bad_request(f"field {name!r} must be {'a number' if kind is float else 'an integer' if kind is int else 'a string'}, got {_echo(value)}")
    return value


def _reference(ref, settings: Settings) -> ReferenceAudio:
    if not isinstance(ref, dict):
        raise bad_request("field 'reference' must be an object with 'audio' and 'text'")
    extra = sorted(set(ref) - {"audio", "text"})
    if extra:
        raise bad_request(f"unknown field(s) in 'reference': {', '.join(extra)}")
    audio, text = ref.get("audio"), ref.get("text")
    if not isinstance(audio, str) or not audio:
        raise bad_request("'reference.audio' must be base64-encoded audio or an s3://bucket/key URI")
    if not isinstance(text, str) or not text.strip():
        raise bad_request("'reference.text' must be the transcript of the reference audio")
    if len(text) > settings.max_text_chars:
        raise HTTPError(413, f"reference text is {len(text)} characters; the limit is {settings.max_text_chars}")
    if audio.startswith("s3://"):
        m = _S3_URI.match(audio)
        if not m:
            raise bad_request(f"'reference.audio' is not a valid S3 URI: {audio[:ECHO_CHARS]!r}")
        bucket, key = m.groups()
        if bucket not in settings.allowed_buckets:  # the allow-list itself is not a client's business
            raise HTTPError(403, f"references from bucket {bucket!r} are not allowed on this endpoint")
        if any(part in (".", "..") for part in key.split("/")):
            raise bad_request("'reference.audio' S3 key has a '.' or '..' segment")
        return ReferenceAudio(text=text, s3_bucket=bucket, s3_key=key)
    if len(audio) > settings.max_reference_bytes * 4 // 3 + 4:
        raise HTTPError(413, f"reference audio is over the {settings.max_reference_bytes} byte limit")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("'reference.audio' is not valid base64") from None
    return ReferenceAudio(text=text, audio=raw)


def accepted_types(accept: str | None) -> list[str]:
    """The media types of an Accept header, most preferred first (by q-value, then order);
    those with q=0 are refused by the client, so they are left out. No header is `*/*`."""
    ranked = []
    for order, item in enumerate((accept or "*/*").split(",")):
        kind, *params = item.split(";")
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = -1.0
                if not 0.0 <= q <= 1.0:
                    raise bad_request(f"Accept: q-value {value.strip()[:ECHO_CHARS]!r} is not a number in [0, 1]")
        if q > 0:
            ranked.append((-q, order, kind.strip().lower()))
    return [kind for _, _, kind in sorted(ranked)]


def response_format(accept: str | None, request: TTSRequest | None = None) -> tuple[str, str]:
    """(response media type, audio format) for an Accept header and a request's `format`.

    The most preferred type we can write wins; `*/*` or `audio/*` means the request's `format`,
    else WAV. An audio type that contradicts the request's `format` is passed over, and is an
    error only if nothing else in the header is acceptable.
    """
    wanted = request.format if request else None
    conflict = None
    for mt in accepted_types(accept):
        if mt in ("", "*/*", "audio/*"):
            fmt = wanted or "wav"
            return AUDIO_TYPES[fmt], fmt
        if mt == JSON:
            return JSON, wanted or "wav"
        if mt in JSONLINES_ALIASES:
            return JSONLINES, wanted or "wav"
        if mt in AUDIO_ALIASES:
            fmt = AUDIO_ALIASES[mt]
            if wanted and wanted != fmt:
                conflict = conflict or mt
                continue
            return AUDIO_TYPES[fmt], fmt
    if conflict:
        raise bad_request(f"field 'format' is {wanted!r} but the Accept header asks for {conflict}")
    accepted = ", ".join([*AUDIO_TYPES.values(), JSON, JSONLINES])
    raise HTTPError(406, f"cannot answer with {accept[:200]!r}; accepted: {accepted}")


def check_accept(accept: str | None, jsonlines: bool = False) -> None:
    """Reject an Accept header no response could satisfy, before any work is done."""
    response_format(accept)
    if jsonlines and not any(t in (JSON, "*/*", "audio/*") or t in JSONLINES_ALIASES for t in accepted_types(accept)):
        raise HTTPError(406, f"a JSON Lines request is answered in {JSONLINES}, not {accept[:200]}")

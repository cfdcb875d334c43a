"""A request as it arrives over HTTP: its body decoded by content type (JSON, JSON Lines,
plain text) within limits on nesting and number sizes, its fields checked by the contract
(`fish_sm.contract.parse_request`), and the response's type negotiated from `Accept`.

Every problem is an `HTTPError` with the status a client can act on, before any GPU work.
"""

from __future__ import annotations

import json
import math

from fish_sm.contract import AUDIO_TYPES, ECHO_CHARS, RequestError, TTSRequest, parse_request
from fish_sm.serving.errors import HTTPError, bad_request
from fish_sm.settings import Settings

JSON, JSONLINES, TEXT = "application/json", "application/jsonlines", "text/plain"
JSONLINES_ALIASES = {"application/jsonlines", "application/jsonl", "application/x-jsonlines"}
AUDIO_ALIASES = {"audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav", "audio/mp3": "mp3",
                 **{mime: fmt for fmt, mime in AUDIO_TYPES.items()}}
# A request holds short scalars: digits past these can only be an attack on the parser
# (Python refuses to convert integers of over 4,300 digits, and big ones cost quadratic time).
MAX_INT_DIGITS = 20  # 2**64 has 20
MAX_FLOAT_CHARS = 32


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
        return [_checked({"text": body}, settings)]
    if kind == JSON or kind.endswith("+json"):
        return [_checked(load_json(body, "the request body"), settings)]
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
                out.append(_checked(load_json(line, f"line {n}"), settings))
            except HTTPError as exc:
                raise HTTPError(exc.status, f"line {n}: {exc.message}") from None
            if out[-1].stream:
                raise bad_request(f"line {n}: a JSON Lines request cannot stream; send one JSON request with \"stream\": true")
        return out
    supported = ", ".join([JSON, TEXT, JSONLINES])
    raise HTTPError(415, f"content type {content_type or '(none)'!r} is not supported; send one of {supported}")


def _checked(data, settings: Settings) -> TTSRequest:
    try:
        return parse_request(data, settings)
    except RequestError as exc:
        raise HTTPError(exc.status, exc.message) from None


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


def load_json(text: str, what: str):
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except _NumberTooLarge as exc:
        raise bad_request(f"{what} holds {exc}; numbers in a request have at most {MAX_INT_DIGITS} digits") from None
    except RecursionError:
        raise bad_request(f"{what} is nested too deeply to be a request") from None


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

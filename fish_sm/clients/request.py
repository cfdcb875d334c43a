"""One request, checked before anything is sent: its audio format, whether it can stream, its body."""

from __future__ import annotations

import base64
from pathlib import Path

from fish_sm.aws.s3 import parse_s3_uri
from fish_sm.contract import AUDIO_TYPES, STREAM_FORMATS, request_body
from fish_sm.errors import InputError

_SUFFIX_FORMATS = {**{f: f for f in AUDIO_TYPES}, "raw": "pcm"}


def format_for(output: Path | None, fmt: str | None) -> str:
    """--format, else the output file's extension (.raw is PCM), else (no output named) wav.

    An extension that names no audio format is refused unless --format says what to write, and
    one that names another format than --format is refused: the file would lie about its bytes."""
    if fmt is not None and fmt not in AUDIO_TYPES:
        raise InputError(f"--format must be one of {', '.join(AUDIO_TYPES)}, got {fmt!r}")
    suffix = Path(output).suffix.lower().lstrip(".") if output else ""
    named = _SUFFIX_FORMATS.get(suffix)
    if fmt:
        if named and named != fmt:
            raise InputError(f"-o {output} names {named} audio but --format is {fmt}: make them agree")
        return fmt
    if named:
        return named
    if output is None:
        return "wav"
    extensions = ", ".join(f".{s}" for s in _SUFFIX_FORMATS)
    raise InputError(f"-o {output}: {f'.{suffix}' if suffix else 'a name without an extension'} names no audio "
                     f"format; use {extensions}, or give --format {'|'.join(AUDIO_TYPES)}")


def check_stream(fmt: str, *, is_async: bool = False, sample_rate: int | None = None) -> None:
    """Refuse, before sending anything, what the server could not stream."""
    if is_async:
        raise InputError("--stream cannot be combined with --async: asynchronous results arrive whole in S3")
    if fmt not in STREAM_FORMATS:
        raise InputError(f"--stream sends {' or '.join(STREAM_FORMATS)}: {fmt} cannot be written before the "
                         "audio's length is known (use a .wav or .pcm output, or --format wav|pcm)")
    if sample_rate is not None:
        raise InputError("--sample-rate cannot be combined with --stream: streamed audio keeps the model's rate")


def reference_audio(reference: str) -> str:
    """--reference as a request carries it: an s3:// URI as is, a local file inline as base64."""
    if reference.startswith("s3://"):
        return str(parse_s3_uri(reference, what="--reference", prefix=False))
    path = Path(reference).expanduser()
    if not path.is_file():
        raise InputError(f"reference audio not found: {path}")
    return base64.b64encode(path.read_bytes()).decode("ascii")


def build_request(text: str, *, voice: str | None = None, reference: str | None = None,
                  reference_text: str | None = None, fmt: str | None = None, stream: bool = False,
                  sample_rate: int | None = None, adapter: str | None = None, **sampling) -> dict:
    """The JSON request body, by fish_sm.contract.request_body; the reference options are checked
    here first, in the words of the CLI's options, before the reference file is read."""
    if not text or not text.strip():
        return request_body(text)  # refuses it: an empty text is reported before anything else
    if (reference is None) != (reference_text is None):
        raise InputError("--reference and --reference-text go together")
    if voice and reference:
        raise InputError("give either --voice (a packaged voice) or --reference, not both")
    audio = reference_audio(reference) if reference is not None else None
    body = request_body(text, voice=voice, reference_audio=audio, reference_text=reference_text, fmt=fmt,
                        stream=stream, adapter=adapter, **sampling)
    if sample_rate is not None:  # a field of the request, not a parameter of request_body
        body["sample_rate"] = sample_rate
    return body

"""Send one synthesis request: to a SageMaker endpoint (real-time or async) or a `fish-sm serve` URL.

The same request body goes everywhere (the server's JSON contract), so `invoke --url` against
a local server exercises exactly what the endpoint will receive. Plain HTTP uses urllib: no
requests dependency for one POST.

A request with `"stream": true` is answered by the batching server as it is generated: a
WAV header of open length then 16-bit PCM (or bare PCM for audio/pcm), chunked over HTTP,
or as PayloadPart events through SageMaker's InvokeEndpointWithResponseStream. Both are
read piece by piece, noting when the first audio byte came.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import struct
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from fish_sm.aws import AWSError
from fish_sm.aws.deploy import endpoint_config, require_endpoint
from fish_sm.aws.s3 import S3Uri, get_bytes, head_object, parse_s3_uri, put_bytes
from fish_sm.aws.session import AWS, error_code, error_message
from fish_sm.errors import InputError

ACCEPT = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg", "pcm": "audio/pcm"}
FORMATS = tuple(ACCEPT)
STREAM_FORMATS = ("wav", "pcm")  # the only ones a server can write before it knows the length
_SUFFIX_FORMATS = {**{f: f for f in ACCEPT}, "raw": "pcm"}
_OPEN_SIZE = 0xFFFFFFFF  # a streamed WAV header's RIFF and data sizes: "until the end"
_READ_BYTES = 64 * 1024
_SAMPLING = ("sample_rate", "temperature", "top_p", "repetition_penalty", "max_new_tokens", "seed", "chunk_length")


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


def format_for(output: Path | None, fmt: str | None) -> str:
    """--format, else the output file's extension (.raw is PCM), else wav."""
    if fmt:
        if fmt not in ACCEPT:
            raise InputError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        return fmt
    suffix = Path(output).suffix.lower().lstrip(".") if output else ""
    return _SUFFIX_FORMATS.get(suffix, "wav")


def check_stream(fmt: str, *, is_async: bool = False, sample_rate: int | None = None) -> None:
    """Refuse, before sending anything, what the server could not stream."""
    if is_async:
        raise InputError("--stream cannot be combined with --async: asynchronous results arrive whole in S3")
    if fmt not in STREAM_FORMATS:
        raise InputError(f"--stream sends {' or '.join(STREAM_FORMATS)}: {fmt} cannot be written before the "
                         "audio's length is known (use a .wav or .pcm output, or --format wav|pcm)")
    if sample_rate is not None:
        raise InputError("--sample-rate cannot be combined with --stream: streamed audio keeps the model's rate")


def build_request(text: str, *, voice: str | None = None, reference: str | None = None,
                  reference_text: str | None = None, fmt: str | None = None, stream: bool = False,
                  **sampling) -> dict:
    """The JSON request body; a local reference file is sent inline as base64, s3:// as is."""
    if not text or not text.strip():
        raise InputError("the text to speak is empty")
    body: dict = {"text": text}
    if voice:
        body["voice"] = voice
    if (reference is None) != (reference_text is None):
        raise InputError("--reference and --reference-text go together")
    if voice and reference:
        raise InputError("give either --voice (a packaged voice) or --reference, not both")
    if reference is not None:
        if reference.startswith("s3://"):
            audio = str(parse_s3_uri(reference, what="--reference", prefix=False))
        else:
            path = Path(reference).expanduser()
            if not path.is_file():
                raise InputError(f"reference audio not found: {path}")
            audio = base64.b64encode(path.read_bytes()).decode("ascii")
        body["reference"] = {"audio": audio, "text": reference_text}
    if fmt:
        body["format"] = fmt
    if stream:
        body["stream"] = True
    for key in _SAMPLING:
        if sampling.get(key) is not None:
            body[key] = sampling[key]
    unknown = set(sampling) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"unknown request fields: {sorted(unknown)}")
    return body


def _error_text(raw: bytes | str) -> str:
    """The handler's {"error": ...} message, else the body, on one line."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and "error" in doc:
            text = str(doc["error"])
    except ValueError:
        pass
    return " ".join(text.split())[:500] or "(empty body)"


# --- streamed bodies -----------------------------------------------------------------------

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


def _stream_response(pieces: Iterable[bytes], content_type: str, t0: float, sample_rate: int | None) -> Response:
    body, first = read_stream(pieces, content_type, t0)
    latency = time.perf_counter() - t0
    if not content_type.startswith("audio/pcm"):
        body = close_wav(body)
    return Response(body, content_type, latency, first, sample_rate or pcm_rate(content_type))


# --- SageMaker endpoints ------------------------------------------------------------------

class EndpointTarget:
    """Real-time invoke_endpoint on one endpoint; safe to share across threads."""

    def __init__(self, aws: AWS, name: str, *, check: bool = True):
        self.aws, self.name = aws, name
        if check:
            ep = require_endpoint(aws, name)
            if ep["EndpointStatus"] not in ("InService", "Updating", "SystemUpdating"):
                reason = ep.get("FailureReason")
                raise AWSError(f"endpoint {name} is {ep['EndpointStatus']}" + (f": {reason}" if reason else ""))

    def __str__(self) -> str:
        return f"endpoint {self.name}"

    def send(self, request: dict, accept: str = "audio/wav") -> Response:
        """invoke_endpoint; invoke_endpoint_with_response_stream when the request says "stream"."""
        data = json.dumps(request).encode()
        t0 = time.perf_counter()
        try:
            if request.get("stream"):
                r = self.aws.runtime.invoke_endpoint_with_response_stream(
                    EndpointName=self.name, Body=data, ContentType="application/json", Accept=accept)
                parts = (event["PayloadPart"].get("Bytes", b"") for event in r["Body"] if "PayloadPart" in event)
                return _stream_response(parts, r.get("ContentType", accept), t0, request.get("sample_rate"))
            r = self.aws.runtime.invoke_endpoint(EndpointName=self.name, Body=data,
                                                 ContentType="application/json", Accept=accept)
            body = r["Body"].read()
        except Exception as exc:
            raise _runtime_error(exc, self.name) from None
        return Response(body, r.get("ContentType", accept), time.perf_counter() - t0,
                        sample_rate=request.get("sample_rate"))


def _runtime_error(exc: Exception, name: str) -> Exception:
    """Map botocore errors from sagemaker-runtime to ServiceError with a kind for statistics.

    A stream that fails after it began raises ModelStreamError or InternalStreamFailure while
    its events are read; those become ServiceErrors of that kind like any other code.
    """
    code = error_code(exc)
    if code == "ModelError":
        status = exc.response.get("OriginalStatusCode")
        original = exc.response.get("OriginalMessage") or error_message(exc)
        text = _error_text(original)
        # SageMaker relays the status and body, not the headers: the server's 503 says "retry after".
        kind = "rejected" if status == 503 and "retry after" in text.lower() else f"HTTP {status}"
        return ServiceError(f"endpoint {name} answered {status}: {text}", kind, status)
    if code:
        return ServiceError(f"endpoint {name}: {code}: {error_message(exc)}", code)
    name_ = type(exc).__name__
    if "Timeout" in name_:
        return ServiceError(f"endpoint {name}: no answer in time ({exc})", "timeout")
    if "Connect" in name_:
        return ServiceError(f"endpoint {name}: cannot connect ({exc})", "connection")
    return exc


def invoke_async(aws: AWS, name: str, request: dict, accept: str = "audio/wav", *,
                 input_location: S3Uri | None = None, timeout_s: float = 900, poll_s: float = 5.0,
                 log=lambda s: None) -> Response:
    """Upload the request, invoke_endpoint_async, and wait for the output or failure object."""
    ep = require_endpoint(aws, name)
    async_config = endpoint_config(aws, ep).get("AsyncInferenceConfig")
    if not async_config:
        raise AWSError(f"endpoint {name} is real-time; leave out --async")
    if input_location is None:  # next to the outputs: the endpoint's role can already read that bucket
        output = parse_s3_uri(async_config["OutputConfig"]["S3OutputPath"], prefix=True)
        input_location = S3Uri(output.bucket, "fish-sm/async-inputs/")
    source = input_location.join(f"{uuid.uuid4().hex}.json")
    put_bytes(aws, source, json.dumps(request).encode(), "application/json")
    t0 = time.perf_counter()
    try:
        r = aws.runtime.invoke_endpoint_async(EndpointName=name, InputLocation=str(source),
                                              ContentType="application/json", Accept=accept)
    except Exception as exc:
        raise _runtime_error(exc, name) from None
    output = parse_s3_uri(r["OutputLocation"], what="OutputLocation", prefix=False)
    failure = parse_s3_uri(r["FailureLocation"], what="FailureLocation", prefix=False) if r.get("FailureLocation") else None
    log(f"queued {r.get('InferenceId', '')}: request {source}, result {output}")
    while True:
        head = head_object(aws, output)
        if head is not None:
            return Response(get_bytes(aws, output), head.get("ContentType") or accept, time.perf_counter() - t0)
        if failure is not None and head_object(aws, failure) is not None:
            raise ServiceError(f"endpoint {name} failed the request: {_error_text(get_bytes(aws, failure))}",
                               "async failure")
        if time.perf_counter() - t0 > timeout_s:
            raise AWSError(f"no result after {int(timeout_s)} s; it will appear at {output}")
        time.sleep(poll_s)


# --- plain HTTP to `fish-sm serve` --------------------------------------------------------

def base_url(url: str) -> str:
    """http://host:port from a URL that may end in / or /invocations."""
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/invocations")] if url.endswith("/invocations") else url


def ping(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(base_url(url) + "/ping", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


class UrlTarget:
    """POST /invocations on a server speaking the SageMaker container contract."""

    def __init__(self, url: str, timeout_s: float = 900):
        self.url, self.timeout_s = base_url(url), timeout_s

    def __str__(self) -> str:
        return self.url

    def send(self, request: dict, accept: str = "audio/wav") -> Response:
        """POST the request; a streamed answer is read chunk by chunk as the server sends it."""
        req = urllib.request.Request(self.url + "/invocations", data=json.dumps(request).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": accept})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                content_type = r.headers.get("Content-Type", accept)
                rate = r.headers.get("X-Sample-Rate")
                rate = int(rate) if rate and rate.isdigit() else request.get("sample_rate")
                if request.get("stream"):
                    # read1: whatever the current chunk holds, without waiting to fill the buffer
                    return _stream_response(iter(lambda: r.read1(_READ_BYTES), b""), content_type, t0, rate)
                body = r.read()
        except urllib.error.HTTPError as exc:
            message = f"{self.url} answered {exc.code}: {_error_text(exc.read())}"
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            if exc.code == 503 and retry_after:  # full: a refusal to count, not a failure
                raise ServiceError(message, "rejected", exc.code, retry_after) from None
            raise ServiceError(message, f"HTTP {exc.code}", exc.code) from None
        except (TimeoutError, socket.timeout):
            raise ServiceError(f"{self.url}: no answer within {self.timeout_s:g} s", "timeout") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise ServiceError(f"{self.url}: no answer within {self.timeout_s:g} s", "timeout") from None
            raise ServiceError(f"cannot reach {self.url}: {exc.reason}", "connection") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise ServiceError(f"{self.url}: connection broken ({type(exc).__name__}: {exc})", "connection") from None
        return Response(body, content_type, time.perf_counter() - t0, sample_rate=rate)


"""The client side of a bidirectional session (`fish_sm/serving/bidi.py` has the protocol): text
sent piece by piece as an LLM would write it, audio received while it is still being written,
each sentence timed from the moment the piece that ended it went out to its first audio.

Two transports carry the same messages: a WebSocket straight to a server (`--url`, aiohttp),
and SageMaker's `InvokeEndpointWithBidirectionalStream` for an endpoint, through AWS's
`aws-sdk-sagemaker-runtime-http2` client (HTTP/2 event streams, which botocore does not
speak; that client needs Python 3.12 or newer). Each request part is one whole message, UTF8,
COMPLETE; response parts are joined by their completion state; the session's start is retried on
throttling and transient faults; credentials come from the same session as every AWS command.
No torch here.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable

import numpy as np

from fish_sm.errors import FishSMError

WS_PATH = "/invocations-bidirectional-stream"
SDK_PACKAGE = "aws-sdk-sagemaker-runtime-http2"
# The HTTP/2 runtime endpoint of bidirectional streaming (AWS's sample uses port 8443).
RUNTIME_HTTP2_URL = "https://runtime.sagemaker.{region}.amazonaws.com:8443"


class BidiError(FishSMError):
    """The server refused or ended the session with an error message."""


@dataclass
class Sentence:
    index: int
    text: str
    part: int  # the text piece (1-based) that completed it
    sent_at: float | None = None  # when that piece went out
    first_audio_at: float | None = None
    spoken_at: float | None = None
    samples: int = 0

    @property
    def first_audio_s(self) -> float | None:
        """From the piece that completed it leaving the client to its first audio arriving."""
        if self.first_audio_at is None or self.sent_at is None:
            return None
        return max(0.0, self.first_audio_at - self.sent_at)


@dataclass
class SessionResult:
    sample_rate: int = 0
    format: str = "pcm"
    sentences: list[Sentence] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)  # 16-bit PCM, without any WAV header
    done: dict | None = None
    cancelled: bool = False
    errors: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    cleared: dict | None = None  # the server's {"cleared": ...} after a barge-in (`clear_after_s`)
    clear_s: float | None = None  # from sending {"clear": true} to the server's "cleared"

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / 2 / self.sample_rate if self.sample_rate else 0.0

    def gaps_s(self) -> list[float]:
        """For each sentence after the first: from the previous one's end (its "spoken" arriving,
        or this one's text leaving the client, whichever is later) to its first audio."""
        out = []
        for before, s in zip(self.sentences, self.sentences[1:]):
            if s.first_audio_at is not None and before.spoken_at is not None:
                start = max(before.spoken_at, s.sent_at or 0.0)
                out.append(max(0.0, s.first_audio_at - start))
        return out


def session_settings(*, voice=None, reference_audio=None, reference_text=None, fmt="pcm", **sampling) -> dict:
    """The first message: the session's voice and sampling settings (fields left None are left out)."""
    doc: dict = {"format": fmt}
    if voice:
        doc["voice"] = voice
    if reference_audio is not None:
        doc["reference"] = {"audio": reference_audio, "text": reference_text}
    doc.update({k: v for k, v in sampling.items() if v is not None})
    return doc


def file_pieces(path: str | Path, piece_chars: int = 0) -> Iterable[str]:
    """A file's text (or stdin's, for "-") as pieces: of `piece_chars` characters each (an LLM's
    stand-in), else as it is read (a pipe's lines as they come)."""
    stream = sys.stdin if str(path) == "-" else open(path, encoding="utf-8")
    try:
        if piece_chars > 0:
            while piece := stream.read(piece_chars):
                yield piece
        else:
            while piece := stream.readline():
                yield piece
    finally:
        if stream is not sys.stdin:
            stream.close()


def split_pieces(text: str, piece_chars: int) -> list[str]:
    return [text[i : i + piece_chars] for i in range(0, len(text), piece_chars)] if piece_chars > 0 else [text]


# -- transports ------------------------------------------------------------------------


class WebSocketChannel:
    """A session's messages over a WebSocket to a server (`fish-sm serve`)."""

    def __init__(self, url: str, timeout_s: float = 900):
        self.url = url.rstrip("/") + WS_PATH if not url.rstrip("/").endswith(WS_PATH) else url
        self.url = self.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        self.timeout_s = timeout_s

    async def __aenter__(self):
        import aiohttp

        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            self._ws = await self._http.ws_connect(self.url, max_msg_size=0, heartbeat=None)
        except (aiohttp.ClientError, OSError) as exc:
            await self._http.close()
            raise FishSMError(f"cannot open a session at {self.url}: {exc}") from None
        return self

    async def __aexit__(self, *exc):
        await self._ws.close()
        await self._http.close()

    async def send(self, text: str, last: bool = False) -> None:
        await self._ws.send_str(text)

    async def receive(self):
        """("text", str) | ("binary", bytes) | None once the server closed."""
        import aiohttp

        msg = await self._ws.receive()
        if msg.type == aiohttp.WSMsgType.TEXT:
            return "text", msg.data
        if msg.type == aiohttp.WSMsgType.BINARY:
            return "binary", msg.data
        return None

    async def close(self) -> None:
        await self._ws.close()


def endpoint_sdk():
    """AWS's HTTP/2 client module, or a one-line FishSMError saying what is missing."""
    try:
        from aws_sdk_sagemaker_runtime_http2 import client, config, models  # noqa: F401
    except ImportError:
        need = "" if sys.version_info >= (3, 12) else \
            f" (it needs Python 3.12 or newer; this is {sys.version_info.major}.{sys.version_info.minor})"
        raise FishSMError(f"invoke --bidi against an endpoint needs AWS's {SDK_PACKAGE} client{need}: "
                          f"pip install {SDK_PACKAGE}; or call a server with --url") from None
    return client, config, models


def endpoint_parts(messages: Iterable[str]) -> list[dict]:
    """The request parts a session's messages become on the endpoint: one whole message each, as
    UTF8, each COMPLETE (the service joins PARTIAL parts with what follows into one message)."""
    return [{"Bytes": m.encode("utf-8"), "DataType": "UTF8", "CompletionState": "COMPLETE"} for m in messages]


class PartAssembler:
    """Response parts into whole messages: PARTIAL parts are held until the part that completes
    them (COMPLETE, or no completion state), as the service may split a message."""

    def __init__(self):
        self._parts: list[bytes] = []
        self._type: str | None = None

    def add(self, data_type: str | None, data: bytes, completion: str | None) -> tuple[str, object] | None:
        """One part; the whole message it completes as ("text", str) or ("binary", bytes), else None."""
        if self._parts and data_type != self._type:
            raise BidiError(f"the endpoint split a message across {self._type} and {data_type} parts")
        self._type = data_type
        self._parts.append(data or b"")
        if completion == "PARTIAL":
            return None
        whole, self._parts = b"".join(self._parts), []
        if data_type == "UTF8":
            return "text", whole.decode("utf-8")
        return "binary", whole


# Errors at a session's start worth another try (after a backoff): the service's throttling and
# its transient faults; anything else (a bad endpoint name, the model's own error) is final.
RETRYABLE = frozenset({"ThrottlingException", "ServiceUnavailable", "ServiceUnavailableException",
                       "InternalFailure", "InternalServerError", "InternalDependencyException",
                       "ModelNotReadyException"})
START_ATTEMPTS = 4


def error_line(error) -> str:
    """A service error (an exception or an error event) as one line: its kind, code and message."""
    kind = type(error).__name__
    code = getattr(error, "error_code", None) or getattr(error, "code", None)
    message = getattr(error, "message", None) or str(error) or kind
    text = " ".join(str(message).split())
    return f"{kind}{f' ({code})' if code else ''}: {text}"


def retryable(error: BaseException) -> bool:
    status = getattr(error, "status", None) or getattr(error, "status_code", None)
    return type(error).__name__ in RETRYABLE or (isinstance(status, int) and (status == 429 or status >= 500))


async def with_retries(start: Callable, attempts: int = START_ATTEMPTS, base_s: float = 0.25,
                       sleep: Callable = asyncio.sleep):
    """`await start()`, tried again after 0.25, 0.5, 1 s (with jitter) on a retryable error;
    a final error as a one-line BidiError."""
    for attempt in range(attempts):
        try:
            return await start()
        except Exception as exc:  # the SDK's own exception classes: classified by name and status
            if attempt + 1 == attempts or not retryable(exc):
                more = f" (after {attempt + 1} tries)" if attempt else ""
                raise BidiError(f"the endpoint refused the session{more}: {error_line(exc)}") from None
            await sleep(base_s * 2**attempt * (1 + random.random() / 2))


class SessionCredentials:
    """The SDK's credentials from a boto3 session (so --profile, SSO, roles and the rest work as
    in every other command), read afresh at each signing: refreshed credentials are picked up."""

    def __init__(self, session, identity_type):
        self.session, self.identity_type = session, identity_type

    async def get_identity(self, *, identity_properties=None, **_):
        credentials = self.session.get_credentials()
        if credentials is None:
            raise BidiError("no AWS credentials: pass --profile, or set them as for any AWS command")
        frozen = credentials.get_frozen_credentials()
        return self.identity_type(access_key_id=frozen.access_key, secret_access_key=frozen.secret_key,
                                  session_token=frozen.token)


class EndpointChannel:
    """A session's messages over InvokeEndpointWithBidirectionalStream (AWS's HTTP/2 client), with
    the credentials and region of `aws` (an `aws.session.AWS`: --profile, --region,
    --endpoint-url); `sdk` (client, config, models modules) for a transport of the caller's."""

    def __init__(self, endpoint: str, aws, target_variant: str | None = None, sdk=None):
        self.client_mod, self.config_mod, self.models = sdk or endpoint_sdk()
        self.endpoint, self.aws = endpoint, aws
        self.region = aws.region_name
        self.endpoint_url = aws.endpoint_url or RUNTIME_HTTP2_URL.format(region=self.region)
        self.target_variant = target_variant
        self._assembler = PartAssembler()
        self.retry_sleep = asyncio.sleep  # (between tries at the session's start)

    def _credentials(self):
        if hasattr(self.models, "AWSCredentialsIdentity"):  # (a caller's transport brings its own)
            identity = self.models.AWSCredentialsIdentity
        else:
            from smithy_aws_core.identity import AWSCredentialsIdentity as identity
        return SessionCredentials(self.aws.session, identity)

    async def __aenter__(self):
        cfg = self.config_mod.Config(endpoint_uri=self.endpoint_url, region=self.region,
                                     aws_credentials_identity_resolver=self._credentials())
        self._client = self.client_mod.SageMakerRuntimeHTTP2Client(config=cfg)
        args = {"endpoint_name": self.endpoint}
        if self.target_variant:
            args["target_variant"] = self.target_variant
        self._stream = await with_retries(lambda: self._client.invoke_endpoint_with_bidirectional_stream(
            self.models.InvokeEndpointWithBidirectionalStreamInput(**args)), sleep=self.retry_sleep)
        self._output = None
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def send(self, text: str, last: bool = False) -> None:
        part = endpoint_parts([text])[0]
        payload = self.models.RequestPayloadPart(bytes_=part["Bytes"], data_type=part["DataType"],
                                                 completion_state=part["CompletionState"])
        await self._stream.input_stream.send(self.models.RequestStreamEventPayloadPart(value=payload))

    async def receive(self):
        """The next whole message, ("text", str) or ("binary", bytes); None at the stream's end."""
        if self._output is None:
            self._output = (await self._stream.await_output())[1]
        while True:
            event = await self._output.receive()
            if event is None:
                return None
            value = getattr(event, "value", None)
            if not isinstance(value, self.models.ResponsePayloadPart):  # ModelStreamError, InternalStreamFailure
                raise BidiError(f"the endpoint's stream failed: {error_line(value)}")
            message = self._assembler.add(value.data_type, value.bytes_, getattr(value, "completion_state", None))
            if message is not None:
                return message

    async def close(self) -> None:
        try:
            await self._stream.input_stream.close()
        except Exception:  # already closed by the endpoint
            pass


# -- a session -------------------------------------------------------------------------


async def run_session(channel, settings: dict, pieces, *, piece_interval_s: float = 0.0,
                      on_audio: Callable[[bytes, int], None] | None = None,
                      on_sentence: Callable[[Sentence], None] | None = None,
                      cancel_after_s: float | None = None, clear_after_s: float | None = None,
                      after_clear: str = "And now for something else.") -> SessionResult:
    """Open a session on `channel`, send `settings` then each piece of `pieces` (an iterable or an
    async iterator of text; `piece_interval_s` apart), then {"end": true}; collect the audio and
    each sentence's timings. `cancel_after_s`: barge in that long after the first audio (the
    session ends); `clear_after_s`: barge in that keeps the session, then say `after_clear`
    (the time to the server's "cleared" is `clear_s`)."""
    result = SessionResult(format=settings.get("format", "pcm"), started=time.perf_counter())
    sent: dict[int, float] = {}  # text piece number -> when it left
    audio_started = asyncio.Event()
    clear_sent: list[float] = []
    await channel.send(json.dumps(settings))

    async def sender():
        n = 0
        async for piece in _aiter(pieces):
            if piece:
                n += 1
                sent[n] = time.perf_counter()
                await channel.send(piece)
                if piece_interval_s:
                    await asyncio.sleep(piece_interval_s)
        if cancel_after_s is not None:
            try:  # a session that makes no audio (its text refused) is cancelled all the same
                await asyncio.wait_for(audio_started.wait(), 60)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(cancel_after_s)
            await channel.send(json.dumps({"cancel": True}), last=True)
            return
        if clear_after_s is not None:
            try:
                await asyncio.wait_for(audio_started.wait(), 60)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(clear_after_s)
            clear_sent.append(time.perf_counter())
            await channel.send(json.dumps({"clear": True}))
            n += 1
            sent[n] = time.perf_counter()
            await channel.send(after_clear)
            await channel.send(json.dumps({"end": True}), last=True)
        else:
            await channel.send(json.dumps({"end": True}), last=True)

    task = None
    header_pending = result.format == "wav"
    spoken = 0
    try:
        while True:
            message = await channel.receive()
            if message is None:
                break
            kind, data = message
            now = time.perf_counter()
            if kind == "binary":
                if header_pending:  # the WAV header of open length, before any audio
                    header_pending = False
                    continue
                result.audio += data
                audio_started.set()
                if spoken < len(result.sentences):
                    s = result.sentences[spoken]
                    s.first_audio_at = s.first_audio_at or now
                    s.samples += len(data) // 2
                if on_audio:
                    on_audio(data, result.sample_rate)
                continue
            doc = json.loads(data)
            if "ready" in doc:
                result.sample_rate = doc["sample_rate"]
                task = asyncio.create_task(sender())
            elif "queued" in doc:
                result.sentences.append(Sentence(doc["queued"], doc["text"], doc["part"], sent.get(doc["part"])))
            elif "spoken" in doc:
                s = result.sentences[doc["spoken"]]
                s.spoken_at = now
                spoken = doc["spoken"] + 1
                if on_sentence:
                    on_sentence(s)
            elif "done" in doc:
                result.done = doc["done"]
            elif "cancelled" in doc:
                result.cancelled = True
            elif "cleared" in doc:
                result.cleared = doc["cleared"]
                result.clear_s = now - clear_sent[0] if clear_sent else None
                if doc["cleared"]["sentences"]:  # the audio that follows is the next sentence's
                    spoken = doc["cleared"]["sentences"][-1] + 1
            elif "error" in doc:
                result.errors.append(doc["error"])
                if task is None:  # refused before the session began
                    raise BidiError(f"the server refused the session ({doc.get('status', '?')}): {doc['error']}")
    finally:
        if task is not None:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
            task.cancel()
    result.ended = time.perf_counter()
    if result.done is None and not result.cancelled:
        raise BidiError("the session ended without its 'done' message"
                        + (f": {result.errors[-1]}" if result.errors else ""))
    return result


async def _aiter(pieces) -> AsyncIterator[str]:
    if hasattr(pieces, "__aiter__"):
        async for piece in pieces:
            yield piece
    else:
        loop = asyncio.get_running_loop()
        iterator = iter(pieces)
        while True:
            # A file or stdin is read off the event loop: audio keeps arriving while it waits.
            piece = await loop.run_in_executor(None, next, iterator, None)
            if piece is None:
                return
            yield piece


class WavWriter:
    """16-bit mono PCM written to a WAV file as it arrives; the sizes are filled in at the end."""

    def __init__(self, path: Path, sample_rate: int):
        self.path, self.rate = path, sample_rate
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "wb")
        self._file.write(b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " +
                         struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
                         b"data" + struct.pack("<I", 0xFFFFFFFF))
        self.bytes = 0

    def write(self, pcm: bytes) -> None:
        self._file.write(pcm)
        self._file.flush()
        self.bytes += len(pcm)

    def close(self) -> None:
        self._file.seek(4)
        self._file.write(struct.pack("<I", 36 + self.bytes))
        self._file.seek(40)
        self._file.write(struct.pack("<I", self.bytes))
        self._file.close()


# -- the benchmark ---------------------------------------------------------------------

BENCH_TEXT = ("Thanks for calling, I can help with that. Your order shipped this morning and should arrive "
              "on Thursday. Is there anything else I can do for you today? I can also send you the tracking "
              "link by text message.")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def bench_level(make_channel: Callable[[], object], settings: dict, text: str, *, concurrency: int,
                      piece_chars: int, piece_interval_s: float, sessions: int | None = None,
                      clear_after_s: float | None = None) -> dict:
    """`sessions` sessions (default: `concurrency`), `concurrency` at a time, each sending `text`
    in pieces: first audio after the first complete sentence and the gaps between sentences;
    with `clear_after_s`, each barges in that long after its first audio (keeping the session)
    and says one more sentence: the time to the server's "cleared", and that sentence's first audio."""
    total = sessions or concurrency
    gate = asyncio.Semaphore(concurrency)
    results: list[SessionResult] = []
    errors: dict[str, int] = {}

    async def one():
        async with gate:
            try:
                async with make_channel() as channel:
                    results.append(await run_session(channel, settings, split_pieces(text, piece_chars),
                                                     piece_interval_s=piece_interval_s, clear_after_s=clear_after_s))
            except (FishSMError, OSError, asyncio.TimeoutError) as exc:
                key = " ".join(str(exc).split())[:120] or type(exc).__name__
                errors[key] = errors.get(key, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    wall = time.perf_counter() - t0
    first = [r.sentences[0].first_audio_s * 1e3 for r in results if r.sentences and r.sentences[0].first_audio_s is not None]
    gaps = [g * 1e3 for r in results for g in r.gaps_s()]
    ms = lambda values: {f"p{q}": _pct(values, q) for q in (50, 95, 99)}  # noqa: E731
    out = {"concurrency": concurrency, "sessions": total, "ok": len(results), "errors": errors,
           "sentences": sum(len(r.sentences) for r in results),
           "first_sentence_audio_ms": ms(first), "sentence_gap_ms": ms(gaps),
           "audio_seconds": sum(r.audio_seconds for r in results), "wall_s": wall}
    if clear_after_s is not None:
        out["clear_ms"] = ms([r.clear_s * 1e3 for r in results if r.clear_s is not None])
        out["after_clear_first_audio_ms"] = ms([r.sentences[-1].first_audio_s * 1e3 for r in results
                                                if r.cleared and r.sentences and r.sentences[-1].first_audio_s is not None])
    return out


def format_bench(levels: list[dict]) -> str:
    head = ["conc", "ok/n", "1st p50 ms", "1st p95 ms", "1st p99 ms", "gap p50 ms", "gap p95 ms", "gap p99 ms",
            "audio s/s"]
    cleared = any("clear_ms" in lv for lv in levels)
    if cleared:
        head += ["clear p50 ms", "clear p95 ms", "after p95 ms"]
    rows = [head]
    for lv in levels:
        f, g = lv["first_sentence_audio_ms"], lv["sentence_gap_ms"]
        cell = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        rows.append([str(lv["concurrency"]), f"{lv['ok']}/{lv['sessions']}", cell(f["p50"]), cell(f["p95"]),
                     cell(f["p99"]), cell(g["p50"]), cell(g["p95"]), cell(g["p99"]),
                     f"{lv['audio_seconds'] / lv['wall_s']:.2f}" if lv["wall_s"] else "-"])
        if cleared:
            c, a = lv.get("clear_ms", {}), lv.get("after_clear_first_audio_ms", {})
            rows[-1] += [cell(c.get("p50")), cell(c.get("p95")), cell(a.get("p95"))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)

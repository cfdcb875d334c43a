"""`GET /invocations-bidirectional-stream`: a voice agent's text in, speech out, on one WebSocket.

SageMaker's `InvokeEndpointWithBidirectionalStream` (HTTP/2 from the caller) reaches the
container through a sidecar that opens a WebSocket to `ws://localhost:8080/invocations-bidirectional-stream`
and relays each request part as a WebSocket data frame, "text (for UTF-8 data) or binary", and
each frame the container sends back as a response part (AWS Machine Learning Blog, "Introducing
bidirectional streaming for real-time inference on Amazon SageMaker AI", Nov 2025; AWS's sample
container README adds: answer ping frames with pongs, which aiohttp does, and accept a connection
within 250 ms). So a part's data type is the frame's opcode: UTF8 a text frame, BINARY a binary
frame. AWS does not document how a part's completion state (PARTIAL/COMPLETE) appears on the
WebSocket, and callers have seen text arrive as binary frames, so this protocol depends on
neither: every frame is one whole message, a binary frame is read as UTF-8 text, and the end of
the input is said in band (`{"end": true}`).

The protocol, client to server:

1. The first message is a JSON object with the fields of an `/invocations` body except "text"
   (settings may also come in the URL's query, `?voice=narrator&seed=7`: SageMaker's
   `ModelQueryString`; the first message's own win):
   "voice" or "reference", "adapter" (a LoRA adapter; a packaged voice may imply one), the
   sampling fields ("seed", "temperature", ..., "chunk_length") and "format": "pcm" (default) or
   "wav". It is checked by the same code as `/invocations` (`contract.parse_request`,
   `adapters.resolve_adapters`, the server's `job`), and the session is opened on the least busy
   engine core; a bad one, or a full server (503), gets an error message and the socket closes.
   An adapter that cannot be read fails the session at its first sentence (422).
2. Then text as the LLM writes it: any message not starting with "{" is text (split anywhere,
   mid-word too). The server buffers it and speaks each complete sentence at once: one that
   ends with . ! ? or … followed by whitespace or by the end of a message (not after a digit,
   so a "3." that a "5" may follow waits), or with 。 ！ ？, or at a newline.
3. Control messages, JSON objects: {"flush": true} speaks whatever is buffered now;
   {"end": true} means no more text: the rest is spoken, then the server sends "done" and
   closes; {"cancel": true} is barge-in: generation stops at the next step, the batch row is
   freed, the server sends {"cancelled": true} and closes; {"text": "..."} is text (for text that
   starts with "{"); {"clear": true} is barge-in that keeps the session: the sentence being
   spoken stops at the next step, the sentences queued and the text buffered are dropped, audio
   not yet sent is discarded, the server answers {"cleared": {"sentences": [indices cut],
   "characters": N, "audio_seconds": S (of the cut sentence, sent before the clear)}}, and
   the session takes new text with its voice, reference and adapter as before. A bad control
   message gets an error message and the session goes on.
4. Closing the input (a WebSocket close from the client) is an end: text already sent is
   spoken, its audio still sent (a closing client still reads until the server's close), then
   "done" and the close. With nothing left to speak the session ends at once. A connection that
   breaks cancels the session (nobody is left to listen).
5. A session with no message from the client for `FISH_SM_SESSION_IDLE_S` (60 s) and nothing
   left to speak, or one older than `FISH_SM_SESSION_MAX_S` (an hour), is closed with
   {"error": ..., "status": 408, "reason": "idle" or "max_length"}; WebSocket pings (the
   platform's) do not count as messages.

Server to client: {"ready": true, "sample_rate": R, "format": F} once the session is queued;
binary frames of audio as it is decoded (16-bit little-endian mono PCM; for "wav" a WAV header
of open length comes first, as a streamed `/invocations` answer starts); {"queued": i, "text": S,
"part": k} when sentence i (0-based) goes to the engine, completed by the client's k-th text
message (1-based; so a client can time its first audio from the moment it sent the sentence's
end); {"spoken": i} after the last audio of sentence i; {"done": {...}} with the session's
totals, then the close; {"error": message, "status": HTTP-like status} for a problem.

Each session, however it ends, writes one metrics line (`serving.metrics.SESSION_METRICS`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from aiohttp import WSMsgType, web

from fish_sm.contract import STREAM_FORMATS, RequestError, TTSRequest, check_text, parse_request
from fish_sm.errors import InputError
from fish_sm.serving import audio as audio_out
from fish_sm.serving.adapters import resolve_adapters
from fish_sm.serving.errors import AdapterFailed, Busy, HTTPError
from fish_sm.serving.metrics import SessionFigures
from fish_sm.serving.request import load_json

logger = logging.getLogger("fish_sm.serving")

PATH = "/invocations-bidirectional-stream"
CONTROLS = frozenset({"flush", "end", "cancel", "clear", "text"})
# A sentence's end: . ! ? … before whitespace (or before the end of a message: see `sentences`),
# a full-width 。！？ anywhere, a newline.
_END_BEFORE_SPACE = re.compile(r"[.!?…](?=\s)|[。！？]|\n")
_END_OF_MESSAGE = re.compile(r"(?<![0-9])[.!?…]\s*$")
FIRST_MESSAGE_TIMEOUT_S = 60.0
# The first message's JSON may carry a base64 reference recording.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class SentenceBuffer:
    """Text as it arrives, cut into sentences as each one ends."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, piece: str) -> list[str]:
        """Append a message's text; the sentences it completed."""
        self.text += piece
        out = []
        while True:
            match = _END_BEFORE_SPACE.search(self.text)
            if match is None:
                break
            out.append(self.text[: match.end()])
            self.text = self.text[match.end():]
        if _END_OF_MESSAGE.search(self.text):
            out.append(self.text)
            self.text = ""
        return [s.strip() for s in out if s.strip()]

    def flush(self) -> list[str]:
        rest, self.text = self.text.strip(), ""
        return [rest] if rest else []


class Closed(Exception):
    """The session is over (ended, cancelled, failed, or the client left)."""


class BidiSession:
    """One WebSocket: the first message, then text and controls in, events out."""

    def __init__(self, server, request: web.Request, ws: web.WebSocketResponse):
        self.server, self.request, self.ws = server, request, ws
        self.settings = server.settings
        self.buffer = SentenceBuffer()
        self.parts = 0  # text messages so far
        self.sentences: list[str] = []
        self.session = None  # its `CoreRequest`, once opened on a core
        self.opened = time.perf_counter()
        self.first_queued: float | None = None  # when the first sentence went to the engine
        self.first_audio: float | None = None
        self.cancelled = False
        self.input_closed = False  # the client closed its side: speak what was sent, then end
        self.finished = 0  # sentences spoken or cut, in order
        self.clears: list[tuple[int, int]] = []  # clears on their way: (sentences before it, characters dropped)
        self.samples_since_spoken = 0  # audio sent of the sentence being spoken
        self.last_active = self.opened  # the client's last message, or the last sentence spoken
        self.figures = SessionFigures()
        # done, cancelled, closed (the client left), refused (a bad first message, a full server),
        # timeout (idle, or too long), failed
        self.outcome = "closed"

    async def error(self, message: str, status: int = 400, ends: bool = False) -> None:
        """Send an error; `ends`: it ends the session, whose metrics line takes its status."""
        if ends:
            self.figures.status = status
            self.outcome = "refused" if self.session is None and status < 500 else "failed"
        if not self.ws.closed:
            await self.ws.send_json({"error": message, "status": status})

    # -- the first message ------------------------------------------------------------

    async def open(self) -> bool:
        """Read and check the first message, resolve the voice, open the session on a core."""
        if not self.server.serving:
            await self.error("the model is still loading", 503, ends=True)
            return False
        try:
            msg = await self.ws.receive(timeout=FIRST_MESSAGE_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self.error(f"no first message within {FIRST_MESSAGE_TIMEOUT_S:g} s", 408, ends=True)
            return False
        if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return False  # closed before it began
        try:
            tts = self._settings_of(msg.data)
            core = self.server.least_busy()
            loop = asyncio.get_running_loop()
            tts, = await loop.run_in_executor(None, resolve_adapters, self.server.adapters, [tts],
                                              self.settings.default_voice)
            self.figures.adapter = tts.adapter
            job = await self.server.job(tts, stream=True, session=True)
            self.session = core.open_session(job)
            self.events = self.session.events
            while True:  # the core says whether it queued the session
                kind, payload = await self._next()
                if kind == "opened":
                    break
                if kind == "error":
                    self.session = None  # ended already
                    raise payload
        except Busy as exc:
            self.figures.rejected, self.figures.status, self.outcome = True, 503, "refused"
            await self.ws.send_json({"error": exc.message, "status": 503, "retry_after_s": exc.retry_after_s})
            return False
        except HTTPError as exc:
            self.figures.adapter_failed = isinstance(exc, AdapterFailed)
            await self.error(exc.message, exc.status, ends=True)
            return False
        self.tts = tts
        self.format = tts.format or "pcm"
        rate = self.rate = core.sample_rate
        await self.ws.send_json({"ready": True, "sample_rate": rate, "format": self.format})
        if self.format == "wav":
            await self.ws.send_bytes(audio_out.open_wav_header(rate))
        return True

    async def _next(self):
        return await self.session.next_event(self.request)

    def _settings_of(self, data) -> TTSRequest:
        text = _text_of(data)
        if text is None:
            raise HTTPError(400, "the first message is not UTF-8 text")
        doc = load_json(text, "the first message")
        if not isinstance(doc, dict):
            raise HTTPError(400, "the first message must be a JSON object with the session's voice and settings")
        if "text" in doc:
            raise HTTPError(400, "the first message sets up the session and has no 'text'; send the text in the "
                                 "messages after it")
        doc = {**query_settings(self.request.query), **doc}  # the first message's own win
        fmt = doc.get("format")
        if isinstance(fmt, str) and fmt.lower() not in STREAM_FORMATS:
            raise HTTPError(400, f"format {fmt!r} cannot be streamed; a session speaks pcm or wav")
        try:
            # "." stands in for the text, which comes later; the rest is checked as /invocations checks it.
            tts = parse_request({**doc, "text": ".", "stream": doc.get("stream", True)}, self.settings)
        except RequestError as exc:
            raise HTTPError(exc.status, exc.message) from None
        if not tts.stream:
            raise HTTPError(400, "a session always streams: leave 'stream' out or set it true")
        return tts

    # -- the session ------------------------------------------------------------------

    async def run(self) -> None:
        reader, watch = asyncio.create_task(self._read()), asyncio.create_task(self._watch())
        try:
            await self._write()
        finally:
            reader.cancel()
            watch.cancel()
            if self.session is not None:
                self.session.cancel()  # no-op once done; frees the row if the client left or it failed

    def _speaking(self) -> bool:
        return len(self.sentences) > self.finished

    async def _watch(self) -> None:
        """Close the session when it has been idle too long (no client message, nothing to
        speak) or has lasted too long: a final error event, then the row is freed."""
        idle, most = self.settings.session_idle_s, self.settings.session_max_s
        while True:
            now = time.perf_counter()
            ends = self.opened + most
            if now >= ends:
                reason = f"the session reached its {most:g} s limit"
                break
            if not self._speaking() and now >= self.last_active + idle:
                reason = f"the session was idle for {idle:g} s (no message, nothing to speak)"
                break
            wake = ends if self._speaking() else min(ends, self.last_active + idle)
            await asyncio.sleep(max(wake - now, 0.05))  # (a deadline: activity moves it, checked on waking)
        self.events.put_nowait(("timeout", (reason, "max_length" if now >= ends else "idle")))

    async def _read(self) -> None:
        """Client messages until the end of the input; the session is closed or cancelled after."""
        try:
            while True:  # (not `async for`: it ends at a close without showing it)
                msg = await self.ws.receive()
                if msg.type == WSMsgType.CLOSE and not self.cancelled:  # the input ends: finish what was sent
                    await self._input_closed()
                    return
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    break
                self.last_active = time.perf_counter()
                text = _text_of(msg.data)
                if text is None:
                    await self.error("a message is not UTF-8 text")
                    continue
                if text.lstrip().startswith("{"):
                    if await self._control(text):
                        return
                else:
                    await self._text(text)
        except Closed:
            return
        # The client closed the socket (or it broke) without {"end": true}: nobody listens any more.
        self.session.cancel()
        self.events.put_nowait(("closed", None))

    async def _input_closed(self) -> None:
        """The client closed its side: the text it sent is spoken (a closing client still reads
        what the server sends until the server's close), then the session ends with "done"."""
        self.input_closed = True
        await self._speak(self.buffer.flush())
        if self._speaking():
            self.session.close()
        else:  # nothing left to say: the session ends now
            self.session.cancel()
            self.events.put_nowait(("closed", None))

    async def _control(self, text: str) -> bool:
        """One control message; true once the input has ended."""
        try:
            doc = load_json(text, "a control message")
            if not isinstance(doc, dict) or not doc:
                raise HTTPError(400, "a control message must be a JSON object such as {\"end\": true}")
            unknown = sorted(set(doc) - CONTROLS)
            if unknown:
                raise HTTPError(400, f"unknown control field(s): {', '.join(unknown)}; accepted: "
                                     f"{', '.join(sorted(CONTROLS))}")
            for name in ("flush", "end", "cancel", "clear"):
                if name in doc and doc[name] is not True:
                    raise HTTPError(400, f"control {name!r} must be true")
            if "text" in doc and not isinstance(doc["text"], str):
                raise HTTPError(400, "control 'text' must be a string")
        except HTTPError as exc:
            await self.error(exc.message, exc.status)
            return False
        if doc.get("cancel"):
            self.cancelled = self.figures.cancelled = True  # audio already queued for the client is dropped too
            self.session.cancel()
            self.events.put_nowait(("cancelled", None))
            return True
        if doc.get("clear"):
            dropped = sum(len(s) for s in self.buffer.flush())
            self.clears.append((len(self.sentences), dropped))
            self.session.clear()
        if "text" in doc:
            await self._text(doc["text"])
        if doc.get("flush") or doc.get("end"):
            await self._speak(self.buffer.flush())
        if doc.get("end"):
            self.session.close()
            return True
        return False

    async def _text(self, piece: str) -> None:
        self.parts += 1
        limit = self.settings.max_text_chars
        if len(self.buffer.text) + len(piece) > limit:
            await self.error(f"the text buffered without a sentence end would be {len(self.buffer.text) + len(piece)} "
                             f"characters; the limit is {limit}: this part was dropped (end sentences sooner, or "
                             "send {\"flush\": true})", 413)
            return
        await self._speak(self.buffer.add(piece))

    async def _speak(self, sentences: list[str]) -> None:
        for sentence in sentences:
            try:
                check_text(sentence, self.tts.chunk_length)
            except InputError as exc:
                await self.error(str(exc))
                continue
            try:
                self.session.speak(sentence)
            except HTTPError as exc:  # its core no longer serves
                await self.error(exc.message, exc.status, ends=True)
                raise Closed() from None
            self.first_queued = self.first_queued or time.perf_counter()
            await self.ws.send_json({"queued": len(self.sentences), "text": sentence, "part": self.parts})
            self.sentences.append(sentence)

    async def _write(self) -> None:
        """Engine events out to the client until the session is over."""
        while True:
            kind, payload = await self._next()
            if kind == "audio" and len(payload) and not self.cancelled and not self.clears:
                self.samples_since_spoken += len(payload)
                if self.first_audio is None:
                    self.first_audio = time.perf_counter()
                    self.figures.first_audio_ms = (self.first_audio - (self.first_queued or self.opened)) * 1e3
                await self.ws.send_bytes(audio_out.pcm16(payload))
            elif kind == "spoken":
                self.figures.sentences_spoken += 1
                self.finished, self.samples_since_spoken = payload + 1, 0
                self.last_active = time.perf_counter()
                await self.ws.send_json({"spoken": payload})
            elif kind == "cleared":
                upto, dropped = self.clears.pop(0)
                cut = list(range(self.finished, upto))
                seconds = self.samples_since_spoken / self.rate if cut else 0.0
                self.finished, self.samples_since_spoken = max(self.finished, upto), 0
                self.last_active = time.perf_counter()
                await self.ws.send_json({"cleared": {"sentences": cut, "audio_seconds": round(seconds, 3),
                                                     "characters": sum(len(self.sentences[i]) for i in cut) + dropped}})
            elif kind == "done":
                self.outcome = "done"
                await self.ws.send_json({"done": self._summary(payload)})
                return
            elif kind == "error":
                self.figures.adapter_failed = isinstance(payload, AdapterFailed)
                await self.error(payload.message, payload.status, ends=True)
                return
            elif kind == "rejected":  # a sentence its core refused; the session goes on
                await self.error(payload.message, payload.status)
            elif kind == "cancelled":
                self.outcome = "cancelled"
                await self.ws.send_json({"cancelled": True})
                return
            elif kind == "timeout":
                message, reason = payload
                self.outcome = "timeout"
                self.figures.status = 408
                await self.ws.send_json({"error": f"{message}: closed", "status": 408, "reason": reason})
                return
            elif kind == "closed":
                return

    def _summary(self, result) -> dict:
        doc = {"sentences": len(self.sentences), "wall_s": round(time.perf_counter() - self.opened, 3),
               "frames": getattr(result, "frames", None), "audio_seconds": getattr(result, "seconds", None),
               "rtf": getattr(result, "rtf", None)}
        if self.first_audio is not None:
            doc["first_audio_s"] = round(self.first_audio - self.opened, 3)
        return doc


# Query-string settings (`ModelQueryString` on the endpoint): numbers as the JSON would hold them.
_QUERY_INTS = frozenset({"seed", "max_new_tokens", "chunk_length", "sample_rate"})
_QUERY_FLOATS = frozenset({"temperature", "top_p", "repetition_penalty"})


def query_settings(query) -> dict:
    """A session's settings from its URL's query (`voice=narrator&seed=7`), checked with the first
    message's (an unknown name is refused there); a name given twice is refused here."""
    doc: dict = {}
    for name in query:
        values = query.getall(name)
        if len(values) > 1:
            raise HTTPError(400, f"query setting {name!r} is given {len(values)} times")
        value = values[0]
        try:
            doc[name] = int(value) if name in _QUERY_INTS else float(value) if name in _QUERY_FLOATS else value
        except ValueError:
            raise HTTPError(400, f"query setting {name}={value[:40]!r} is not a number") from None
    if "text" in doc:
        raise HTTPError(400, "the session's text comes in its messages, not in the query")
    return doc


def _text_of(data) -> str | None:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return None


async def bidirectional_stream(server, request: web.Request) -> web.StreamResponse:
    """The route's handler: one session per WebSocket, its problems as error messages."""
    # autoclose off: a client's close is the end of its input, and its audio still goes out (`_input_closed`).
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, autoclose=False)
    await ws.prepare(request)
    bidi = BidiSession(server, request, ws)
    try:
        if await bidi.open():
            await bidi.run()
            logger.info("session done: %d sentences, first audio %s, %.2f s", len(bidi.sentences),
                        f"{(bidi.first_audio - bidi.opened) * 1e3:.0f} ms" if bidi.first_audio else "-",
                        time.perf_counter() - bidi.opened)
    except (ConnectionResetError, asyncio.CancelledError):
        if bidi.session is not None:
            bidi.session.cancel()
        raise
    except Exception:
        logger.exception("session failed")
        if bidi.session is not None:
            bidi.session.cancel()
        await bidi.error("internal error; see the server log", 500, ends=True)
    finally:
        server.metrics.session(bidi.figures, bidi.outcome)
        if not ws.closed:
            await ws.close()
    return ws

"""The batching server: SageMaker's container contract on aiohttp, in front of one engine core
process per GPU (or one on the CPU).

Two kinds of process (the vLLM V1 shape). This one, the front end, imports no torch: HTTP,
parsing and validation (`request.parse_body`, the same definition of a request as the handler's),
voice names and adapters (`adapters.resolve_adapters`, S3 lookups included), zero-shot
references' bytes (from the body or S3, size and length checked), audio encoding
(`response.encode_prediction`), metrics, `/ping` and the bidirectional WebSocket (`bidi.py`).
Each engine core (`core.py`, started and watched by `cores.py`) owns one device: the model,
the continuous-batching engine, the codec, packaged voices and reference encoding; the two
talk over zmq on private unix sockets (`ipc.py`). So the engine's threads never share a GIL
with the HTTP server, nor the cores with each other.

`GET /ping` is 503 while the cores load, compile and warm up (in parallel), 200 with each
core's load once all serve, and 503 for good once a core has died or its engine failed: its
requests fail with a 503 (a stream already answering is cut short), and the instance is
unhealthy until the platform replaces it (cores are never restarted). `POST /invocations`
answers whole or, with `"stream": true`, as chunked audio while it is generated: a WAV header
of open length then 16-bit PCM, or bare PCM for `Accept: audio/pcm` (what SageMaker's
`InvokeEndpointWithResponseStream` relays). Each request goes to the core with the fewest in
flight; a full server answers 503 with `Retry-After` at once (its core refuses it); a client
that goes away frees its slot at the next step. The lines of a JSON Lines body go to the core
one at a time, each once the one before has a slot, so a long body never crowds other clients
out of the queue. `GET /invocations-bidirectional-stream` is a WebSocket session for voice
agents: text in as it is written, each sentence's audio out as it is decoded (`bidi.py`).

SIGTERM: stop accepting, let the requests in flight finish (aiohttp's graceful shutdown), then
tell each core to shut down and wait for it (killed if it does not). A core that cannot start
makes the server exit 1 with its reason as the last line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import signal
import time
from pathlib import Path

import zmq
from aiohttp import web

from fish_sm.cloudwatch_metrics import STATE_INTERVAL_S
from fish_sm.contract import AUDIO_TYPES, TTSRequest, check_text
from fish_sm.errors import FishSMError, InputError
from fish_sm.package.verify import verified_token, verify_package
from fish_sm.serving import audio as audio_out
from fish_sm.serving import bidi, ipc
from fish_sm.serving.adapters import AdapterRegistry, adapter_label, resolve_adapters
from fish_sm.serving.config import ServerConfig, check_model_dir
from fish_sm.serving.cores import CoreRequest, EngineCore, Launch, StartFailure, launch_process
from fish_sm.serving.errors import (AdapterFailed, Busy, HTTPError, NoAudio, bad_request, start_up_failure,
                                    unknown_voice)
from fish_sm.serving.http import Limits, application, error_response, listening, read_body
from fish_sm.serving.metrics import Metrics, RequestFigures
from fish_sm.serving.references import reference_audio
from fish_sm.serving.request import JSONLINES_ALIASES, check_accept, media_type, parse_body, response_format
from fish_sm.serving.response import Prediction, encode_prediction
from fish_sm.settings import Settings

logger = logging.getLogger("fish_sm.serving")


class BatchingApp:
    def __init__(self, model_dir: Path, settings: Settings, launch: Launch = launch_process):
        self.model_dir, self.settings, self._launch = model_dir, settings, launch
        self.cores: list[EngineCore] = []
        self.serving = False  # every core is ready
        self.failed: str | None = None
        self.stopping = asyncio.Event()
        self.metrics = Metrics("batching", enabled=settings.metrics == "emf")
        self.voices: frozenset[str] = frozenset()  # the packaged voices' names
        self.sample_rate = 0
        self.adapters: AdapterRegistry | None = None
        self._context: zmq.Context | None = None
        self._directory: Path | None = None  # the private directory of the cores' sockets

    # -- start-up -----------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        app["loading"] = asyncio.create_task(self._load())
        app["state_metrics"] = asyncio.create_task(self._report_state())

    async def _load(self) -> None:
        """Start the first core, hash the package while it starts, then (once it has said which
        devices there are) start one for each other device; all load at once, and /ping answers
        meanwhile. A core reads nothing in the model directory until it is told the package was
        verified (`ipc.Verified`); a package that fails verification stops the server first."""
        try:
            self._context = zmq.Context()
            self._directory = ipc.private_directory()
            first = self._start_core(0, "auto")
            loop = asyncio.get_running_loop()
            token = await loop.run_in_executor(None, self._verify)
            first.verified(token)
            hello = await first.hello
            for index, device in enumerate(hello.devices[1:], 1):
                self._start_core(index, device).verified(token)
            pending = {core.ready for core in self.cores}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    future.result()  # a core that could not start stops the server now
            ready = self.cores[0]
            self.voices, self.sample_rate = frozenset(ready.voices), ready.sample_rate
            loop = asyncio.get_running_loop()
            self.adapters = await loop.run_in_executor(None, self._adapter_registry, loop)
            self.serving = True
            self.metrics.state([core.load() for core in self.cores])  # the first, as soon as it serves
        except StartFailure as exc:  # the core logged it (with its traceback, if a bug)
            self.failed = exc.message
        except Exception as exc:
            self.failed, expected = start_up_failure(exc)
            if not expected:
                logger.exception("start-up failed")  # a bug: its traceback belongs in the log
        if self.failed:
            self.stopping.set()  # a server that cannot serve exits, so the platform sees it fail

    def _verify(self) -> str | None:
        """Verify the package (`verify_package`; a plain checkpoint directory has nothing to
        verify): the token its cores check their files against, or None for a plain directory."""
        pin = self.settings.manifest_sha256
        return verified_token(self.model_dir, pin) if verify_package(self.model_dir, pin) else None

    def _start_core(self, index: int, device: str) -> EngineCore:
        core = EngineCore(index, device, self._directory, self.model_dir, self._context, self._launch)
        self.cores.append(core)
        core.start()
        return core

    def _adapter_registry(self, loop: asyncio.AbstractEventLoop) -> AdapterRegistry | None:
        """The adapters this server knows (names only: the cores read them), when it has any."""
        from fish_sm.model.config import ModelConfig

        registry = AdapterRegistry.from_package(self.model_dir, ModelConfig.from_file(self.model_dir / "config.json"),
                                                self.settings)
        if not registry.enabled:
            return None
        # An S3 adapter found removed or replaced (on an executor thread) is read afresh by every core.
        registry.on_change = lambda name: loop.call_soon_threadsafe(self._forget_adapter, name)
        return registry

    def _forget_adapter(self, name: str) -> None:
        for core in self.cores:
            core.forget_adapter(name)

    async def stop(self, app: web.Application) -> None:
        """After the requests in flight (aiohttp's shutdown): stop the cores, remove their sockets."""
        app["loading"].cancel()
        app["state_metrics"].cancel()
        await asyncio.gather(*(core.stop() for core in self.cores))
        if self._context is not None:
            self._context.destroy(linger=0)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    # -- the contract --------------------------------------------------------------------

    async def ping(self, request: web.Request) -> web.Response:
        if self.failed:
            return web.json_response({"status": "Failed", "error": self.failed}, status=503)
        if not self.serving:
            return web.json_response({"status": "Loading"}, status=503)
        if not all(core.alive() for core in self.cores):
            return web.json_response({"status": "Unhealthy"}, status=503)
        doc = {"status": "Healthy", "load": [core.load() for core in self.cores]}
        if self.settings.benchmark_lengths:  # so a benchmark's report can say its lengths were forced
            doc["benchmark_lengths"] = True
        return web.json_response(doc)

    async def _report_state(self) -> None:
        """The engines' occupancy and queue as a metrics line every STATE_INTERVAL_S while serving."""
        while self.metrics.enabled:
            await asyncio.sleep(STATE_INTERVAL_S)
            if self.serving:
                self.metrics.state([core.load() for core in self.cores])

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """Answer the request, then write its metrics line (not for a client that left unanswered)."""
        figures = request["figures"] = RequestFigures(status=0)
        response = await self._invocations(request)
        figures.status = figures.status or response.status
        figures.rejected = response.status == 503 and "Retry-After" in response.headers  # full: see Busy
        self.metrics.request(figures)
        return response

    async def _invocations(self, request: web.Request) -> web.StreamResponse:
        request["received"] = time.perf_counter()
        if not self.serving:
            return _error(HTTPError(503, "the model is still loading"))
        try:
            accept = request.headers.get("Accept")
            check_accept(accept)
            body = await read_body(request)
            content_type = request.headers.get("Content-Type")
            # Off the event loop: a large body takes a while to decode, and /ping must not wait.
            loop = asyncio.get_running_loop()
            requests = await loop.run_in_executor(None, parse_body, body, content_type, self.settings)
            core = self.least_busy()
            # Each request's adapter, named or implied by its voice (unknown: 400); may ask S3.
            requests = await loop.run_in_executor(None, resolve_adapters, self.adapters, requests,
                                                  self.settings.default_voice)
            request["figures"].adapter = adapter_label(requests)
            if requests[0].stream:
                return await self._stream(request, core, requests[0], accept)
            jsonlines = media_type(content_type) in JSONLINES_ALIASES
            if jsonlines:
                results = await self._lines(request, core, requests)
            else:
                response_format(accept, requests[0])  # a contradicting Accept fails before any work
                results = [await self._whole(request, core, requests[0])]
            # Off the event loop too: MP3 or Ogg of a long utterance takes a while.
            payload, kind = await loop.run_in_executor(None, encode_prediction,
                                                       Prediction(results, requests, jsonlines), accept)
            return web.Response(body=payload, content_type=kind.split(";")[0])
        except HTTPError as exc:
            request["figures"].adapter_failed = isinstance(exc, AdapterFailed)
            return _error(exc)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            logger.exception("request failed")
            return _error(HTTPError(500, "internal error; see the server log"))

    def least_busy(self) -> EngineCore:
        """The live core with the fewest requests in flight."""
        alive = [core for core in self.cores if core.alive()]
        if not alive:
            raise HTTPError(503, "the engine has stopped after an internal error; this instance is unhealthy")
        return min(alive, key=EngineCore.in_flight)

    async def job(self, tts: TTSRequest, stream: bool, session: bool = False) -> ipc.JobSpec:
        """What a core is sent for `tts`: its text checked as the engine would check it (a session's
        comes later), its voice's name checked, a zero-shot recording's bytes fetched (S3: off the
        event loop) and checked."""
        try:
            check_text("session" if session else tts.text, tts.chunk_length)
        except InputError as exc:
            raise bad_request(str(exc)) from None
        if tts.voice is not None and tts.voice not in self.voices:
            raise unknown_voice(tts.voice, self.voices)
        reference = None
        if tts.reference is not None:
            loop = asyncio.get_running_loop()
            reference = await loop.run_in_executor(None, reference_audio, tts.reference, self.settings)
        sampling = tts.sampling
        return ipc.JobSpec("" if session else tts.text, tts.chunk_length, sampling.temperature, sampling.top_p,
                           sampling.repetition_penalty, sampling.max_new_tokens, seed=sampling.seed,
                           stream=stream, adapter=tts.adapter, voice=tts.voice, reference=reference,
                           reference_text=tts.reference.text if tts.reference is not None else None)

    async def _submit(self, core: EngineCore, tts: TTSRequest, stream: bool, bounded: bool = True) -> CoreRequest:
        """Send the request to `core`; its events arrive on the returned request's queue. A full
        core is a 503, except for the lines of an accepted JSON Lines request (`bounded=False`:
        see `_lines`)."""
        job = await self.job(tts, stream)
        return core.submit(job, bounded=bounded)

    async def _whole(self, request: web.Request, core: EngineCore, tts: TTSRequest, bounded: bool = True,
                     admitted: asyncio.Future | None = None):
        """One whole utterance; `admitted` is resolved once it leaves the queue for a slot."""
        handle = await self._submit(core, tts, stream=False, bounded=bounded)
        pieces = []
        try:
            while True:
                kind, payload = await handle.next_event(request)
                if kind == "admitted":
                    if admitted is not None and not admitted.done():
                        admitted.set_result(None)
                elif kind == "audio":
                    pieces.append(payload)
                elif kind == "error":
                    raise payload
                elif kind == "done":
                    if not pieces or not len(pieces[0]):
                        raise NoAudio()
                    payload.audio = pieces[0]
                    request["figures"].add_synthesis(payload.frames, payload.seconds, payload.rtf)
                    return payload
        finally:
            handle.cancel()  # no-op once done; frees the slot if the client left
            _log_request(request, handle, False, None)

    async def _lines(self, request: web.Request, core: EngineCore, requests: list[TTSRequest]) -> list:
        """The lines of a JSON Lines body, each submitted once the one before it has a slot: the
        body waits in the queue with one line at a time, beside the places other clients may
        take, and their requests are admitted between its lines. A line without audio answers
        with its own error; any other failure fails them all."""
        loop = asyncio.get_running_loop()
        tasks = []
        try:
            async with asyncio.TaskGroup() as group:
                for tts in requests:
                    admitted = loop.create_future()
                    tasks.append(group.create_task(self._line(request, core, tts, admitted)))
                    await asyncio.wait([admitted, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _line(self, request: web.Request, core: EngineCore, tts: TTSRequest, admitted: asyncio.Future):
        try:
            return await self._whole(request, core, tts, bounded=False, admitted=admitted)
        except NoAudio as exc:
            return exc

    async def _stream(self, request: web.Request, core: EngineCore, tts: TTSRequest, accept: str | None):
        kind, fmt = response_format(accept, tts)
        if kind not in (AUDIO_TYPES["wav"], AUDIO_TYPES["pcm"]):
            raise HTTPError(406, f"a stream is answered in audio/wav or audio/pcm, not {kind}")
        handle = await self._submit(core, tts, stream=True)
        rate = core.sample_rate
        response, first_byte = None, None
        try:
            while True:
                event, payload = await handle.next_event(request)
                if event == "admitted" or (event == "audio" and not len(payload)):
                    continue
                if event == "done" and response is None:
                    raise NoAudio()
                if event == "error":
                    if response is None:
                        raise payload
                    logger.error("stream failed after it started: %s", payload.message)
                    request["figures"].status = payload.status if payload.status >= 500 else 500  # the 200 went out
                    break  # the status is sent: ending the body early is all that is left
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": kind if fmt == "wav" else
                                                           f"audio/pcm;rate={rate};channels=1;encoding=s16le",
                                                           "X-Sample-Rate": str(rate)})
                    response.enable_chunked_encoding()
                    await response.prepare(request)
                    if fmt == "wav":
                        await response.write(audio_out.open_wav_header(rate))
                if event == "audio":
                    await response.write(audio_out.pcm16(payload))
                    first_byte = first_byte or time.perf_counter()
                else:
                    request["figures"].add_synthesis(payload.frames, payload.seconds, payload.rtf)
                    break
            await response.write_eof()
            return response
        finally:
            handle.cancel()
            _log_request(request, handle, True, first_byte)


def _log_request(request: web.Request, handle: CoreRequest, stream: bool, first_byte: float | None) -> None:
    """One line per request, with where its time went (measured from its arrival): parsing,
    the voice and the way to its core until the engine took it, the queue, the first frame, the
    first audio decoded and, streaming, written. Under load these tell a slow admission from a
    busy codec or a busy event loop. The core's timings count from the engine taking it."""
    t, received = handle.timings, request.get("received", handle.sent)
    accepted = handle.sent - received + handle.accepted_s

    def ms(key: str) -> str:
        return f"{(accepted + t[key]) * 1e3:.0f} ms" if key in t else "-"

    outcome = "done" if "total" in t else "ended early"  # an error, or the client left
    figures = request.get("figures")
    if figures is not None:
        figures.stream = figures.stream or stream
        if "queue" in t:
            figures.add_queue_wait(t["queue"] * 1e3)
        if first_byte:
            figures.first_audio_ms = (first_byte - received) * 1e3
    logger.info("%s %s: accepted %.0f ms, admitted %s, first frame %s, first audio %s, first byte %s, total %s",
                "stream" if stream else "request", outcome, accepted * 1e3, ms("queue"), ms("first_frame"),
                ms("first_audio"), f"{(first_byte - received) * 1e3:.0f} ms" if first_byte else "-", ms("total"))


def _error(exc: HTTPError) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Busy) else None
    # A body not read to its end (too slow, too large) leaves the connection unusable.
    return error_response(exc.status, exc.message, headers=headers, close=exc.status in (408, 413))


def make_app(model_dir: Path, settings: Settings, launch: Launch = launch_process) -> web.Application:
    """The front end's app; `launch` starts a core (a process, unless a test runs one in-process)."""
    server = BatchingApp(model_dir, settings, launch)
    app = application(Limits.from_settings(settings))
    app.router.add_get("/ping", server.ping)
    app.router.add_post("/invocations", server.invocations)
    app.router.add_get(bidi.PATH, functools.partial(bidi.bidirectional_stream, server))  # a WebSocket
    app.on_startup.append(server.start)
    app.on_cleanup.append(server.stop)
    app["server"] = server
    return app


def serve(cfg: ServerConfig) -> int:
    """Run the batching server in the foreground until SIGTERM or SIGINT."""
    check_model_dir(cfg.model_dir, verify=False)  # hashed once the first core is starting (`BatchingApp._load`)
    settings = Settings.from_env()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("fish_sm").setLevel(settings.log_level)
    app = make_app(cfg.model_dir, settings)
    asyncio.run(_run(app, cfg))
    if app["server"].failed:
        # Raised once the server and its cores are down, so the one line is the last; the CLI prints it.
        raise FishSMError(app["server"].failed)
    return 0


async def _run(app: web.Application, cfg: ServerConfig) -> None:
    async with listening(app, cfg.host, cfg.port, handler_cancellation=True):
        stop = app["server"].stopping
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if not app["server"].failed:
            logger.info("stopping: no new connections; the requests in flight finish, then the engine cores stop")

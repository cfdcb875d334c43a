"""The batching server: SageMaker's container contract on aiohttp, in front of one
continuous-batching engine per GPU.

`GET /ping` is 503 while the engines load, compile and warm up, 200 once they serve, and
503 again if an engine thread dies. `POST /invocations` takes the same bodies, headers and
settings as the handler (`request.parse_body`, `runtime.resolve_reference`,
`runtime.encode_prediction`: one definition of a request) and answers whole, or — with
`"stream": true` — as chunked audio while it is generated: a WAV header of open length
then 16-bit PCM, or bare PCM for `Accept: audio/pcm`. That is what SageMaker's
`InvokeEndpointWithResponseStream` relays. A full server answers 503 with `Retry-After`
at once; a client that goes away frees its slot at the next step. The lines of a JSON Lines
body go to the engine one at a time, each once the one before has a slot, so a long body
never crowds other clients out of the queue. An engine whose thread failed fails the
requests it held and turns `/ping` unhealthy for good: the platform replaces the instance.
`GET /invocations-bidirectional-stream` is a WebSocket session for voice agents: text in as it
is written, each sentence's audio out as it is decoded (`bidi.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from fish_sm.engine.batching import BatchEngine, EngineStopped, Job, Overloaded
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.contract import SamplingParams
from fish_sm.errors import AdapterError, FishSMError, InputError
from fish_sm.serving import audio as audio_out
from fish_sm.serving import bidi
from fish_sm.serving.errors import Busy, HTTPError, NoAudio, bad_request, engine_error, start_up_failure
from fish_sm.serving.runtime import (Prediction, ServerConfig, ServingModel, WARMUP_TEXT, adapter_label,
                                     check_model_dir, encode_prediction, load_model, resolve_adapters,
                                     resolve_reference)
from fish_sm.serving.http import Limits, application, error_response, listening, read_body
from fish_sm.serving.metrics import Metrics, RequestFigures
from fish_sm.cloudwatch_metrics import STATE_INTERVAL_S
from fish_sm.contract import AUDIO_TYPES, TTSRequest
from fish_sm.serving.request import JSONLINES_ALIASES, check_accept, media_type, parse_body, response_format
from fish_sm.settings import Settings

logger = logging.getLogger("fish_sm.serving")


class Worker:
    """One GPU (or the CPU): the loaded model and its batching engine."""

    def __init__(self, model: ServingModel, batcher: BatchEngine):
        self.model, self.batcher = model, batcher

    def alive(self) -> bool:
        return self.batcher.alive()

    def busy(self) -> int:
        load = self.batcher.load()
        return load["active"] + load["waiting"]


def start_worker(model_dir: Path, device: str, settings: Settings) -> Worker:
    """Load, quantize, capture the batched decode steps, warm up; then start the engine."""
    model, cache, phase = load_model(model_dir, device, settings, batching=True, label=device)
    batcher = BatchEngine(model.engine, max_batch=settings.max_batch, max_queue=settings.max_queue,
                          prefix_cache=settings.prefix_cache, codec_precision=settings.codec_precision,
                          forced_lengths=settings.benchmark_lengths, horizon_s=settings.stream_horizon_s,
                          step_rows=settings.step_rows)
    if model.compiled:
        phase("compile", batcher.compile)
    batcher.start()
    if settings.warmup:
        phase("warmup", lambda: _warm_up(model, batcher))
    if model.compiled:
        phase("cache_save", cache.save)
    logger.info("%s ready with %d slots in %.2f s (%s)", device, batcher.slots, sum(model.timings.values()),
                ", ".join(f"{k} {v:.2f} s" for k, v in model.timings.items()))
    return Worker(model, batcher)


def _warm_up(model: ServingModel, batcher: BatchEngine) -> None:
    """Requests along every path: whole and streamed, with and without a voice, several at once."""
    voice = model.voices.get(model.settings.default_voice) or next(iter(model.voices.values()), None)
    jobs = [Job(WARMUP_TEXT, references=(voice,) if voice and i % 2 else (), stream=i % 3 == 0,
                params=SamplingParams(seed=i, max_new_tokens=16 * (i + 1)))
            for i in range(max(2, model.settings.warmup))]
    if model.adapters is not None and model.adapters.packaged:  # in a batch with rows of none
        jobs.append(Job(WARMUP_TEXT, params=SamplingParams(seed=0, max_new_tokens=8),
                        adapter=next(iter(model.adapters.packaged))))
    for start in range(0, len(jobs), batcher.slots):
        for ticket in [batcher.submit(job) for job in jobs[start : start + batcher.slots]]:
            try:
                ticket.result()
            except AdapterError as exc:  # its requests will fail alone (422); the server serves the rest
                logger.warning("warm-up with adapter %s failed: %s", ticket.job.adapter, exc)


def devices() -> list[str]:
    import torch

    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]


class BatchingApp:
    def __init__(self, model_dir: Path, settings: Settings):
        self.model_dir, self.settings = model_dir, settings
        self.workers: list[Worker] = []
        self.failed: str | None = None
        self.stopping = asyncio.Event()
        self.metrics = Metrics("batching", enabled=settings.metrics == "emf")

    # -- start-up -----------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        app["loading"] = asyncio.create_task(self._load())
        app["state_metrics"] = asyncio.create_task(self._report_state())

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Off the event loop, so /ping answers meanwhile; one device after another, because
            # torch.compile is not safe to run from several threads at once (later devices reuse
            # the kernels the first one compiled, from inductor's cache).
            workers = []
            for device in devices():
                workers.append(await loop.run_in_executor(None, start_worker, self.model_dir, device, self.settings))
            freeze_start_up_objects()
            self.workers = workers
            self.metrics.state([w.batcher.load() for w in workers])  # the first, as soon as it serves
        except Exception as exc:
            self.failed, expected = start_up_failure(exc)
            if not expected:
                logger.exception("start-up failed")  # a bug: its traceback belongs in the log
            self.stopping.set()  # a server that cannot serve exits, so the platform sees it fail

    async def stop(self, app: web.Application) -> None:
        app["loading"].cancel()
        app["state_metrics"].cancel()
        for worker in self.workers:
            worker.batcher.stop()

    # -- the contract --------------------------------------------------------------------

    async def ping(self, request: web.Request) -> web.Response:
        if self.failed:
            return web.json_response({"status": "Failed", "error": self.failed}, status=503)
        if not self.workers:
            return web.json_response({"status": "Loading"}, status=503)
        if not all(w.alive() for w in self.workers):
            return web.json_response({"status": "Unhealthy"}, status=503)
        doc = {"status": "Healthy", "load": [w.batcher.load() for w in self.workers]}
        if self.settings.benchmark_lengths:  # so a benchmark's report can say its lengths were forced
            doc["benchmark_lengths"] = True
        return web.json_response(doc)

    async def _report_state(self) -> None:
        """The engines' occupancy and queue as a metrics line every STATE_INTERVAL_S while serving."""
        while self.metrics.enabled:
            await asyncio.sleep(STATE_INTERVAL_S)
            if self.workers:
                self.metrics.state([w.batcher.load() for w in self.workers])

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
        if not self.workers:
            return _error(HTTPError(503, "the model is still loading"))
        try:
            accept = request.headers.get("Accept")
            check_accept(accept)
            body = await read_body(request)
            content_type = request.headers.get("Content-Type")
            # Off the event loop: a large body takes a while to decode, and /ping must not wait.
            loop = asyncio.get_running_loop()
            requests = await loop.run_in_executor(None, parse_body, body, content_type, self.settings)
            worker = self._least_busy()
            # Each request's adapter, named or implied by its voice (unknown: 400); may ask S3.
            requests = await loop.run_in_executor(None, resolve_adapters, worker.model, requests)
            request["figures"].adapter = adapter_label(requests)
            if requests[0].stream:
                return await self._stream(request, worker, requests[0], accept)
            jsonlines = media_type(content_type) in JSONLINES_ALIASES
            if jsonlines:
                results = await self._lines(request, worker, requests)
            else:
                response_format(accept, requests[0])  # a contradicting Accept fails before any work
                results = [await self._whole(request, worker, requests[0])]
            payload, kind = encode_prediction(Prediction(results, requests, jsonlines), accept)
            return web.Response(body=payload, content_type=kind.split(";")[0])
        except HTTPError as exc:
            return _error(exc)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            logger.exception("request failed")
            return _error(HTTPError(500, "internal error; see the server log"))

    def _least_busy(self) -> Worker:
        alive = [w for w in self.workers if w.alive()]
        if not alive:
            raise HTTPError(503, "the engine has stopped after an internal error; this instance is unhealthy")
        return min(alive, key=Worker.busy)

    async def _submit(self, request: web.Request, worker: Worker, tts: TTSRequest, stream: bool,
                      bounded: bool = True):
        """Resolve the voice (encoding a zero-shot recording off the event loop), submit,
        and return the ticket and the queue its events arrive on. A full engine is a 503,
        except for the lines of an accepted JSON Lines request (`bounded=False`: see `_lines`)."""
        loop = asyncio.get_running_loop()
        reference = await loop.run_in_executor(None, resolve_reference, worker.model, tts)
        job = Job(tts.text, references=(reference,) if reference is not None else (), chunk_length=tts.chunk_length,
                  params=tts.sampling, stream=stream, adapter=tts.adapter)
        events: asyncio.Queue = asyncio.Queue()
        try:
            ticket = worker.batcher.submit(job, sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                                           bounded=bounded)
        except Overloaded as exc:
            raise Busy(str(exc), exc.retry_after_s) from None
        except InputError as exc:
            raise bad_request(str(exc)) from None
        except AdapterError as exc:
            raise engine_error(exc) from None
        except EngineStopped as exc:
            raise HTTPError(503, str(exc)) from None
        return ticket, events

    async def _whole(self, request: web.Request, worker: Worker, tts: TTSRequest, bounded: bool = True,
                     admitted: asyncio.Future | None = None):
        """One whole utterance; `admitted` is resolved once it leaves the queue for a slot."""
        ticket, events = await self._submit(request, worker, tts, stream=False, bounded=bounded)
        pieces = []
        try:
            while True:
                kind, payload = await _next_event(request, events, worker)
                if kind == "admitted":
                    if admitted is not None and not admitted.done():
                        admitted.set_result(None)
                elif kind == "audio":
                    pieces.append(payload)
                elif kind == "error":
                    raise engine_error(payload)
                elif not pieces or not len(pieces[0]):
                    raise NoAudio()
                else:
                    payload.audio = pieces[0]
                    request["figures"].add_synthesis(payload.frames, payload.seconds, payload.rtf)
                    return payload
        finally:
            ticket.cancel()  # no-op once done; frees the slot if the client left
            _log_request(request, ticket, None)

    async def _lines(self, request: web.Request, worker: Worker, requests: list[TTSRequest]) -> list:
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
                    tasks.append(group.create_task(self._line(request, worker, tts, admitted)))
                    await asyncio.wait([admitted, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _line(self, request: web.Request, worker: Worker, tts: TTSRequest, admitted: asyncio.Future):
        try:
            return await self._whole(request, worker, tts, bounded=False, admitted=admitted)
        except NoAudio as exc:
            return exc

    async def _stream(self, request: web.Request, worker: Worker, tts: TTSRequest, accept: str | None):
        kind, fmt = response_format(accept, tts)
        if kind not in (AUDIO_TYPES["wav"], AUDIO_TYPES["pcm"]):
            raise HTTPError(406, f"a stream is answered in audio/wav or audio/pcm, not {kind}")
        ticket, events = await self._submit(request, worker, tts, stream=True)
        rate = worker.model.engine.sample_rate
        response, first_byte = None, None
        try:
            while True:
                event, payload = await _next_event(request, events, worker)
                if event == "admitted" or (event == "audio" and not len(payload)):
                    continue
                if event == "done" and response is None:
                    raise NoAudio()
                if event == "error":
                    if response is None:
                        raise engine_error(payload)
                    logger.error("stream failed after it started: %s", payload)
                    request["figures"].status = 500  # the 200 went out; the stream is cut short
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
            ticket.cancel()
            _log_request(request, ticket, first_byte)


async def _next_event(request: web.Request, events: asyncio.Queue, worker: Worker):
    """The next engine event; ConnectionResetError as soon as the client has gone, 503 if
    the engine stopped without answering."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            _check_client(request)
            if not worker.alive() and events.empty():
                raise HTTPError(503, "the engine stopped after an internal error; this instance is unhealthy") from None


def _check_client(request: web.Request) -> None:
    """ConnectionResetError once the client has gone (its request's finally frees the slot)."""
    if request.transport is None or request.transport.is_closing():
        raise ConnectionResetError("the client disconnected")


def _log_request(request: web.Request, ticket, first_byte: float | None) -> None:
    """One line per request, with where its time went (measured from its arrival): parsing
    and the voice until the engine took it, the queue, the first frame, the first audio
    decoded and, streaming, written. Under load these tell a slow admission from a busy codec
    or a busy event loop."""
    t, received = ticket.timings, request.get("received", ticket.submitted)
    accepted = ticket.submitted - received

    def ms(key: str) -> str:
        return f"{(accepted + t[key]) * 1e3:.0f} ms" if key in t else "-"

    outcome = "done" if "total" in t else "ended early"  # an error, or the client left
    figures = request.get("figures")
    if figures is not None:
        figures.stream = figures.stream or ticket.job.stream
        if "queue" in t:
            figures.add_queue_wait(t["queue"] * 1e3)
        if first_byte:
            figures.first_audio_ms = (first_byte - received) * 1e3
    logger.info("%s %s: accepted %.0f ms, admitted %s, first frame %s, first audio %s, first byte %s, total %s",
                "stream" if ticket.job.stream else "request", outcome, accepted * 1e3, ms("queue"), ms("first_frame"),
                ms("first_audio"), f"{(first_byte - received) * 1e3:.0f} ms" if first_byte else "-", ms("total"))


def _error(exc: HTTPError) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Busy) else None
    # A body not read to its end (too slow, too large) leaves the connection unusable.
    return error_response(exc.status, exc.message, headers=headers, close=exc.status in (408, 413))


def make_app(model_dir: Path, settings: Settings) -> web.Application:
    server = BatchingApp(model_dir, settings)
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
    check_model_dir(cfg.model_dir)
    settings = Settings.from_env()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = make_app(cfg.model_dir, settings)
    asyncio.run(_run(app, cfg))
    if app["server"].failed:
        # Raised once the server is down, so the one line is the last; the CLI prints it.
        raise FishSMError(app["server"].failed)
    return 0


async def _run(app: web.Application, cfg: ServerConfig) -> None:
    async with listening(app, cfg.host, cfg.port, handler_cancellation=True):
        stop = app["server"].stopping
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

"""An engine core: the process that owns one device (a GPU, or the CPU) for the batching server.

`python -m fish_sm.serving.core --model-dir DIR --device cuda:0 --commands ipc://... --events ipc://...`,
started by the front end (`serving/cores.py`), one per device. It loads the model, builds the
`BatchEngine`, compiles, warms up and saves the compile cache, says `Ready`, then serves the
front end's commands (`serving/ipc.py`) until `Shutdown`. Its GIL runs nothing but the engine:
the engine and codec threads, this main thread reading commands, one thread encoding zero-shot
references (one at a time, so the engine's reference cache is only ever used by it), one thread
sending events, and the adapter loader the engine keeps. HTTP, audio encoding and S3 reads of
references are the front end's.

Faults: an engine that fails fails what it holds (each request gets its error), says `Stopped`
and exits 1; the front end then reports the instance unhealthy and never restarts a core
(SageMaker replaces the instance). A core never outlives its front end: the kernel kills it
when the front end dies (PR_SET_PDEATHSIG), and it checks its parent between commands besides.
SIGINT and SIGTERM are ignored (they go to the whole process group; the front end drains its
requests first, then sends `Shutdown`).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from fish_sm.contract import SamplingParams
from fish_sm.errors import AdapterError, InputError
from fish_sm.serving import ipc
from fish_sm.serving.errors import AdapterFailed, Busy, HTTPError, engine_error, start_up_failure, unknown_voice
from fish_sm.settings import Settings

logger = logging.getLogger("fish_sm.serving")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
POLL_MS = 100  # between two looks at the engine's load and health and at the parent process
BATCH_EVENTS = 256  # events sent in one zmq message at most
LINGER_MS = 5_000  # how long closing the events socket waits for what is still queued
_CHECK_LOAD = ("check", "load")  # an outbox item: look at the engine's occupancy


def devices() -> list[str]:
    """Every device a core can run on: each GPU, or the CPU."""
    import torch

    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]


def prepare(device: str, settings: Settings) -> None:
    """What a core does before it may read the model directory, while the front end hashes the
    package: import the engine (torch, and the compiler where it will compile) and create the
    GPU's CUDA context."""
    import torch

    import fish_sm.engine.batching  # noqa: F401
    import fish_sm.serving.runtime  # noqa: F401
    from fish_sm.engine.engine import resolve_device

    resolved = resolve_device(device)  # a GPU named by its index becomes the current device
    if settings.use_compile(resolved.type):
        import torch._inductor.compile_fx  # noqa: F401  (and dynamo with it)
    if resolved.type == "cuda":
        torch.empty(0, device=resolved)


def start_engine(model_dir: Path, device: str, settings: Settings, token: str | None = None,
                 began: float | None = None, prepared: float | None = None):
    """Load, quantize, capture the batched decode steps, warm up, save the compile cache; the
    model and its started `BatchEngine`. `token`: the front end's token for the package it
    verified (`verify.verified_token`), which spares the core hashing it again; `began`: when
    the process started (its phase "start": the interpreter, imports, `prepare`); `prepared`:
    when `prepare` ended, after which the core waited for the front end's verification (counted
    in the phase "verify")."""
    from fish_sm.engine.batching import BatchEngine
    from fish_sm.engine.engine import freeze_start_up_objects
    from fish_sm.serving.runtime import engine_options, load_model

    model, cache, phase = load_model(model_dir, device, settings, batching=True, label=device, token=token,
                                     began=began, prepared=prepared)
    # "engine": the slots sized to the memory left once the codec's working memory is measured
    # (by running its back, compiled: on a GPU its first compile or trace).
    batcher = phase("engine", lambda: BatchEngine(
        model.engine, max_batch=settings.max_batch, max_queue=settings.max_queue, horizon_s=settings.stream_horizon_s,
        step_rows=settings.step_rows, piece_repeats=settings.piece_repeats, **engine_options(settings)))
    if model.compiled:
        phase("compile", lambda: batcher.compile(capture_all=settings.capture == "all"))
    batcher.start()
    if settings.warmup:
        phase("warmup", lambda: warm_up(model, batcher))
    if model.compiled:
        phase("cache_save", cache.save)
    freeze_start_up_objects()
    logger.info("%s ready with %d slots in %.2f s (%s)", device, batcher.slots, sum(model.timings.values()),
                ", ".join(f"{k} {v:.2f} s" for k, v in model.timings.items()))
    return model, batcher


def warm_up(model, batcher) -> None:
    """Requests along every path: whole and streamed, with and without a voice, several at once."""
    from fish_sm.engine.batching import Job
    from fish_sm.serving.runtime import WARMUP_TEXT

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


@dataclass
class _Held:
    """A request or session this core has taken and not yet finished."""

    received: float  # when its command arrived
    ticket: object = None  # its Ticket or Session, once submitted
    cancelled: bool = False  # the front end cancelled it (perhaps while its reference was encoded)
    audio_sent: bool = False

    def accepted_s(self) -> float:
        """Seconds from the command's arrival to the engine taking it (a reference's encoding)."""
        return self.ticket.submitted - self.received if self.ticket is not None else 0.0

    def timings(self) -> dict[str, float]:
        return dict(self.ticket.timings) if self.ticket is not None else {}


class Core:
    """One device's engine, serving the commands that arrive on `addresses.commands`. `run()`
    returns the process's exit status: 0 after `Shutdown`, 1 if it could not start or its
    engine failed. `parent`: the front end's pid, whose death ends the core."""

    def __init__(self, model_dir: Path, device: str, addresses: ipc.CoreAddresses, settings: Settings,
                 parent: int | None = None, began: float | None = None):
        self.model_dir, self.device, self.addresses, self.settings = model_dir, device, addresses, settings
        self.parent, self.began = parent, began
        self.model = self.batcher = None
        self._context = zmq.Context()
        self._commands: zmq.Socket | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (event, samples | None); None: stop sending
        self._sender: threading.Thread | None = None
        self._references: queue.SimpleQueue = queue.SimpleQueue()  # (id, job, session, bounded); None: stop
        self._encoder: threading.Thread | None = None
        self._lock = threading.Lock()  # `_held`, shared by this thread, the encoder and the sender
        self._held: dict[int, _Held] = {}
        self._load: tuple[int, int] | None = None
        self._load_checked = 0.0
        self._stopping = False  # told to (Shutdown), or the front end has gone: no failure to report
        self._stopped_sent = False
        self._sender_failed = False

    # -- the process's life -----------------------------------------------------------------

    def run(self) -> int:
        self._commands = self._context.socket(zmq.PULL)
        self._commands.bind(self.addresses.commands)
        self._sender = threading.Thread(target=self._send_events, name="fish-sm-core-events", daemon=True)
        self._sender.start()
        try:
            code = self._start_and_serve()
        finally:
            self._close()
        return code

    def _start_and_serve(self) -> int:
        try:
            all_devices = devices()
            if self.device == "auto":
                self.device = all_devices[0]
            self._send(ipc.Hello(os.getpid(), self.device, all_devices))
            prepare(self.device, self.settings)
            prepared = time.perf_counter()
            verified = self._wait_for_verification()
            if isinstance(verified, int):
                return verified
            self.model, self.batcher = start_engine(self.model_dir, self.device, self.settings, verified.token,
                                                    self.began, prepared)
        except BaseException as exc:
            message, expected = start_up_failure(exc)
            if not expected:
                logger.exception("%s: start-up failed", self.device)  # a bug: its traceback belongs in the log
            self._send(ipc.StartFailed(message, expected))
            return 1
        self._encoder = threading.Thread(target=self._encode_references, name="fish-sm-core-references", daemon=True)
        self._encoder.start()
        load = self.batcher.load()
        self._send(ipc.Ready(load["slots"], load["max_queue"], self.model.engine.sample_rate, sorted(self.model.voices),
                             dict(self.model.timings)))
        return self._serve()

    def _wait_for_verification(self) -> ipc.Verified | int:
        """The front end's word that the model directory may be read; an exit status if it said
        to shut down instead (0) or has gone (1)."""
        while True:
            command = self._next_command()
            if isinstance(command, ipc.Verified):
                return command
            if isinstance(command, ipc.Shutdown):
                self._stopping = True
                return 0
            if command is not None:
                logger.warning("%s: %s before the package was verified, ignored", self.device, type(command).__name__)
            elif self.parent is not None and os.getppid() != self.parent:
                self._stopping = True  # nobody to tell
                return 1

    def _next_command(self) -> ipc.Command | None:
        """The next command, waiting up to POLL_MS; None if none came (or a message that is not
        one, which is logged and dropped)."""
        if not self._commands.poll(POLL_MS):
            return None
        try:
            return ipc.decode_command(self._commands.recv_multipart())
        except ipc.BadMessage as exc:
            logger.warning("%s: a message that is not a command was ignored (%s)", self.device, exc)
            return None

    def _serve(self) -> int:
        """Commands until `Shutdown` (0), the engine's failure or the front end's death (1)."""
        while True:
            command = self._next_command()
            if command is not None:
                if isinstance(command, ipc.Shutdown):
                    logger.info("%s: shutting down", self.device)
                    self._stopping = True
                    self.batcher.stop()
                    return 0
                try:
                    self._handle(command)
                except Exception:  # a bug in handling one command must not take the engine down
                    logger.exception("%s: command %s failed", self.device, type(command).__name__)
                    if hasattr(command, "id"):
                        self._finish(command.id, HTTPError(500, "internal error; see the server log"))
            if self._sender_failed:
                self._stopping = True
                self.batcher.stop()
                return 1
            if self.parent is not None and os.getppid() != self.parent:
                logger.error("%s: the front end has gone; stopping", self.device)
                self._stopping = True
                self.batcher.stop()
                return 1
            if not self.batcher.alive():
                return self._engine_failed()
            self._report_load()

    def _engine_failed(self) -> int:
        """The engine failed (it failed its own requests already): fail what it never took, say so, exit 1."""
        stopped = self._stopped()
        logger.error("%s; this core exits", self._failure())
        if stopped is not None:
            self._send(stopped)
        with self._lock:
            ids = list(self._held)
        for id in ids:
            self._finish(id, HTTPError(503, f"{self._failure()}; this instance is unhealthy"))
        self._stopping = True
        self.batcher.stop()
        return 1

    def _failure(self) -> str:
        failure = self.batcher.failure
        return (f"the engine on {self.device} stopped after an internal error"
                + (f" ({type(failure).__name__})" if failure is not None else ""))

    def _stopped(self) -> ipc.Stopped | None:
        """`Stopped`, once, if the engine has failed: the sender puts it before the requests' errors,
        so the front end stops routing to this core before it answers them."""
        if self._stopping or self.batcher is None or self.batcher.alive():
            return None
        with self._lock:
            if self._stopped_sent:
                return None
            self._stopped_sent = True
        return ipc.Stopped(self._failure())

    def _close(self) -> None:
        """Send what is queued (the last events), then close the sockets."""
        self._references.put(None)
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(LINGER_MS / 1000 + 1)
        if self._commands is not None:
            self._commands.close(linger=0)
        if self._sender is None or not self._sender.is_alive():  # else it is stuck: the process's exit ends it
            self._context.term()

    # -- commands ------------------------------------------------------------------------

    def _handle(self, command: ipc.Command) -> None:
        if isinstance(command, (ipc.Submit, ipc.OpenSession)):
            self._take(command)
        elif isinstance(command, ipc.Speak):
            self._speak(command.id, command.text)
        elif isinstance(command, ipc.Close):
            session = self._ticket(command.id)
            if session is not None and hasattr(session, "close"):
                session.close()
        elif isinstance(command, ipc.Clear):
            session = self._ticket(command.id)
            if session is not None and hasattr(session, "clear"):
                session.clear()
        elif isinstance(command, ipc.Cancel):
            with self._lock:
                held = self._held.pop(command.id, None)
                if held is not None:
                    held.cancelled = True  # a reference being encoded is dropped once encoded
            if held is not None and held.ticket is not None:
                held.ticket.cancel()
        elif isinstance(command, ipc.ForgetAdapter):
            if self.model.engine.adapters is not None:
                self.model.engine.adapters.forget(command.name)

    def _take(self, command: ipc.Submit | ipc.OpenSession) -> None:
        with self._lock:
            if command.id in self._held:
                logger.warning("%s: request id %d is in use already; ignored", self.device, command.id)
                return
            self._held[command.id] = _Held(received=time.perf_counter())
        job, session = command.job, isinstance(command, ipc.OpenSession)
        bounded = command.bounded if isinstance(command, ipc.Submit) else True
        if job.reference is not None:
            self._references.put((command.id, job, session, bounded))  # encoded one at a time, in order
            return
        if job.voice is not None:
            voice = self.model.voices.get(job.voice)
            if voice is None:
                self._finish(command.id, unknown_voice(job.voice, self.model.voices))
                return
        else:
            voice = self.model.voices.get(self.settings.default_voice)
        self._enqueue(command.id, job, (voice,) if voice is not None else (), session, bounded)

    def _encode_references(self) -> None:
        """The reference thread: zero-shot recordings encoded one at a time (the engine's cache
        of them is this thread's alone), then the request is queued unless cancelled meanwhile."""
        while (item := self._references.get()) is not None:
            id, job, session, bounded = item
            with self._lock:
                held = self._held.get(id)
            if held is None:
                continue  # cancelled before its turn
            try:
                reference = self.model.engine.encode_reference(job.reference, job.reference_text or "")
            except InputError as exc:
                self._finish(id, HTTPError(422, f"reference audio: {exc}"))
                continue
            except Exception as exc:  # the GPU's memory (503), or a bug (500)
                self._finish(id, engine_error(exc))
                continue
            self._enqueue(id, job, (reference,), session, bounded)

    def _enqueue(self, id: int, spec: ipc.JobSpec, references: tuple, session: bool, bounded: bool) -> None:
        """Hand the job to the engine (under the lock, so a cancel either finds its ticket or stops it here)."""
        from fish_sm.engine.batching import EngineStopped, Job, Overloaded

        try:
            job = Job(spec.text, references=references, chunk_length=spec.chunk_length, adapter=spec.adapter,
                      stream=spec.stream or session,
                      params=SamplingParams(temperature=spec.temperature, top_p=spec.top_p,
                                            repetition_penalty=spec.repetition_penalty,
                                            max_new_tokens=spec.max_new_tokens, seed=spec.seed))
        except InputError as exc:
            self._finish(id, HTTPError(400, str(exc)))
            return
        sink = self._sink(id)
        with self._lock:
            held = self._held.get(id)
            if held is None or held.cancelled:
                return
            try:
                if session:
                    held.ticket = self.batcher.open_session(job, sink)
                else:
                    held.ticket = self.batcher.submit(job, sink, bounded=bounded)
            except Overloaded as exc:
                error: HTTPError | None = Busy(str(exc), exc.retry_after_s)
            except (InputError, AdapterError) as exc:
                error = engine_error(exc)
            except EngineStopped as exc:
                error = HTTPError(503, str(exc))
            else:
                error = None
                if session:
                    self._send(ipc.Opened(id))
        if error is not None:
            self._finish(id, error)

    def _speak(self, id: int, text: str) -> None:
        from fish_sm.engine.batching import EngineStopped

        session = self._ticket(id)
        if session is None or not hasattr(session, "speak"):
            return  # cancelled or finished meanwhile: its text has nobody to be spoken to
        try:
            session.speak(text)
        except InputError as exc:
            self._send(ipc.Failed(id, 400, str(exc), final=False))
        except EngineStopped as exc:
            self._finish(id, HTTPError(503, str(exc)))

    def _ticket(self, id: int):
        with self._lock:
            held = self._held.get(id)
            return held.ticket if held is not None else None

    def _finish(self, id: int, error: HTTPError) -> None:
        """Fail request `id` with `error` (if still held): its last event."""
        with self._lock:
            held = self._held.pop(id, None)
        if held is not None:
            self._send(self._failed(id, error, held))

    @staticmethod
    def _failed(id: int, error: HTTPError, held: _Held) -> ipc.Failed:
        return ipc.Failed(id, error.status, _message(error), retry_after_s=getattr(error, "retry_after_s", None),
                          adapter=isinstance(error, AdapterFailed), timings=held.timings(),
                          accepted_s=held.accepted_s())

    def _report_load(self) -> None:
        """Have the sender look at the engine's occupancy at least every POLL_MS (a cancelled
        request frees its slot with no event of its own)."""
        now = time.monotonic()
        if now - self._load_checked >= POLL_MS / 1000:
            self._load_checked = now
            self._outbox.put(_CHECK_LOAD)

    def _load_event(self) -> ipc.Load | None:
        """The engine's occupancy if it changed since last sent (the sender's alone, so what it
        last sent is what the front end has: /ping shows it, and the metrics)."""
        if self.batcher is None:
            return None
        load = self.batcher.load()
        counts = (load["active"], load["waiting"])
        if counts == self._load:
            return None
        self._load = counts
        return ipc.Load(*counts)

    # -- events ------------------------------------------------------------------------------

    def _sink(self, id: int):
        """The engine's sink for request `id`: called from its threads, so it only queues."""
        outbox = self._outbox

        def sink(event) -> None:
            outbox.put((id, event))

        return sink

    def _send(self, event: ipc.Event, samples: np.ndarray | None = None) -> None:
        self._outbox.put((event, samples))

    def _send_events(self) -> None:
        """The sender thread: it alone writes the events socket (zmq sockets are not thread-safe),
        each batch of queued events as one message."""
        events = self._context.socket(zmq.PUSH)
        events.connect(self.addresses.events)
        try:
            while True:
                item = self._outbox.get()
                batch, stop = [], item is None
                while item is not None:
                    out = self._translated(item)
                    if out is not None:
                        batch.append(out)
                    if len(batch) >= BATCH_EVENTS:
                        break
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    stop = item is None
                stopped = self._stopped()
                if stopped is not None:
                    batch.insert(0, (stopped, None))
                load = self._load_event()  # with every batch: an admission or an end changes it
                if load is not None:
                    batch.append((load, None))
                if batch:
                    events.send_multipart(ipc.encode_events(batch), copy=False)
                if stop:
                    return
        except Exception:  # nothing more can reach the front end: the core exits (`_serve`), which it notices
            logger.exception("%s: the events socket failed", self.device)
            self._sender_failed = True
        finally:
            events.close(linger=LINGER_MS)

    def _translated(self, item) -> tuple[ipc.Event, np.ndarray | None] | None:
        """`_event`, or for an event it cannot translate (a bug), its request's failure (500)."""
        try:
            return self._event(item)
        except Exception:
            logger.exception("%s: an engine event could not be sent", self.device)
            if item is _CHECK_LOAD or not isinstance(item[0], int):
                return None
            with self._lock:
                held = self._held.pop(item[0], None)
            if held is None:
                return None
            return self._failed(item[0], HTTPError(500, "internal error; see the server log"), held), None

    def _event(self, item) -> tuple[ipc.Event, np.ndarray | None] | None:
        """An outbox item as the event to send: ours as they are, the engine's (id, (kind, payload))
        translated; None for a request no longer held (cancelled, or failed already). A request's
        last event ("done", "error") lets it go."""
        if item is _CHECK_LOAD:
            return None  # (the batch's load is looked at anyway)
        first, second = item
        if not isinstance(first, int):
            return first, second
        id, (kind, payload) = first, second
        with self._lock:
            held = self._held.get(id)
        if held is None:
            return None
        if kind == "audio":
            first_audio = not held.audio_sent
            held.audio_sent = True
            return ipc.Audio(id, held.timings() if first_audio else None, held.accepted_s()), payload
        if kind == "admitted":
            return ipc.Admitted(id, held.timings(), held.accepted_s()), None
        if kind == "spoken":
            return ipc.Spoken(id, int(payload)), None
        if kind == "cleared":
            return ipc.Cleared(id), None
        if kind == "done":
            event = ipc.Done(id, int(payload.frames), float(payload.seconds), float(payload.rtf),
                             {k: float(v) for k, v in payload.timings.items()}, held.accepted_s())
        elif kind == "error":
            event = self._failed(id, engine_error(payload), held)
        else:
            logger.warning("%s: unknown engine event %r for request %d", self.device, kind, id)
            return None
        with self._lock:
            if self._held.pop(id, None) is None:
                return None  # failed meanwhile (`_finish`): that was its last event
        return event, None


def _message(error: HTTPError) -> str:
    """The message without what `Busy` adds (the front end makes its own `Busy` of it)."""
    if isinstance(error, Busy):
        return error.message.rsplit("; retry after", 1)[0]
    return error.message


# -- the process -----------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux); then make sure the parent
    did not die before that was asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the receive loop's parent check remains
    if os.getppid() != parent:
        os._exit(1)


def _since_interpreter_start() -> float:
    """Seconds since this process started (Linux's /proc: its start in clock ticks after boot;
    0 where there is none)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter() - _since_interpreter_start()
    parser = argparse.ArgumentParser(prog="python -m fish_sm.serving.core", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", required=True, help="cuda:N, cpu, or auto (the first device there is)")
    parser.add_argument("--commands", required=True, help="the ipc:// address to bind and read commands from")
    parser.add_argument("--events", required=True, help="the front end's ipc:// address to send events to")
    parser.add_argument("--parent", type=int, required=True, help="the front end's pid")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains first, then sends Shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(args.parent)
    settings = Settings.from_env()
    logging.basicConfig(level=settings.log_level, format=LOG_FORMAT)
    addresses = ipc.CoreAddresses(args.commands, args.events)
    core = Core(args.model_dir, args.device, addresses, settings, parent=args.parent, began=began)
    return core.run()


if __name__ == "__main__":
    sys.exit(main())

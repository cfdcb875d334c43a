"""The front end's handle on its engine cores (`serving/core.py`): starting each as a process of
its own, sending it requests and reading their events (`serving/ipc.py`), the requests it holds,
and what happens when it stops.

Whether a core is full is the core's to say (its engine's own rule on its exact counts; the
refusal comes back as the request's first event, a millisecond later): counts kept here lag
behind it (a slot is free before the codec's last audio arrives), and refusing on them would
turn away requests the engine has room for. The counts here only route requests. A core that
exits (or says its engine stopped) fails every request it held with a 503, cuts short the streams
already answering, and is never restarted: the instance reports unhealthy and SageMaker replaces
it, as it did when an engine thread died in one process. No torch here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import zmq
import zmq.asyncio

from fish_sm.serving import ipc
from fish_sm.serving.errors import AdapterFailed, Busy, HTTPError

logger = logging.getLogger("fish_sm.serving")

SHUTDOWN_TIMEOUT_S = 60.0  # for a core to stop its engine and exit once told to; then it is killed
UNHEALTHY = "the engine stopped after an internal error; this instance is unhealthy"


class StartFailure(Exception):
    """A core that could not start: its one-line reason, and whether its user can act on it."""

    def __init__(self, message: str, expected: bool):
        super().__init__(message)
        self.message, self.expected = message, expected


@dataclass
class Synthesized:
    """A finished synthesis as the front end has it (what `response.encode_prediction` reads)."""

    sample_rate: int
    frames: int
    seconds: float
    rtf: float
    timings: dict[str, float] = field(default_factory=dict)
    audio: np.ndarray | None = None


class CoreRequest:
    """A request (or session) on one core: its events in order on `events`, as (kind, payload):
    ("admitted", None), ("opened", None) (a session is queued), ("audio", float32 samples),
    ("spoken", i), ("cleared", None) (a session's clear took effect), ("rejected", HTTPError) (a
    session's sentence refused; it goes on), then
    ("done", Synthesized) or ("error", HTTPError)."""

    def __init__(self, core: "EngineCore", id: int, bounded: bool):
        self.core, self.id, self.bounded = core, id, bounded
        self.events: asyncio.Queue = asyncio.Queue()
        self.sent = time.perf_counter()
        self.ended = False
        self.timings: dict[str, float] = {}  # the core's: seconds from the engine taking it
        self.accepted_s = 0.0  # the core's time before the engine took it (a reference encoded)

    async def next_event(self, client) -> tuple[str, object]:
        """The next event from its core; ConnectionResetError as soon as the client (an aiohttp
        request) has gone. (A core that dies sends its requests an error event: nothing hangs.)"""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if client.transport is None or client.transport.is_closing():
                    raise ConnectionResetError("the client disconnected") from None

    def cancel(self) -> None:
        """Free its slot (the client left, or barged in); no more events come. A no-op once ended."""
        self.core.cancel(self)

    def speak(self, text: str) -> None:
        """One more sentence for a session (a no-op once it has ended: its end is on its way to
        the client); HTTPError (503) if its core no longer serves."""
        if not self.ended:
            self.core.send(self, ipc.Speak(self.id, text))

    def close(self) -> None:
        """No more text for a session (a no-op once it has ended: its end is on its way)."""
        if not self.ended and self.core.alive():
            self.core.send(self, ipc.Close(self.id))

    def clear(self) -> None:
        """Barge-in that keeps a session: what it was given so far is cut; "cleared" follows."""
        if not self.ended and self.core.alive():
            self.core.send(self, ipc.Clear(self.id))


def launch_process(model_dir: Path, device: str, addresses: ipc.CoreAddresses) -> subprocess.Popen:
    """A core as a process of its own (a fresh interpreter: nothing forked, nothing pickled),
    writing its log to ours. It reads nothing in `model_dir` until `EngineCore.verified`."""
    return subprocess.Popen([sys.executable, "-m", "fish_sm.serving.core", "--model-dir", str(model_dir),
                             "--device", device, "--commands", addresses.commands, "--events", addresses.events,
                             "--parent", str(os.getpid())])


# launch(model_dir, device, addresses) -> a process: .pid, .wait() (blocking, its exit status), .kill()
Launch = Callable[[Path, str, ipc.CoreAddresses], object]


class EngineCore:
    """One engine core as the front end sees it. States: starting, serving, stopped (its engine
    failed), stopping (told to shut down), exited."""

    def __init__(self, index: int, device: str, directory: Path, model_dir: Path, context: zmq.Context,
                 launch: Launch = launch_process):
        self.index, self.device = index, device
        self.addresses = ipc.CoreAddresses.of(directory, index)
        self.model_dir, self._context, self._launch = model_dir, context, launch
        self.state = "starting"
        self._told_to_stop = False  # sent Shutdown (a core still starting is killed instead)
        self.process = None
        self.pid: int | None = None
        self.returncode: int | None = None
        self.slots = self.max_queue = self.sample_rate = 0
        self.voices: list[str] = []
        self.requests: dict[int, CoreRequest] = {}
        self._ids = itertools.count(1)
        self._load = (0, 0)  # (active, waiting), as the core last said
        self._loop: asyncio.AbstractEventLoop | None = None
        self.hello: asyncio.Future | None = None  # ipc.Hello
        self.ready: asyncio.Future | None = None  # ipc.Ready
        self._exited: asyncio.Event | None = None
        self._events_socket: zmq.Socket | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._commands: zmq.Socket | None = None
        self._reader: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"engine core {self.index} ({self.device}, pid {self.pid})"

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind our socket, connect to the core's, and start its process (from the event loop's
        thread: PR_SET_PDEATHSIG follows the thread that started it)."""
        self._loop = asyncio.get_running_loop()
        self.hello, self.ready = self._loop.create_future(), self._loop.create_future()
        self._exited = asyncio.Event()
        self._events_socket = self._context.socket(zmq.PULL)
        self._events_socket.bind(self.addresses.events)
        self._events = zmq.asyncio.Socket.from_socket(self._events_socket)
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block the event loop (a core that stops reading has died)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.connect(self.addresses.commands)
        self.process = self._launch(self.model_dir, self.device, self.addresses)
        self.pid = self.process.pid
        self._reader = self._loop.create_task(self._read())
        threading.Thread(target=self._wait_for_exit, name=f"fish-sm-core-{self.index}-exit", daemon=True).start()

    def verified(self, token: str | None) -> None:
        """Let the core read the model directory: the package's token (`verify.verified_token`),
        or None for a plain checkpoint directory."""
        self._send(ipc.Verified(token))

    async def stop(self) -> None:
        """Tell a serving core to shut down and wait for it (killed after SHUTDOWN_TIMEOUT_S); kill
        one still starting at once (it holds no request). Then close our sockets."""
        if self.process is not None and self.returncode is None:
            if self.state in ("serving", "stopped"):
                self.state = "stopping"
                self._told_to_stop = True
                self._send(ipc.Shutdown())
                try:
                    await asyncio.wait_for(self._exited.wait(), SHUTDOWN_TIMEOUT_S)
                except asyncio.TimeoutError:
                    logger.error("%s did not stop within %g s; killed", self, SHUTDOWN_TIMEOUT_S)
            self.state = "stopping"
            if self.returncode is None:
                self.process.kill()
                await self._exited.wait()
        for future in (self.hello, self.ready):  # nobody waits any more
            if future is not None and not future.done():
                future.cancel()
            elif future is not None and not future.cancelled():
                future.exception()  # retrieved, so asyncio does not warn about it
        if self._reader is not None:
            self._reader.cancel()
        for sock in (self._events, self._commands):  # (closing `_events` closes the socket it wraps)
            if sock is not None:
                sock.close(linger=0)

    def _wait_for_exit(self) -> None:
        """A thread waiting for the process to end; the event loop is told."""
        code = self.process.wait()
        try:
            self._loop.call_soon_threadsafe(self._on_exit, code)
        except RuntimeError:
            pass  # the event loop is closed: the server has stopped

    def _on_exit(self, code: int) -> None:
        self.returncode = code
        stopping = self.state == "stopping"
        self.state = "exited"
        self._exited.set()
        if self._reader is not None:
            self._reader.cancel()
        self._drain()  # events it sent before it ended
        for future in (self.hello, self.ready):
            if not future.done():
                future.set_exception(StartFailure(f"the engine core for {self.device} exited with status {code} "
                                                  "before it was ready", expected=False))
        served = self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None
        if stopping:  # (a core killed while starting, when the start failed elsewhere, is not news)
            logger.log(logging.INFO if self._told_to_stop else logging.DEBUG, "%s stopped (exit status %s)", self, code)
        elif served:
            logger.error("%s exited with status %s; %s", self, code, "this instance is unhealthy")
        self._fail_all(503, f"the engine core on {self.device} has stopped; this instance is unhealthy")

    # -- requests ------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.state == "serving"

    def in_flight(self) -> int:
        return len(self.requests)

    def load(self) -> dict:
        """Its occupancy as the core last said (for /ping and the state metrics)."""
        return {"slots": self.slots, "active": self._load[0], "waiting": self._load[1], "max_queue": self.max_queue}

    def submit(self, job: ipc.JobSpec, bounded: bool = True) -> CoreRequest:
        """Send a request (`bounded=False`: queued beyond the queue's bound, a JSON Lines line)."""
        return self._new(ipc.Submit, job, bounded)

    def open_session(self, job: ipc.JobSpec) -> CoreRequest:
        """Open a session; wait for its "opened" (or "error") before speaking into it."""
        return self._new(ipc.OpenSession, job, True)

    def _new(self, kind, job: ipc.JobSpec, bounded: bool) -> CoreRequest:
        if not self.alive():
            raise HTTPError(503, UNHEALTHY)
        request = CoreRequest(self, next(self._ids), bounded)
        self.requests[request.id] = request
        self._send(kind(request.id, job, bounded) if kind is ipc.Submit else kind(request.id, job))
        return request

    def send(self, request: CoreRequest, command: ipc.Command) -> None:
        """A command about a request in flight (Speak, Close); 503 if the core no longer serves."""
        if not self.alive():
            raise HTTPError(503, UNHEALTHY)
        self._send(command)

    def cancel(self, request: CoreRequest) -> None:
        if request.ended:
            return
        self._end(request)
        if self.alive():
            self._send(ipc.Cancel(request.id))

    def forget_adapter(self, name: str) -> None:
        if self.alive():
            self._send(ipc.ForgetAdapter(name))

    def _send(self, command: ipc.Command) -> None:
        try:
            self._commands.send(ipc.encode_command(command), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # (with no high-water mark, only a closed socket)
            raise HTTPError(503, f"{UNHEALTHY} ({exc})") from None

    def _end(self, request: CoreRequest) -> None:
        request.ended = True
        self.requests.pop(request.id, None)

    def _fail_all(self, status: int, message: str) -> None:
        for request in list(self.requests.values()):
            self._end(request)
            request.events.put_nowait(("error", HTTPError(status, message)))

    # -- events ---------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            frames = await self._events.recv_multipart()
            self._dispatch(frames)

    def _drain(self) -> None:
        """Whatever is already queued on the events socket, without waiting."""
        while True:
            try:
                frames = self._events_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self._dispatch(frames)

    def _dispatch(self, frames: list) -> None:
        try:
            batch = ipc.decode_events(frames)
        except ipc.BadMessage as exc:
            logger.warning("%s: a message that is not an event was ignored (%s)", self, exc)
            return
        for event, samples in batch:
            try:
                self._on_event(event, samples)
            except Exception:  # one bad event must not stop the reader (and so every request)
                logger.exception("%s: event %r failed", self, type(event).__name__)

    def _on_event(self, event: ipc.Event, samples: np.ndarray | None) -> None:
        if isinstance(event, (ipc.Admitted, ipc.Opened, ipc.Audio, ipc.Spoken, ipc.Cleared, ipc.Done, ipc.Failed)):
            request = self.requests.get(event.id)
            if request is not None:  # else cancelled, or ended by our side already
                self._on_request_event(request, event, samples)
        elif isinstance(event, ipc.Load):
            self._load = (event.active, event.waiting)
        elif isinstance(event, ipc.Hello):
            self.device = event.device
            if not self.hello.done():
                self.hello.set_result(event)
        elif isinstance(event, ipc.Ready):
            self.slots, self.max_queue, self.sample_rate = event.slots, event.max_queue, event.sample_rate
            self.voices = list(event.voices)
            if self.state == "starting":
                self.state = "serving"
            if not self.ready.done():
                self.ready.set_result(event)
        elif isinstance(event, ipc.StartFailed):
            failure = StartFailure(event.message, event.expected)
            for future in (self.hello, self.ready):
                if not future.done():
                    future.set_exception(failure)
        elif isinstance(event, ipc.Stopped):
            if self.state == "serving":
                self.state = "stopped"
            logger.error("%s: %s; %s", self, event.message, UNHEALTHY)

    def _on_request_event(self, request: CoreRequest, event, samples) -> None:
        timings = getattr(event, "timings", None)
        if timings:
            request.timings.update(timings)
            request.accepted_s = event.accepted_s
        if isinstance(event, ipc.Audio):
            request.events.put_nowait(("audio", samples))
        elif isinstance(event, ipc.Admitted):
            request.events.put_nowait(("admitted", None))
        elif isinstance(event, ipc.Spoken):
            request.events.put_nowait(("spoken", event.index))
        elif isinstance(event, ipc.Cleared):
            request.events.put_nowait(("cleared", None))
        elif isinstance(event, ipc.Opened):
            request.events.put_nowait(("opened", None))
        elif isinstance(event, ipc.Done):
            self._end(request)
            request.events.put_nowait(("done", Synthesized(self.sample_rate, event.frames, event.seconds, event.rtf,
                                                           dict(event.timings))))
        elif isinstance(event, ipc.Failed):
            if event.retry_after_s is not None:
                error = Busy(event.message, event.retry_after_s)
            else:
                error = AdapterFailed(event.message) if event.adapter else HTTPError(event.status, event.message)
            if event.final:
                self._end(request)
                request.events.put_nowait(("error", error))
            else:
                request.events.put_nowait(("rejected", error))

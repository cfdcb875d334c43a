"""BatchEngine: the batching engine's public face and its two threads.

The engine thread repeats one iteration of three calls: `_schedule` (under the lock: wait for
work, retire cancelled requests, then the scheduler moves waiting requests into free slots and
says whose next chunk starts), `_execute` (the runner: their prefills and first frames, then
one decode step for every slot that wants a frame, queued on the GPU) and `_update` (the
scheduler's stop checks on the frames queued before, read in one copy while that step runs;
the step's codes go to the codec thread in one message, finished requests leave their slots).
Each iteration's host time, outside its waits for the GPU and for work, is counted (`stats`)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from fish_sm.contract import check_text
from fish_sm.errors import AdapterError, FishSMError, InputError
from fish_sm.engine.generate import WaitClock
from fish_sm.engine.batching.codec_worker import CodecWorker
from fish_sm.engine.batching.request import EngineStopped, Event, Job, Session, Ticket
from fish_sm.engine.batching.runner import START_BATCH, ModelRunner
from fish_sm.engine.batching.scheduler import Request, Schedule, Scheduler, StepRows

if TYPE_CHECKING:  # (the engine builds batching engines over itself: no import at run time)
    from fish_sm.engine.engine import Engine

logger = logging.getLogger("fish_sm.batching")


# Codec streams at once per slot: a stream outlives its slot while its last pieces decode, and a
# session parked between sentences keeps its stream without a slot (a lane is ~4% of a slot's
# memory; admissions wait for a lane beyond these).
LANES_PER_SLOT = 2


# The codec's graphs captured before serving: batches of at most this many pieces (a first
# request's, and a few more); the others by the codec's capturing thread once serving.
CODEC_START_ROWS = 2


def codec_lanes(slots: int) -> int:
    """Codec streams at once for `slots` slots."""
    return LANES_PER_SLOT * slots + 4


class BatchEngine:
    """Iteration-level scheduling over an `Engine`'s model (which it takes over: the
    KV cache is re-made with one row per slot)."""

    def __init__(self, engine: Engine, max_batch: int = 64, max_queue: int | None = None,
                 prefix_cache: int = 8, memory_fraction: float = 0.9, first_piece: int = 4, largest_piece: int = 64,
                 codec_precision: str = "auto", forced_lengths: bool = False, horizon_s: float = 2.0,
                 step_rows: int = 0, piece_repeats: int = 1):
        engine.attach(self)  # before the KV cache is re-made: a batching engine before this one stops
        self.engine, self.model = engine, engine.model
        self.device = engine.device
        self._codec = CodecWorker(engine, first_piece, largest_piece, codec_precision, piece_repeats=piece_repeats)
        # The codec's working memory is measured before the slots are sized around it, and
        # its per-stream state is counted with each slot's (`codec_lanes`).
        self.runner = ModelRunner(engine, max_batch, memory_fraction, prefix_cache, self._codec.codec.working_bytes,
                                  self._codec.lane_bytes() * LANES_PER_SLOT)
        slots = self.runner.slots
        self._codec.allocate(codec_lanes(slots))
        # forced_lengths: benchmarks only (FISH_SM_BENCHMARK_LENGTHS), see Scheduler.
        codec = engine.codec
        self.scheduler = Scheduler(slots, slots if max_queue is None else max_queue, self.model.im_end_id,
                                   self.runner.new_generator, forced_lengths,
                                   frame_rate=codec.sample_rate / codec.frame_length, horizon_s=horizon_s,
                                   pieces=self._codec.codec.schedule, step_rows=step_rows, adapters=engine.adapters,
                                   codebooks=engine.config.num_codebooks, max_frames=self.runner.max_seq_len,
                                   lanes_free=self._codec.lanes.free)
        self._codec.lanes.on_release = self._wake
        self._codec.on_captured = self._wake  # an idle loop waiting for the capture lock tries again
        self.runner.bind(self.scheduler.table, self.scheduler.requests)
        self._lock = threading.Condition()
        if engine.adapters is not None:  # an adapter read on its own thread wakes the loop for its request
            engine.adapters.on_ready = self._wake
        self._running = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the engine thread, if it failed
        self.stats = StepStats(launched=lambda: self.runner.launch_s)
        # The decode loop's CUDA stream, of high priority: the codec's large kernels (on a
        # stream of their own) would otherwise hold the SMs that each of a decode step's ~1,100
        # small kernels waits for, stretching every stream's frames.
        self.decode_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None

    @property
    def slots(self) -> int:
        return self.runner.slots

    @property
    def max_queue(self) -> int:
        return self.scheduler.max_queue

    @property
    def max_seq_len(self) -> int:
        return self.runner.max_seq_len

    @property
    def batch_sizes(self) -> list[int]:
        return self.runner.batch_sizes

    @property
    def steps(self) -> int:
        """Decode steps run so far."""
        return self.runner.steps

    # -- lifecycle ------------------------------------------------------------------

    def compile(self, capture_all: bool = False) -> None:
        """Capture the decode step for the small batch sizes and every attention bucket, their
        admissions and the codec's small batches (CUDA), now rather than on a request: what a
        first few requests use. The others are captured once serving: the decode steps' between
        two steps when there is time (`ModelRunner.capture_due`), the codec's by a thread of its
        own (`CodecWorker.capture`); `capture_all`: every graph now."""
        if self.device.type != "cuda":
            return
        seconds = self.runner.capture(self.slots if capture_all else START_BATCH)
        t0 = time.perf_counter()
        self._codec.capture(None if capture_all else CODEC_START_ROWS)
        # The warm-up runs before each capture leave blocks cached: hand back what no graph holds.
        torch.cuda.empty_cache()
        step = self.runner.captured
        logger.info("batching: captured %d decode, %d admission and %d codec graphs in %.1f s (batch sizes to %d; "
                    "%d decode and %d codec shapes more once serving); %.1f GiB of %.1f GiB free", len(step.graphs),
                    len(step.admissions), self._codec.codec.graphs, seconds + time.perf_counter() - t0,
                    self.runner.ready_sizes[-1], len(self.runner._to_capture), len(self._codec.codec.pending_captures),
                    *(b / 2**30 for b in torch.cuda.mem_get_info(self.device)))

    def start(self) -> "BatchEngine":
        # The decode loop and the codec thread hand the GIL to each other many times a
        # frame; Python's default 5 ms switch interval would stall the loop behind the codec.
        sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
        self._running = True
        if self.decode_stream is not None:  # after the set-up work queued on this thread's stream
            self.decode_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._codec.start()
        self._thread = threading.Thread(target=self._loop, name="fish-sm-batching", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._running = False
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._codec.stop()
        if self.decode_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- the public side ---------------------------------------------------------------

    def submit(self, job: Job, sink: Callable[[Event], None] | None = None, bounded: bool = True) -> Ticket:
        """Queue a job; raises `Overloaded` at once when no slot and no queue place is free.
        `bounded=False` queues it beyond `max_queue`, for a caller that keeps at most one job
        waiting at a time (the lines of a JSON Lines body): it never takes another client's place."""
        check_text(job.text, job.chunk_length)
        self._check_adapter(job)
        ticket = Ticket(job, sink)
        ticket.bounded = bounded
        ticket.on_cancel = self._cancelled
        with self._lock:
            if not self.alive():
                raise EngineStopped("the batching engine is not running" if self.failure is None else
                                    f"the batching engine stopped after an internal error ({type(self.failure).__name__})")
            self.scheduler.add(ticket)
            self._lock.notify_all()
        return ticket

    def open_session(self, job: Job, sink: Callable[[Event], None] | None = None) -> Session:
        """Queue a session (`Session`): a streamed request whose sentences arrive by `speak`,
        its job's text (if any) the first. Raises `Overloaded` as `submit` does."""
        if not job.stream:
            raise InputError("a session streams its audio: its job needs stream=True")
        self._check_adapter(job)
        session = Session(job, sink, self._speak, self._close, self._clear)
        session.on_cancel = self._cancelled
        if job.text.strip():
            session.texts.append(job.text.strip())
        check_text("session", job.chunk_length)
        with self._lock:
            if not self.alive():
                raise EngineStopped("the batching engine is not running")
            self.scheduler.add(session)
            self._lock.notify_all()
        return session

    def _check_adapter(self, job: Job) -> None:
        if job.adapter is not None and self.engine.adapters is None:
            raise AdapterError(f"adapter {job.adapter!r}: this server serves no adapters")

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _speak(self, session: Session, text: str) -> None:
        check_text(text, session.job.chunk_length)
        with self._lock:
            if session.closed:
                raise InputError("the session is closed: it takes no more text")
            if not self.alive():
                raise EngineStopped("the batching engine is not running")
            session.texts.append(text.strip())
            self.scheduler.sentence_added(session)
            self._lock.notify_all()

    def _close(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            self.scheduler.session_closed(session)
            self._lock.notify_all()

    def _clear(self, session: Session) -> None:
        """Barge-in that keeps the session (any thread): an active session is cut at the next
        iteration (which this wakes), and its codec stream says "cleared" once the audio before
        it is out; a waiting one will start after what was cut."""
        with self._lock:
            if session.cancelled:
                return
            session.skip_to = len(session.texts)
            if not self.scheduler.clear(session):
                session.emit("cleared", None)
            self._lock.notify_all()

    def _cancelled(self, ticket: Ticket) -> None:
        """A ticket was cancelled (any thread): its slot is freed at the next iteration, which
        this wakes (an idle engine would otherwise hold a cancelled session's slot until other
        work came)."""
        with self._lock:
            self.scheduler.cancel(ticket)
            self._lock.notify_all()

    def finished(self) -> bool:
        """Started once and no longer serving (stopped, or failed)."""
        return self._thread is not None and not self.alive()

    def alive(self) -> bool:
        """Both threads running: false for good once either has failed."""
        return (self._running and self._thread is not None and self._thread.is_alive() and self._codec.alive()
                and self.failure is None)

    def load(self) -> dict:
        with self._lock:
            return {"slots": self.slots, "active": self.scheduler.num_active, "waiting": self.scheduler.num_waiting,
                    "max_queue": self.max_queue}

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        """The engine thread. Whatever escapes the loop (a bug, not a request's problem) stops
        the engine: every request it holds fails and `alive()` turns false, so the server
        reports unhealthy and the platform replaces it, rather than hanging on requests."""
        try:
            self._serve()
        except BaseException as exc:  # logged here; the thread then ends quietly
            logger.exception("the batching engine failed; it serves no more requests")
            self._stop_serving(exc)

    def _stop_serving(self, exc: BaseException) -> None:
        with self._lock:
            self.failure, self._running = exc, False
            waiting = self.scheduler.take_all_waiting()
            self._lock.notify_all()
        error = EngineStopped(f"the batching engine stopped after an internal error ({type(exc).__name__})")
        for request in self.scheduler.drop_active():
            request.ticket.emit("error", error)
        for ticket in waiting:
            ticket.emit("error", error)

    def _serve(self) -> None:
        pending: list[StepRows] = []  # frames queued by the last iteration's step, checked in this one
        on_stream = torch.cuda.stream(self.decode_stream) if self.decode_stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), on_stream:
            while True:
                began = self.stats.clocks()
                schedule = self._schedule(pending)
                if schedule is None:
                    break
                try:
                    first, step = self._execute(schedule)
                    at = time.perf_counter()
                    self._update(pending + first)  # while `step` runs on the GPU
                    self.stats.lap("update", at)
                    pending = step
                    self.stats.step(bool(step), began)
                    idle = not step and not first
                    due = self.runner.capture_due(idle)
                    self._codec.capture_lock.urge(due and not idle)  # the codec's captures wait meanwhile
                    captured = due and self._capture_next(wait=not idle)
                    if idle and not captured:
                        self._wait_for_turn()
                except Exception as exc:  # a failure of the shared step fails every request in it
                    logger.exception("batching step failed")
                    if self.device.type == "cuda" and isinstance(exc, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
                    for request in self.scheduler.active():
                        self._fail(request, exc)
                    pending = []
        for request in self.scheduler.active():
            self._fail(request, FishSMError("the server is shutting down"))
        for ticket in self.scheduler.waiting():
            ticket.emit("error", FishSMError("the server is shutting down"))

    def _schedule(self, pending: list[StepRows]) -> Schedule | None:
        """Wait for work, then the scheduler's decisions for this iteration (under the lock);
        None once the engine stops. Cancelled requests leave their slots first, so that waiting
        ones can take them; requests whose own set-up failed get their error here."""
        with self._lock:
            while self._running and not self.scheduler.has_work() and not pending:
                if self.runner.capturing:
                    break  # idle: capture the next graph (below, after an empty step)
                with self.stats.waiting():
                    self._lock.wait()
            if not self._running:
                return None
            if not self._codec.alive():
                raise EngineStopped("the codec worker has stopped")
            for request in self.scheduler.take_cancelled():
                self._retire(request)
            for request in self.scheduler.take_cleared():
                self.scheduler.cut(request)
                self._codec.clear(request.lane)
            at = time.perf_counter()
            schedule = self.scheduler.schedule()
            self.stats.lap("schedule", at)
        for ticket, exc in schedule.refused:
            ticket.emit("error", exc)
        return schedule

    def _capture_next(self, wait: bool) -> bool:
        """One graph between two steps, once the codec's capturing thread lets go of the capture
        lock (one capture at a time); `wait`: for the lock (the load needs the graph), else only
        if it is free (idle: the codec's capture, when done, wakes the loop to try again)."""
        if not self._codec.capture_lock.acquire(blocking=wait, urgent=True):
            return False
        try:
            self.runner.capture_next()
        finally:
            self._codec.capture_lock.release()
        return True

    def _wait_for_turn(self) -> None:
        """Nothing was decoded (every stream has its listener's horizon buffered): wait until the
        first of them needs a frame, or new work arrives."""
        with self._lock:
            if self.runner.capturing and not self._codec.capture_lock.locked():
                return  # the codec's capture ended before this wait: capture now
            if self.scheduler.num_waiting:  # a lane given back then wakes this wait
                self._codec.lanes.starved = True
            wait = self.scheduler.next_turn_in()
            if self._running and wait > 0:
                self._lock.wait(timeout=None if wait == math.inf else wait)

    def _execute(self, schedule: Schedule) -> tuple[list[StepRows], list[StepRows]]:
        """The model's work for one iteration: the admitted requests' sampling parameters into
        their slots, the prefills of the chunks that start (with their first frames), then one
        decode step for every slot that wants a frame. Returns the first frames and the step's
        frames, both still on their way to the host."""
        at = time.perf_counter()
        for request in schedule.admitted:
            self._admit(request)
            self._park_if_idle(request)  # a session opened with no text yet waits for it without a slot
        at = self.stats.lap("admit", at)
        first = self._start_chunks(schedule.starting)
        at = self.stats.lap("prefill", at)
        slots = self.scheduler.decoding()
        step = self.runner.decode(slots)
        self.scheduler.advance(slots)
        self.stats.lap("step", at)
        return first, step

    def _update(self, steps: list[StepRows]) -> None:
        """Stop checks and delivery for frames queued earlier, a step at a time: its codes go
        to the codec in one message, then each request whose chunk ended is handled (a
        session's sentence end, a request complete)."""
        for rows in steps:
            with self.stats.waiting(gpu=True):
                frames = rows.frames()  # the one wait for the GPU an iteration has
            checked = self.scheduler.check(rows, frames)
            if checked.lanes.size:
                self._codec.frames(checked.lanes, checked.codes)
            for ended in checked.ended:
                if ended.sentence_end:  # the sentence's frames, then its end, to the codec
                    self._codec.end_sentence(ended.request.lane, ended.request.chunk)
                if ended.complete:
                    self._complete(ended.request)
                elif ended.sentence_end:
                    self._park_if_idle(ended.request)
        with self._lock:
            ended_sessions = self.scheduler.ended_sessions()
            parked_ended = self.scheduler.take_parked_ended()
        for request in ended_sessions:
            self._complete(request)
        for request in parked_ended:  # a parked session closed with nothing left, or cancelled
            if request.ticket.cancelled:
                self._codec.cancel(request.lane)
            else:
                self._complete(request)
            self.scheduler.let_go(request)

    def _park_if_idle(self, request: Request) -> None:
        """A session whose sentence ended with no next one queued gives its slot back until one
        comes (its codec stream, context and random stream stay): an idle session holds no row."""
        if not isinstance(request.ticket, Session):
            return
        with self._lock:
            if (not request.retired and request.chunk + 1 >= len(request.chunks)
                    and not request.ticket.closed and not request.ticket.cancelled):
                self.scheduler.park(request)

    def _admit(self, request: Request) -> None:
        if request.lane >= 0:  # a parked session back for its next sentence: its stream is open
            return
        request.ticket.timings["queue"] = time.perf_counter() - request.ticket.submitted
        request.ticket.emit("admitted", None)
        request.lane = self.scheduler.table.lane[request.slot] = self._codec.lanes.take()
        self._codec.open(request.lane, request.ticket)

    def _start_chunks(self, requests: list[Request]) -> list[StepRows]:
        """Prefill each request's next chunk into its slot and sample that chunk's first frame
        (`ModelRunner.prefill`). A request whose prompt fails fails alone, after the others
        started."""
        failed, ready = [], []
        for request in requests:
            self.scheduler.next_chunk(request)
            try:
                prompt, max_new, start = self.runner.prepare_chunk(request)
            except (InputError, torch.cuda.OutOfMemoryError) as exc:
                failed.append((request, exc))
                continue
            self.scheduler.chunk_started(request, prompt.shape[1], max_new)
            ready.append((request, prompt, start))
        first, out_of_memory = self.runner.prefill(ready)
        for request, exc in failed + out_of_memory:
            self._fail(request, exc)
        return first

    def _complete(self, request: Request) -> None:
        ticket = request.ticket
        ticket.timings["generate"] = time.perf_counter() - ticket.submitted - ticket.timings.get("queue", 0.0)
        self._codec.finish(request.lane, request.spoken)
        if not request.parked:
            self._retire(request, to_codec=False)

    def _fail(self, request: Request, exc: Exception) -> None:
        request.ticket.emit("error", exc)
        self._retire(request)

    def _retire(self, request: Request, to_codec: bool = True) -> None:
        """Free the request's slot at once (nothing else moves); unless it completed (its codec
        stream then finishes), its codec stream is dropped."""
        if request.retired:
            return
        lane = request.lane
        self.scheduler.retire(request)
        if to_codec and lane >= 0:
            self._codec.cancel(lane)
        with self._lock:
            self._lock.notify_all()


class StepStats:
    """The engine thread's iterations: how many decoded, their wall time, and the part of it
    spent waiting (for the GPU's frames, or for work): the rest is host time. Of the host time,
    `cpu_s` is the thread's own CPU time (Python and launches); what is left is time it was ready
    to run but did not (waiting for the GIL, which the codec thread shares). The CPU its waits
    took (`wait_cpu_s`) is the driver spinning in them: a core kept busy, not host work."""

    PHASES = ("schedule", "admit", "prefill", "step", "update")

    def __init__(self, launched: Callable[[], float] = lambda: 0.0):
        self.steps = 0
        self.iterations = 0
        self.wall_s = self.cpu_s = 0.0
        self.waits = WaitClock()  # every wait inside an iteration: for work, for a step's frames
        self.gpu_waits = WaitClock()  # of them, those for a step's frames
        # Wall seconds by phase of an iteration: the scheduler's decisions, admissions (their
        # codec streams opened), prefills with first frames, the decode step
        # queued (with `decoding` and `advance`), and stop checks with the codec's hand-off (less
        # the wait for the GPU's frames).
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)
        # Of the step phase, the decode step's launch (its graph's replay, or the eager step):
        # the runner's count, read when a snapshot is taken.
        self.launched = launched

    @staticmethod
    def clocks() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def step(self, decoded: bool, began: tuple[float, float]) -> None:
        wall, cpu = self.clocks()
        self.iterations += 1
        self.steps += decoded
        self.wall_s += wall - began[0]
        self.cpu_s += cpu - began[1]

    @contextlib.contextmanager
    def waiting(self, gpu: bool = False):
        """Around a wait inside an iteration (the CPU it took, a driver's spin, is not host work
        either): for work, or (`gpu`) for a step's frames."""
        with self.waits, self.gpu_waits if gpu else contextlib.nullcontext():
            yield

    def lap(self, phase: str, since: float) -> float:
        """Count the wall time from `since` to now to `phase`; returns now."""
        now = time.perf_counter()
        self.phase_s[phase] += now - since
        return now

    def snapshot(self) -> dict:
        waits = self.waits
        phases = dict(self.phase_s, update=self.phase_s["update"] - self.gpu_waits.wall_s)
        return {"steps": self.steps, "iterations": self.iterations, "wall_s": self.wall_s, "wait_s": waits.wall_s,
                "host_s": self.wall_s - waits.wall_s, "host_cpu_s": self.cpu_s - waits.cpu_s,
                "wait_cpu_s": waits.cpu_s, "phases_s": phases, "launch_s": self.launched()}

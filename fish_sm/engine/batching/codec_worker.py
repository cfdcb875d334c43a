"""The batching engine's codec thread: codes to audio in scheduled pieces, many requests' pieces
batched, on a thread and CUDA stream of its own beside the decode loop.

Each request's stream has a lane, a row of arrays (frames received and decoded, its piece
index, when its next piece became ready, its listener's audio) and of a ring of codes: a step's
frames come in as one message and are written into the ring at once, which pieces are due is
worked out over all lanes by array operations, and a batch of pieces goes to the GPU in one
copy and comes back in one. Only a piece decoded, a sentence ended or a stream finished is
handled one request at a time."""

from __future__ import annotations

import contextlib
import heapq
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from fish_sm.engine.codec_stream import PartlyRun, Pieces, StreamingCodec
from fish_sm.engine.synthesis import Synthesis
from fish_sm.engine.generate import WaitClock, to_device
from fish_sm.engine.batching.request import EngineStopped, Ticket

if TYPE_CHECKING:  # (the engine builds batching engines over itself: no import at run time)
    from fish_sm.engine.engine import Engine

logger = logging.getLogger("fish_sm.batching")

# While a batch is on the GPU, a piece whose listener has more than SPARE_S seconds of audio left
# waits for it, unless a piece of its length is urgent or fills a batch; a whole request's
# piece waits up to WHOLE_WAIT_S (`_launch`, `_deadlines`).
SPARE_S, WHOLE_WAIT_S = 0.3, 0.5
RING_FRAMES = 256  # frames a lane holds before the ring grows (a stream whose codec falls behind)


class Lanes:
    """Lane numbers for the codec's streams, `capacity` of them (the codec's state is sized
    for that many streams at once): taken by the engine's thread at admission, given back by
    the codec's thread once a stream's last audio is out. `on_release` is called then while
    the engine waits for one (admissions beyond the lanes wait)."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._free: list[int] = []
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._next = 0
        self.on_release: Callable[[], None] | None = None
        self.starved = False  # the engine left work waiting for a lane

    def _collect(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                heapq.heappush(self._free, self._released.get_nowait())

    def free(self) -> int:
        """Lanes that `take` can give now (the engine's thread)."""
        self._collect()
        return len(self._free) + self.capacity - self._next

    def take(self) -> int:
        self._collect()
        if self._free:
            return heapq.heappop(self._free)
        if self._next >= self.capacity:
            raise RuntimeError(f"every one of the codec's {self.capacity} lanes is taken")
        self._next += 1
        return self._next - 1

    def release(self, lane: int) -> None:
        self._released.put(lane)
        if self.starved and self.on_release is not None:
            self.starved = False
            self.on_release()


class CaptureLock:
    """One CUDA graph capture at a time, between the engine's thread and the codec's capturing
    thread, the engine's first: while it needs graphs for the load it serves (`urge`), the
    codec's thread starts no capture, so the engine waits at most for the one in progress. (A
    plain lock, which the codec's thread takes again as soon as it lets go, kept the engine
    waiting through every codec shape, ~1 s each, while the streams it serves stalled.)"""

    def __init__(self):
        self._changed = threading.Condition()
        self._held = False
        self._urged = False

    def urge(self, urgent: bool) -> None:
        """The engine's thread needs captures now (True), or no longer (False)."""
        if urgent != self._urged:
            with self._changed:
                self._urged = urgent
                self._changed.notify_all()

    def acquire(self, blocking: bool = True, urgent: bool = False) -> bool:
        """Take the lock (`blocking`: wait for it, else False at once when taken); a capture
        that is not `urgent` also waits while one is urged."""
        with self._changed:
            while self._held or (self._urged and not urgent):
                if not blocking:
                    return False
                self._changed.wait()
            self._held = True
            return True

    def release(self) -> None:
        with self._changed:
            self._held = False
            self._changed.notify_all()

    def locked(self) -> bool:
        return self._held

    def __enter__(self) -> "CaptureLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CodecWorker:
    """Codes to audio on a thread (and CUDA stream) of its own, piece by piece as frames
    arrive (`StreamingCodec`): streamed requests get each piece, the others one
    concatenation at the end. Before each batch everything queued is taken in; a batch is
    ready pieces, the most urgent first (by when each listener needs its audio), one per
    request, since a request's next piece needs the state its last one left: a lane with a
    piece in a batch on the GPU has none in the next. Up to `depth` batches are on the GPU at
    once; while one is, pieces with audio to spare wait for company (`_launch`)."""

    def __init__(self, engine: Engine, first_piece: int, largest_piece: int, precision: str = "auto", lanes: int = 0,
                 depth: int = 2, piece_repeats: int = 1):
        self.engine = engine
        # Batches queued on the GPU at once: with two, the thread delivers one batch's audio and
        # chooses the next while the GPU runs the one after (one: it waits for each in turn).
        if depth < 1:
            raise ValueError(f"codec depth {depth}: at least 1")
        self.depth = depth
        self._flying: list[_Batch] = []
        self.audio_waits = WaitClock()  # this thread's waits for its batches' audio to come home
        # auto: StreamingCodec's defaults (on a GPU, float16 throughout); float32: the codec's
        # own dtype throughout.
        if precision not in ("auto", "float32"):
            raise ValueError(f"codec precision {precision!r}: choose auto or float32")
        dtype = engine.codec.dtype
        exact = {"back_dtype": dtype, "front_dtype": dtype, "front_tf32": False} if precision == "float32" else {}
        self.codec = StreamingCodec(engine.codec, first_piece, largest_piece, repeats=piece_repeats, **exact)
        self.lanes = Lanes()  # sized by `allocate`
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._audio: list[_Audio | None] = []  # by lane
        self._state = _LaneState(0, engine.config.num_codebooks)
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the codec thread, if it failed
        self._cuda = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        # Pieces with audio to spare wait while a batch is on the GPU, so that under load the
        # codec decodes fewer, larger batches (its cost is per batch far more than per frame).
        self.spare_s, self.whole_wait_s = SPARE_S, WHOLE_WAIT_S
        # Frames in one batch at most: a first piece ready meanwhile waits behind it.
        self.max_frames = 2 * self.codec.max_batch_frames
        # Held while a graph is captured, by this worker's capturing thread and by the engine's
        # thread: one capture at a time, the engine's first.
        self.capture_lock = CaptureLock()
        self._capturer: threading.Thread | None = None
        self._stopping = False
        self.on_captured: Callable[[], None] | None = None  # called after each shape is captured (the lock free)
        if lanes:
            self.allocate(lanes)

    def lane_bytes(self) -> int:
        return self.codec.lane_bytes()

    def allocate(self, lanes: int) -> None:
        """State for `lanes` streams at once."""
        self.codec.allocate(lanes)
        self.lanes.capacity = lanes
        self._state = _LaneState(lanes, self.engine.config.num_codebooks)
        self._audio = [None] * lanes

    def capture(self, rows: int | None = None) -> None:
        """The codec's graphs for batches of at most `rows` pieces now (None: all); once
        started, a thread of its own captures the others, one shape at a time, while this
        worker's thread decodes (a shape's first run costs ~1 s, most of it cuDNN planning
        its convs: on the decoding thread it would hold up every stream's audio)."""
        with self._on_stream():
            self.codec.capture(rows)

    def _on_stream(self):
        return torch.cuda.stream(self._cuda) if self._cuda is not None else contextlib.nullcontext()

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fish-sm-codec", daemon=True)
        self._thread.start()
        if self.codec.capturing and self._capturer is None:
            self._capturer = threading.Thread(target=self._capture_rest, name="fish-sm-codec-capture", daemon=True)
            self._capturer.start()

    def stop(self) -> None:
        self._stopping = True
        self.capture_lock.urge(False)  # (the engine's thread has stopped: its urge no longer holds captures back)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if self._capturer is not None:
            self._capturer.join()
            self._capturer = None

    def _capture_rest(self) -> None:
        """The capturing thread: the graphs `capture` left, one shape at a time, until all are
        captured or the worker stops. A capture that fails is logged and no more are tried:
        batches without a graph run the compiled back and the eager front."""
        stream = torch.cuda.Stream(self.engine.device) if self._cuda is not None else None
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while self.codec.capturing and not self._stopping:
                with self.capture_lock:
                    if self._stopping:
                        break
                    try:
                        self.codec.capture_next()
                    except Exception:
                        logger.exception("codec: a graph capture failed; %d shapes left run without graphs",
                                         len(self.codec.pending_captures))
                        self.codec.pending_captures.clear()
                if self.on_captured is not None:
                    self.on_captured()
        if not self.codec.capturing:
            logger.info("codec: every graph captured (%d)", self.codec.graphs)

    # -- the engine's side: one message per call, taken in order --------------------------------

    def open(self, lane: int, ticket: Ticket) -> None:
        """A request's stream begins in `lane`."""
        self._queue.put(("open", lane, ticket))

    def frames(self, lanes: np.ndarray, codes: np.ndarray) -> None:
        """A step's frames: codes [rows, C] for the streams in `lanes` (one row each)."""
        self._queue.put(("frames", lanes, codes))

    def finish(self, lane: int, spoken: list[np.ndarray]) -> None:
        """The stream's last frames are in; `spoken`: the codes [C, frames] of each of its chunks."""
        self._queue.put(("finish", lane, spoken))

    def end_sentence(self, lane: int, index: int) -> None:
        """A session's sentence `index` ends with the frames handed over so far: its last piece
        is decoded as such, ("spoken", index) follows its audio, and the next sentence starts
        a codec stream of its own."""
        self._queue.put(("sentence", lane, index))

    def cancel(self, lane: int) -> None:
        self._queue.put(("cancel", lane, None))

    def clear(self, lane: int) -> None:
        """A session's barge-in: the frames not yet decoded are dropped, the next sentence starts
        a codec stream afresh, and ("cleared", None) follows the audio already out."""
        self._queue.put(("clear", lane, None))

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    # -- the codec's thread --------------------------------------------------------------------------

    def _run(self) -> None:
        """The codec thread; an error it cannot pin on a batch stops it (and, through
        `alive()`, the engine), failing the requests whose audio it held."""
        try:
            self._serve()
        except BaseException as exc:  # logged here; the thread then ends quietly
            logger.exception("the codec worker failed; it decodes no more audio")
            self.failure = exc
            error = EngineStopped(f"the codec worker stopped after an internal error ({type(exc).__name__})")
            for lane in self._open_lanes():
                self._drop(lane).ticket.emit("error", error)

    def _serve(self) -> None:
        with torch.inference_mode(), self._on_stream():
            stopping, waited = False, []
            while True:
                try:
                    # Take in what arrived, then keep `depth` batches on the GPU: the next one is
                    # chosen and queued before the last one's audio is waited for and delivered,
                    # so the GPU is not idle while this thread does that host work.
                    items, waited = waited + self._drain(), []
                    stopping = stopping or None in items
                    self._take_all(items)
                    if len(self._flying) < self.depth and self._launch() is not None:
                        continue
                    if self._flying:
                        self._finish(self._flying[0])
                        self._summarise_finished()
                        continue
                    self._summarise_finished()
                except Exception as exc:  # never a dead codec thread: whoever it held gets the error
                    logger.exception("codec worker failed")
                    self._flying.clear()
                    for lane in self._open_lanes():
                        self._drop(lane).ticket.emit("error", exc)
                if stopping:
                    return
                # Nothing on the GPU and nothing ready: wait for frames. (Outside the batch's
                # handling: a failure here stops the thread, see `_run`.)
                waited = [self._queue.get()]

    def _drain(self) -> list:
        items = []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self._queue.get_nowait())
        return items

    def _take_all(self, items: list) -> None:
        for item in items:
            if item is not None:  # (None: the stop sentinel)
                self._take(*item)

    def _take(self, kind: str, lane, payload) -> None:
        s = self._state
        if kind == "frames":
            lanes, codes = lane, payload
            keep = s.active[lanes]  # (frames may be handed over just before a cancel)
            if not keep.all():
                lanes, codes = lanes[keep], codes[keep]
            s.write(lanes, codes)
            return
        if kind == "open":
            self._audio[lane] = _Audio(payload)
            s.open(lane, payload.job.stream)
            return
        entry = self._audio[lane]
        if entry is None:
            return
        if kind == "cancel" or entry.ticket.cancelled:
            self._drop(lane)
        elif kind == "clear":  # (a batch in flight with its pieces is not delivered: `_finish`)
            s.consumed[lane] = s.received[lane]
            s.pieces[lane], s.ready_since[lane], s.sentence_left[lane] = 0, 0.0, -1
            s.flying[lane] = 0
            s.generation[lane] += 1
            entry.sentences.clear()
            entry.ticket.emit("cleared", None)
        elif kind == "sentence":  # (its frames in flight still count: their audio is not out yet)
            pending = int(s.received[lane] - s.consumed[lane] + s.flying[lane])
            entry.sentences.append([pending - sum(n for n, _ in entry.sentences), payload])
            self._sentences_done(lane, entry)
        else:
            s.finished[lane] = True
            entry.finished, entry.all_codes = time.perf_counter(), payload

    def _open_lanes(self) -> list[int]:
        return [lane for lane, entry in enumerate(self._audio) if entry is not None]

    def _drop(self, lane: int) -> "_Audio":
        """The lane's stream is over: its state goes and the lane is given back."""
        entry, self._audio[lane] = self._audio[lane], None
        self._state.active[lane] = False
        self._state.generation[lane] += 1  # (a batch in flight with its piece is not delivered: `_finish`)
        self.lanes.release(lane)
        return entry

    def _ready(self) -> tuple[np.ndarray, np.ndarray]:
        """Lanes with a piece ready and each one's scheduled piece length: a whole piece's
        frames are in, or the stream has finished (its last piece may be short), or a session's
        sentence ends within it (then the piece ends with the sentence)."""
        s = self._state
        lanes = np.flatnonzero(s.active & (s.flying == 0))  # (a lane's next piece needs its last one's state)
        if not lanes.size:
            return lanes, lanes
        need = self.codec.schedule.frames(s.pieces[lanes])
        sentence = s.sentence_left[lanes]
        need = np.where(sentence >= 0, np.minimum(need, sentence), need)
        pending = s.received[lanes] - s.consumed[lanes]
        ready = ((need > 0) & (pending >= need)) | (s.finished[lanes] & (pending > 0))
        return lanes[ready], need[ready]

    def _launch(self) -> "_Batch | None":
        """Queue one batch of ready pieces on the GPU, their audio's copy home with it; None when
        none is due. With no batch on the GPU every ready piece is due; with one there, only the
        pieces of a length that has an urgent piece or a full batch's worth (`_deadlines`): the
        others wait for company, so batches grow with the load. Pieces of several lengths share
        a batch (each length its own graphs), the most urgent first, up to `max_frames`."""
        s = self._state
        lanes, need = self._ready()
        if not lanes.size:
            return None
        now = time.perf_counter()
        s.ready_since[lanes] = np.where(s.ready_since[lanes] > 0, s.ready_since[lanes], now)
        deadline = self._deadlines(lanes, now)
        if self._flying:
            lengths, counts = np.unique(need, return_counts=True)
            full = lengths[counts >= [self.codec.rows_for(int(n)) for n in lengths]]
            due = np.union1d(need[deadline <= now + self.spare_s], full)
            keep = np.isin(need, due)
            lanes, need, deadline = lanes[keep], need[keep], deadline[keep]
            if not lanes.size:
                return None
        order = np.lexsort((lanes, deadline))
        lanes, need = lanes[order], need[order]
        within = np.cumsum(need) <= self.max_frames
        group, need = lanes[within], need[within]
        taken = np.minimum(s.received[group] - s.consumed[group], need)
        codes = s.read(group, int(need.max()))  # [rows, C, n]: past a row's own piece, not decoded
        s.consumed[group] += taken
        s.ready_since[group] = 0.0
        s.flying[group] = taken
        batch = _Batch(group, taken, s.generation[group].copy())
        try:
            batch.pieces = self._pieces(group, codes, taken)
        except Exception as exc:  # find the one that fails: each alone, from the state it had
            logger.exception("codec failed on a batch of %d pieces; retrying them one by one", len(group))
            batch.audio = self._retried(group, codes, taken, exc)
        self._flying.append(batch)
        return batch

    def _retried(self, lanes: np.ndarray, codes: np.ndarray, taken: np.ndarray, exc: Exception) -> list:
        """A failed batch's audio: the pieces whose batches ran before the failure as they came
        (`PartlyRun`: their lanes have moved on), the others one by one."""
        audio: list = [None] * len(lanes)
        retry = np.ones(len(lanes), bool)
        if isinstance(exc, PartlyRun):
            for rows, samples in exc.pieces.home():
                for row, one in zip(rows, samples):
                    audio[row], retry[row] = one, False
        again = np.flatnonzero(retry)
        for row, one in zip(again, self._one_by_one(lanes[again], codes[again], taken[again])):
            audio[row] = one
        return audio

    def _deadlines(self, lanes: np.ndarray, now: float) -> np.ndarray:
        """When each ready piece is wanted (time.perf_counter): a streamed piece when its listener
        will have played what it was given; a stream's first piece (a session's sentence's
        too, which a voice agent times its turn by), a piece that ends a sentence and a
        finished stream's last, at once (the client waits for them); a whole request's piece
        `whole_wait_s` after it was ready."""
        s = self._state
        at_once = (s.pieces[lanes] == 0) | s.finished[lanes] | (s.sentence_left[lanes] >= 0)
        playing = now + s.spare(lanes, now)
        whole = s.ready_since[lanes] + self.whole_wait_s
        return np.where(at_once, s.ready_since[lanes], np.where(s.stream[lanes], playing, whole))

    def _finish(self, batch: "_Batch") -> None:
        """Deliver a launched batch's pieces, each back batch's as soon as its audio is home (the
        shortest pieces first: a batch's long pieces do not hold up a stream's first ones),
        unless a piece's stream was cut (a clear) or ended (a cancel, its lane maybe taken by
        another stream) meanwhile."""
        self._flying.remove(batch)
        parts = [(range(len(batch.lanes)), batch.audio)] if batch.audio is not None else batch.pieces.home(self.audio_waits)
        s = self._state
        for rows, audio in parts:  # each back batch's pieces as soon as their audio is home
            for i, samples in zip(rows, audio):
                lane, frames = batch.lanes[i], batch.taken[i]
                if s.generation[lane] != batch.generations[i]:  # (a piece that failed alone ended its stream too)
                    continue
                entry = self._audio[lane]
                s.flying[lane] = 0
                s.pieces[lane] += 1
                self._deliver(lane, entry, samples)
                if entry.sentences:
                    entry.sentences[0][0] -= int(frames)
                    self._sentences_done(lane, entry)

    def _sentences_done(self, lane: int, entry: "_Audio") -> None:
        """Sentences whose audio is all out: their end is said, the next starts a new codec stream."""
        while entry.sentences and entry.sentences[0][0] <= 0:
            _, index = entry.sentences.pop(0)
            self._state.pieces[lane] = 0  # the next piece starts a codec stream afresh
            entry.ticket.emit("spoken", index)
        self._state.sentence_left[lane] = entry.sentences[0][0] if entry.sentences else -1

    def _summarise_finished(self) -> None:
        s = self._state
        for lane in np.flatnonzero(s.active & s.finished & (s.received == s.consumed) & (s.flying == 0)):
            self._summarise(self._drop(int(lane)))

    def _one_by_one(self, lanes: np.ndarray, codes: np.ndarray, taken: np.ndarray) -> list[np.ndarray | None]:
        """A batch that failed, piece by piece: the piece that fails again fails its request alone."""
        audio = []
        for i, lane in enumerate(lanes):
            try:
                audio += self._pieces(lanes[i : i + 1], codes[i : i + 1], taken[i : i + 1]).host()
            except Exception as exc:
                self._drop(lane).ticket.emit("error", exc)
                audio.append(None)
        return audio

    def _pieces(self, lanes: np.ndarray, codes: np.ndarray, taken: np.ndarray) -> Pieces:
        """One batch of pieces queued through the codec: their codes to the GPU in one copy
        (through pinned memory, `to_device`: a pageable copy waits for the whole batch inside
        the driver, and the decode loop's CUDA calls wait with it), each back batch's audio
        started home as soon as it is queued. A batch that raises leaves its streams' states as
        they were, but for those `PartlyRun` names (`StreamingCodec.push`)."""
        on_device = to_device(torch.from_numpy(codes), self.engine.device)
        return self.codec.push(lanes, self._state.pieces[lanes], on_device, taken, home=True)

    def _deliver(self, lane: int, entry: "_Audio", samples: np.ndarray) -> None:
        ticket = entry.ticket
        if ticket.job.stream:
            if "first_audio" not in ticket.timings:
                ticket.timings["first_audio"] = time.perf_counter() - ticket.submitted
                self._state.playing_since[lane] = time.perf_counter()
            self._state.given_s[lane] += len(samples) / self.engine.sample_rate
            ticket.emit("audio", samples)
        else:
            entry.audio.append(samples)

    def _summarise(self, entry: "_Audio") -> None:
        ticket, spoken = entry.ticket, entry.all_codes
        if not ticket.job.stream:
            ticket.emit("audio", np.concatenate(entry.audio) if entry.audio else np.zeros(0, np.float32))
        ticket.timings["decode"] = time.perf_counter() - entry.finished
        ticket.timings["total"] = time.perf_counter() - ticket.submitted
        codes = (torch.from_numpy(np.concatenate(spoken, axis=1)) if spoken
                 else torch.zeros(self.engine.config.num_codebooks, 0, dtype=torch.long))
        n = codes.shape[1]
        seconds = n * self.engine.frame_length / self.engine.sample_rate
        ticket.emit("done", Synthesis(audio=None, sample_rate=self.engine.sample_rate, frames=n, seconds=seconds,
                                      rtf=ticket.timings["total"] / seconds if seconds else float("inf"),
                                      timings=dict(ticket.timings), codes=codes))


@dataclass
class _Batch:
    """A batch of pieces queued on the GPU: its lanes, the frames each piece took, each lane's
    generation when it was queued, and its audio on the way home (`pieces`), or already home
    (`audio`: a failed batch retried piece by piece)."""

    lanes: np.ndarray
    taken: np.ndarray
    generations: np.ndarray
    pieces: Pieces | None = None
    audio: list | None = None


@dataclass
class _Audio:
    """What a lane's stream keeps besides its arrays: its ticket and, for a whole request,
    its audio so far."""

    ticket: Ticket
    audio: list = field(default_factory=list)
    finished: float = 0.0  # when its last frame was handed over (0: still decoding)
    all_codes: list = field(default_factory=list)
    # A session's ended sentences not yet all decoded: [frames of it still to decode, its index]
    sentences: list = field(default_factory=list)


class _LaneState:
    """The codec's per-lane arrays: frames received and decoded (counted from the stream's
    start), the ring of frames not yet decoded, piece index, and what `_deadlines` weighs."""

    def __init__(self, lanes: int, codebooks: int, ring: int = RING_FRAMES):
        self.codebooks = codebooks
        self.active = np.zeros(lanes, bool)
        self.stream = np.zeros(lanes, bool)  # audio streamed to a listener (else wanted whole)
        self.finished = np.zeros(lanes, bool)  # its last frame is in
        self.received = np.zeros(lanes, np.int64)
        self.consumed = np.zeros(lanes, np.int64)
        self.pieces = np.zeros(lanes, np.int64)  # pieces its codec stream has decoded (0: starts afresh)
        self.sentence_left = np.full(lanes, -1, np.int64)  # frames left in its first ended sentence (-1: none)
        self.flying = np.zeros(lanes, np.int64)  # frames of its piece in a batch on the GPU (0: none)
        self.generation = np.zeros(lanes, np.int64)  # moves on when its stream ends or is cut (a clear)
        self.ready_since = np.zeros(lanes)  # when its next piece's frames were all there (0: not yet)
        self.playing_since = np.zeros(lanes)  # its first audio (streamed)
        self.given_s = np.zeros(lanes)  # audio streamed so far, in seconds
        self.ring = np.zeros((lanes, codebooks, ring), np.int64)

    def open(self, lane: int, stream: bool) -> None:
        self.active[lane], self.stream[lane], self.finished[lane] = True, stream, False
        self.received[lane] = self.consumed[lane] = self.pieces[lane] = self.flying[lane] = 0
        self.sentence_left[lane] = -1
        self.ready_since[lane] = self.playing_since[lane] = self.given_s[lane] = 0.0

    def write(self, lanes: np.ndarray, codes: np.ndarray) -> None:
        """One frame each for these lanes (codes [rows, C])."""
        size = self.ring.shape[-1]
        if lanes.size and int((self.received[lanes] - self.consumed[lanes]).max()) >= size:
            self._grow_ring(2 * size)
            size = self.ring.shape[-1]
        self.ring[lanes, :, self.received[lanes] % size] = codes
        self.received[lanes] += 1

    def read(self, lanes: np.ndarray, n: int) -> np.ndarray:
        """The next `n` frames of each lane from where it has decoded to: [rows, C, n]."""
        at = (self.consumed[lanes][:, None] + np.arange(n)) % self.ring.shape[-1]
        return np.ascontiguousarray(self.ring[lanes[:, None], :, at].transpose(0, 2, 1))

    def _grow_ring(self, size: int) -> None:
        old = self.ring.shape[-1]
        at = self.consumed[:, None] + np.arange(old)  # every frame a lane can hold, from its oldest
        ring = np.zeros((len(self.active), self.codebooks, size), np.int64)
        rows = np.arange(len(self.active))[:, None]
        ring[rows, :, at % size] = self.ring[rows, :, at % old]
        self.ring = ring

    def spare(self, lanes: np.ndarray, now: float) -> np.ndarray:
        """Seconds of streamed audio a listener who began at the first piece has not reached yet."""
        started = self.playing_since[lanes] > 0
        return np.where(started, self.given_s[lanes] - (now - self.playing_since[lanes]), 0.0)

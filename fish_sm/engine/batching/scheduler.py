"""The batching engine's scheduler: which requests wait and which hold slots, where each one
is in its text, which of them decode at each step, and when they stop. No tensors: the
runner does the model's work for what it decides (`ModelRunner`).

A request holds one slot (its rows of the KV cache and its entry of the `SlotTable`) from
admission to its end; steps name the slots they decode, so a step may take any of the active
requests. The per-step work is array operations over the table (`decoding`, `advance`,
`check`): only requests with an event (admitted, a chunk starting or ending, a first frame,
a cancel) are touched one by one.

Listeners, not frames, set the order (`decoding`): a streamed request with more than
`horizon_s` seconds of slack (its listener's audio left to play, less the time to make its
next codec piece) yields its turn, the first frames of a new request go first, then streams by
least slack, then whole (non-streamed) requests, which fill the spare rows and gain priority
the longer they wait. While requests wait for a slot nobody yields: finishing early frees
slots. A waiting queue of bounded length holds the rest; beyond it `add` refuses at once
(`Overloaded`)."""

from __future__ import annotations

import collections
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import numpy as np

from fish_sm.contract import SamplingParams
from fish_sm.engine.batching.request import Overloaded, Session, Ticket
from fish_sm.engine.batching.slots import SlotTable
from fish_sm.engine.pieces import PieceSchedule
from fish_sm.engine.text import split_text
from fish_sm.errors import AdapterError


@dataclass
class Request:
    """What the engine keeps of an admitted ticket besides its `SlotTable` entry: its text,
    its random stream and the codes of its finished chunks."""

    ticket: Ticket
    chunks: list[str]
    generator: object  # its random stream (a torch.Generator the runner makes and draws from)
    slot: int = -1
    lane: int = -1  # its stream's lane in the codec worker
    adapter_slot: int = 0  # the slot of its LoRA adapter, held while it is active (0: none)
    chunk: int = -1  # index into chunks; -1 before the first prefill
    previous: list[tuple[str, np.ndarray]] = field(default_factory=list)  # the last chunk's text and codes [C, frames]
    spoken: list[np.ndarray] = field(default_factory=list)  # the codes [C, frames] of each finished chunk
    # Frames of noise its random stream owes before the next chunk: a request decoded at every step
    # draws one frame past <|im_end|> (queued before the check); one that yielded that step did not.
    owed_draws: int = 0
    # A session between sentences gives its slot back (`Scheduler.park`): parked, it keeps the rest
    # here (`draws`: its noise frames drawn) until its next sentence brings it back.
    parked: bool = False
    draws: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.ticket.job.params

    @property
    def retired(self) -> bool:
        return self.slot < 0


class AdapterGate(Protocol):
    """The adapters a request may name (the engine's `AdapterCache`): whether one can be
    claimed now, its slot held until released (None: not yet), raising for one that cannot
    be served."""

    def ready(self, name: str | None) -> bool: ...

    def claim(self, name: str | None) -> int | None: ...

    def release(self, slot: int) -> None: ...


class StepRows(NamedTuple):
    """Rows of frames queued on the GPU (a decode step's, or the first frames of chunks that
    started): for row i, the slot, its generation and chunk when queued, and which frame of
    the chunk it is; `frames()` waits for the rows' codes [rows, 1 + C] on the host."""

    slots: np.ndarray
    generation: np.ndarray
    chunk: np.ndarray
    index: np.ndarray
    frames: Callable[[], np.ndarray]


@dataclass
class Schedule:
    """What one iteration does besides decoding: requests admitted into slots, those whose
    own set-up failed (with why), and those whose next chunk of text starts."""

    admitted: list[Request]
    refused: list[tuple[Ticket, Exception]]
    starting: list[Request]


@dataclass
class Ended:
    """A request whose chunk ended with a checked frame: whether that completed the request
    (all its chunks spoken) and whether it ended a session's sentence."""

    request: Request
    complete: bool
    sentence_end: bool


@dataclass
class Checked:
    """A step's verdict: the codes to deliver (their codec lanes and codes [rows, C]) and the
    requests whose chunk ended, in row order."""

    lanes: np.ndarray
    codes: np.ndarray
    ended: list[Ended]


class Scheduler:
    """The waiting queue, the slots and each request's progress. `add`, `schedule` and the
    counts run under the engine's lock; the rest on the engine's thread."""

    def __init__(self, slots: int, max_queue: int, im_end: int, generator: Callable[[int | None], object],
                 forced_lengths: bool = False, frame_rate: float = 21.5, horizon_s: float = 2.0,
                 pieces: PieceSchedule = PieceSchedule(), step_rows: int = 0, clock: Callable[[], float] = time.perf_counter,
                 adapters: AdapterGate | None = None, codebooks: int = 1, max_frames: int = 1,
                 lanes_free: Callable[[], int] | None = None):
        self.slots, self.max_queue = slots, max_queue
        self.lanes_free = lanes_free  # the codec's free lanes: a request takes one at admission
        self.im_end = im_end  # the code that ends a chunk
        # Listener-aware turns (`decoding`): frames a second of audio; seconds of slack a stream may
        # have before it yields (0: nobody yields); the codec's pieces of a stream (audio reaches
        # the listener a whole piece at a time; frames before the first piece go first); most rows
        # a step (0: all).
        self.frame_rate, self.horizon_s, self.step_rows = frame_rate, horizon_s, step_rows
        self.pieces = pieces
        self.clock = clock
        self.step_s = 0.0  # recent seconds between two decode steps (a moving average)
        self._last_step: float | None = None
        # Benchmarks only (FISH_SM_BENCHMARK_LENGTHS): <|im_end|> ends nothing, every chunk runs to
        # its max_new frames, so random weights load the GPU with the lengths a benchmark intends.
        self.forced_lengths = forced_lengths
        self._generator = generator  # a request's random stream, from its seed
        self.adapters = adapters
        self.table = SlotTable(slots, codebooks, max_frames)
        self.requests: list[Request | None] = [None] * slots  # by slot
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._free = list(range(slots))  # a heap: the lowest free slot is taken first
        self._cancelled: list[Request] = []  # active requests cancelled since the last schedule
        self._cleared: list[Request] = []  # active sessions cleared (barge-in) since the last schedule
        # Sessions parked between sentences (no slot); those with a new sentence, to admit first;
        # those that ended while parked (closed with nothing left, or cancelled), to let go.
        self._parked: dict[int, Request] = {}  # by id()
        self._returning: collections.deque[Request] = collections.deque()
        self._parked_ended: list[Request] = []
        self._closed: set[int] = set()  # slots of sessions closed while active, to end once all is spoken

    # -- the queue ----------------------------------------------------------------------

    def add(self, ticket: Ticket) -> None:
        """Queue a ticket; raises `Overloaded` when it is bounded and no slot and no queue place is free."""
        waiting = sum(t.bounded for t in self._waiting)
        if ticket.bounded and waiting >= len(self._free) + self.max_queue:
            raise Overloaded(f"all {self.slots} slots are busy and {self.max_queue} requests wait already",
                             retry_after_s=1)
        self._waiting.append(ticket)

    @property
    def num_active(self) -> int:
        return self.slots - len(self._free)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return (bool(self._waiting) or bool(self._returning) or bool(self._parked_ended) or bool(self._cleared)
                or len(self._free) < self.slots)

    def _room(self) -> int:
        """Requests that can be admitted now: each takes a free slot and a free codec lane."""
        room = len(self._free)
        return min(room, self.lanes_free()) if room and self.lanes_free is not None else room

    def active(self) -> list[Request]:
        return [r for r in self.requests if r is not None]

    def waiting(self) -> list[Ticket]:
        return list(self._waiting)

    def take_all_waiting(self) -> list[Ticket]:
        waiting, self._waiting = list(self._waiting), collections.deque()
        return waiting

    def drop_active(self) -> list[Request]:
        """Every active request and parked session, let go of without moving any (the engine has stopped)."""
        active = self.active() + self.parked()
        self.requests = [None] * self.slots
        self.table.active[:] = False
        self._parked.clear()
        return active

    # -- events from other threads (under the engine's lock) ----------------------------------

    def cancel(self, ticket: Ticket) -> None:
        """A ticket was cancelled: an active one leaves its slot at the next schedule (a waiting
        one is dropped when it would be admitted; a parked one is let go)."""
        request = getattr(ticket, "request", None)
        if request is not None and request.parked:
            self._unpark(request)
            self._parked_ended.append(request)
        elif request is not None and not request.retired:
            self.table.cancelled[request.slot] = True
            self._cancelled.append(request)

    def clear(self, session: Session) -> bool:
        """A session was cleared (barge-in): True when it is active or parked, to be cut at the
        next schedule (`take_cleared`, `cut`); a waiting one starts after what was cut (`skip_to`)."""
        request = getattr(session, "request", None)
        if request is None or (request.retired and not request.parked):
            return False
        self._cleared.append(request)
        return True

    def take_cleared(self) -> list[Request]:
        cleared, self._cleared = [r for r in self._cleared if r.parked or not r.retired], []
        return cleared

    def cut(self, request: Request) -> None:
        """Cut a cleared session's sentences (the engine's thread): the one being spoken ends now
        (frames queued for it are dropped), those queued are skipped, and the next sentence
        starts without the cut one as its context."""
        request.chunk = request.ticket.skip_to - 1
        request.previous = []
        if not request.parked:
            t, slot = self.table, request.slot
            t.finished_chunk[slot] = True
            t.chunk[slot] = request.chunk

    def sentence_added(self, session: Session) -> None:
        """A session's text list grew: an active session has one more chunk to speak; a parked
        one comes back, ahead of the waiting tickets."""
        request = getattr(session, "request", None)
        if request is not None and request.parked:
            if not self._is_returning(request):
                self._returning.append(request)
        elif request is not None and not request.retired:
            self.table.chunks[request.slot] = len(request.chunks)

    def session_closed(self, session: Session) -> None:
        request = getattr(session, "request", None)
        if request is not None and request.parked:
            if not self._is_returning(request):  # nothing left to speak: it ends while parked
                self._unpark(request)
                self._parked_ended.append(request)
        elif request is not None and not request.retired:
            self._closed.add(request.slot)

    # -- sessions between sentences ------------------------------------------------------------

    def park(self, request: Request) -> None:
        """A session with nothing more to speak for now gives its slot back (the engine's thread,
        under its lock); it keeps its context, spoken codes and random stream's place."""
        request.draws = int(self.table.draws[request.slot])
        self._free_slot(request.slot)
        request.slot, request.parked = -1, True
        self._parked[id(request)] = request

    def _is_returning(self, request: Request) -> bool:
        """A parked session already queued to come back for a new sentence."""
        return any(r is request for r in self._returning)

    def _unpark(self, request: Request) -> None:
        request.parked = False
        self._parked.pop(id(request), None)

    def parked(self) -> list[Request]:
        return list(self._parked.values())

    def let_go(self, request: Request) -> None:
        """A parked session that ended: its adapter is given back."""
        self._release_adapter(request.adapter_slot)
        request.adapter_slot = 0

    def take_parked_ended(self) -> list[Request]:
        """Parked sessions that ended (closed with nothing left, or cancelled) since the last call."""
        ended, self._parked_ended = self._parked_ended, []
        return ended

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def _readmit(self, request: Request, slot: int) -> None:
        """A parked session back in a slot, where it left off (its next chunk starts now)."""
        self._unpark(request)
        ticket = request.ticket
        params = ticket.job.params
        self.table.admit(slot, stream=True, session=True, chunks=len(request.chunks),
                         seed=_seed(request.generator), adapter=request.adapter_slot,
                         now=self.clock(), sampling=(params.temperature, params.top_p, params.repetition_penalty))
        self.table.chunk[slot], self.table.draws[slot] = request.chunk, request.draws
        self.table.lane[slot] = request.lane  # its codec stream stayed open while it was parked
        request.slot = slot
        self.requests[slot] = request
        if ticket.closed:
            self._closed.add(slot)

    # -- one iteration ------------------------------------------------------------------

    def schedule(self) -> Schedule:
        """Waiting tickets into free slots, and the requests whose next chunk starts now
        (those just admitted and those done with a chunk that have another)."""
        admitted, refused = self._take_waiting()
        starting = [self.requests[slot] for slot in self.table.starting()]
        return Schedule(admitted, refused, starting)

    def take_cancelled(self) -> list[Request]:
        """Active requests cancelled since the last call, to retire."""
        cancelled, self._cancelled = [r for r in self._cancelled if not r.retired], []
        return cancelled

    def _take_waiting(self) -> tuple[list[Request], list[tuple[Ticket, Exception]]]:
        """Waiting tickets moved into free slots, and those whose own text, parameters or
        adapter could not be set up, with why: they fail alone. A ticket whose adapter is still
        being read keeps its place while those behind it go ahead."""
        taken, refused, held = [], [], []
        while self._returning and self._free:  # parked sessions with a new sentence first (their lane is theirs)
            request = self._returning.popleft()
            if request.parked:
                self._readmit(request, heapq.heappop(self._free))
                taken.append(request)
        room = len(taken) + self._room()
        while self._waiting and len(taken) < room:
            ticket = self._waiting.popleft()
            if ticket.cancelled:
                continue
            try:
                adapter_slot = self._claim_adapter(ticket)
            except Exception as exc:
                refused.append((ticket, exc))
                continue
            if adapter_slot is None:
                held.append(ticket)
                continue
            try:
                session = isinstance(ticket, Session)
                # A session's chunks are its sentences, a list that grows as they arrive.
                chunks = ticket.texts if session else split_text(ticket.job.text, ticket.job.chunk_length)
                generator = self._generator(ticket.job.params.seed)
            except Exception as exc:
                self._release_adapter(adapter_slot)
                refused.append((ticket, exc))
                continue
            request = Request(ticket, chunks, generator, adapter_slot=adapter_slot)
            request.slot = heapq.heappop(self._free)
            seed = _seed(generator)
            params = ticket.job.params
            self.table.admit(request.slot, stream=ticket.job.stream, session=session, chunks=len(chunks), seed=seed,
                             adapter=adapter_slot, now=self.clock(),
                             sampling=(params.temperature, params.top_p, params.repetition_penalty))
            request.chunk = self.table.chunk[request.slot] = getattr(ticket, "skip_to", 0) - 1  # (after a clear)
            self.requests[request.slot] = request
            ticket.request = request
            if session and ticket.closed:
                self._closed.add(request.slot)
            taken.append(request)
        self._waiting.extendleft(reversed(held))
        return taken, refused

    def _claim_adapter(self, ticket: Ticket) -> int | None:
        name = ticket.job.adapter
        if name is None:
            return 0
        if self.adapters is None:
            raise AdapterError(f"adapter {name!r}: this engine serves no adapters")
        return self.adapters.claim(name)

    def _release_adapter(self, adapter_slot: int) -> None:
        if adapter_slot and self.adapters is not None:
            self.adapters.release(adapter_slot)

    def _admissible(self, ticket: Ticket) -> bool:
        """A waiting ticket that a free slot could take now (its adapter, if any, read)."""
        return ticket.job.adapter is None or self.adapters is None or self.adapters.ready(ticket.job.adapter)

    def next_chunk(self, request: Request) -> None:
        request.chunk += 1
        self.table.chunk[request.slot] = request.chunk

    def chunk_started(self, request: Request, length: int, max_new: int) -> None:
        """The request's chunk is prefilled from a prompt of `length` tokens, its first frame
        sampled with it, and it may have `max_new` frames."""
        t, slot = self.table, request.slot
        t.length[slot], t.max_new[slot], t.computed[slot] = length, max_new, 1
        t.finished_chunk[slot] = False
        t.frames[slot] += 1
        t.last_turn[slot] = self.clock()

    def decoding(self) -> np.ndarray:
        """The slots that decode a frame at this step, most urgent first: those that want one,
        less the streams whose listeners have more than `horizon_s` of audio ahead (unless
        requests wait for a slot), at most `step_rows` of them."""
        slots = self.table.wanting()
        if not slots.size:
            return slots
        slack = self.slack(slots, self.clock())
        crowded = bool(self._waiting) and not self._free  # finishing sooner frees a slot for them
        if self.horizon_s > 0 and not crowded:
            keep = slack <= self.horizon_s  # the others' listeners have enough to play: they yield
            slots, slack = slots[keep], slack[keep]
        slots = slots[np.lexsort((slots, slack))]
        return slots[: self.step_rows] if self.step_rows > 0 else slots

    def next_turn_in(self) -> float:
        """Seconds until there is work: 0 when a ticket can take a slot, a chunk can start, a
        request was cancelled or wants a frame now; else until the first stream that yields
        wants one again (inf: nothing to do until something arrives)."""
        if self._returning and self._free:
            return 0.0
        if self._waiting and self._room() and any(self._admissible(t) for t in self._waiting):
            return 0.0
        if self._parked_ended or self._cleared:
            return 0.0
        if self._cancelled or self.table.starting().size or self.ended_sessions():
            return 0.0
        if self.decoding().size:
            return 0.0
        slots = self.table.wanting()
        if not slots.size:
            return math.inf
        return max(float(np.min(self.slack(slots, self.clock()))) - self.horizon_s, 0.0)

    def slack(self, slots: np.ndarray, now: float) -> np.ndarray:
        """How long each slot's request can go without a frame, in seconds. A stream: until its
        listener has played the audio of its finished codec pieces, less the steps that
        finishing its next piece takes at the recent pace (-inf before its first audio). A
        session: -inf (a voice agent's turn: each sentence as soon as it can be). A whole
        request: `horizon_s` less how long it has waited since its last frame (it waits behind
        streams with more slack than that)."""
        t = self.table
        frames = t.frames[slots]
        audible, next_piece = self.pieces.around(frames)  # frames in its finished pieces; where its next one ends
        with np.errstate(invalid="ignore"):
            stream = t.playing[slots] + audible / self.frame_rate - now - (next_piece - frames) * self.step_s
        silent = np.isnan(stream) | (frames < self.pieces.first) | t.session[slots]
        stream = np.where(silent, -np.inf, stream)
        return np.where(t.stream[slots], stream, self.horizon_s - (now - t.last_turn[slots]))

    def advance(self, slots: np.ndarray) -> None:
        """A step has queued one more frame for each of these slots."""
        now = self.clock()
        if slots.size:
            if self._last_step is not None:  # idle gaps count as at most 0.1 s: a step takes less
                self.step_s += 0.1 * (min(now - self._last_step, 0.1) - self.step_s)
            self._last_step = now
        t = self.table
        t.computed[slots] += 1
        t.frames[slots] += 1
        t.last_turn[slots] = now

    def check(self, rows: StepRows, frames: np.ndarray) -> Checked:
        """The stop checks for rows of frames queued earlier, all at once: <|im_end|> (unless
        lengths are forced: then its frame's codes are spoken like any other's) or the chunk's
        last frame ends the chunk, the last chunk's end completes the request. Rows queued past
        their chunk's end, or for a request that left its slot, are dropped."""
        t, slots = self.table, rows.slots
        live = (t.active[slots] & (t.generation[slots] == rows.generation) & (t.chunk[slots] == rows.chunk)
                & ~t.finished_chunk[slots] & ~t.cancelled[slots])
        end = live & (frames[:, 0] == self.im_end) if not self.forced_lengths else np.zeros_like(live)
        deliver = live & ~end
        last = deliver & (rows.index + 1 >= t.max_new[slots])
        spoken, at = slots[deliver], rows.index[deliver]
        codes = frames[deliver, 1:]
        t.codes[spoken, :, at] = codes
        first = spoken[np.isnan(t.playing[spoken])]
        if first.size:  # first audio on its way: the listener starts playing
            now = self.clock()
            t.playing[first] = now
            for slot in first:
                timings = self.requests[slot].ticket.timings
                timings.setdefault("first_frame", time.perf_counter() - self.requests[slot].ticket.submitted)
        ended = []
        for i in np.flatnonzero(end | last):
            request, index = self.requests[slots[i]], int(rows.index[i])
            if end[i]:
                request.owed_draws = min(index + 2, int(t.max_new[request.slot])) - int(t.computed[request.slot])
            complete = self._finish_chunk(request, index if end[i] else index + 1)
            ended.append(Ended(request, complete, bool(t.session[request.slot])))
        return Checked(t.lane[spoken], codes, ended)

    def _finish_chunk(self, request: Request, frames: int) -> bool:
        """End the request's chunk after `frames` frames (its codes become the next prompt's
        context); True when it was the last."""
        self.table.finished_chunk[request.slot] = True
        codes = self.table.codes[request.slot, :, :frames].astype(np.int64)
        request.previous = [(request.chunks[request.chunk], codes)] if frames else []
        if frames:
            request.spoken.append(codes)
        return self._all_spoken(request)

    @staticmethod
    def _all_spoken(request: Request) -> bool:
        """No chunk left to speak, and (a session) no more text to come."""
        ticket = request.ticket
        return request.chunk + 1 >= len(request.chunks) and (not isinstance(ticket, Session) or ticket.closed)

    def ended_sessions(self) -> list[Request]:
        """Sessions closed while waiting for their next sentence, with nothing left to speak."""
        t, ended = self.table, []
        for slot in list(self._closed):
            request = self.requests[slot]
            if request is None:
                self._closed.discard(slot)
            elif t.finished_chunk[slot] and not t.cancelled[slot] and self._all_spoken(request):
                ended.append(request)
        return ended

    def retire(self, request: Request) -> None:
        """Free the request's slot (it must hold one)."""
        self._free_slot(request.slot)
        self._release_adapter(request.adapter_slot)
        request.slot, request.adapter_slot = -1, 0

    def _free_slot(self, slot: int) -> None:
        """The slot holds no request now (one that left, or a session parked)."""
        self.requests[slot] = None
        self.table.free(slot)
        self._closed.discard(slot)
        heapq.heappush(self._free, slot)


def _seed(generator) -> int:
    return generator.initial_seed() if hasattr(generator, "initial_seed") else 0

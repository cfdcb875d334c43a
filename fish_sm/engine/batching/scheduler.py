"""The batching engine's scheduler: which requests wait and which hold slots, where each one
is in its text, which of them decode at each step, and when they stop. Plain Python over
requests, no tensors: the runner does the model's work for what it decides (`ModelRunner`).

A request holds one slot (its rows of the KV cache and step state) from admission to its end;
steps name the slots they decode, so a step may take any of the active requests. Listeners,
not frames, set the order (`decoding`): a streamed request with more than `horizon_s` seconds
of slack (its listener's audio left to play, less the time to make its next codec piece)
yields its turn, the first frames of a new request go first, then streams by least slack,
then whole (non-streamed) requests, which fill the spare rows and gain priority the longer
they wait. While requests
wait for a slot nobody yields: finishing early frees slots. A waiting queue of bounded length
holds the rest; beyond it `add` refuses at once (`Overloaded`)."""

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
from fish_sm.engine.text import split_text
from fish_sm.errors import AdapterError


@dataclass
class Request:
    """A ticket's state while the engine holds it."""

    ticket: Ticket
    chunks: list[str]
    generator: object  # its random stream (a torch.Generator the runner makes and draws from)
    slot: int = -1
    draws: int = 0  # frames of noise drawn so far (the counter of `kernels.noise_key`)
    chunk: int = -1  # index into chunks; -1 before the first prefill
    length: int = 0  # prompt tokens of the current chunk
    max_new: int = 0
    computed: int = 0  # frames of this chunk computed (queued) so far
    finished_chunk: bool = True  # no more frames wanted from this chunk
    codes: list[np.ndarray] = field(default_factory=list)  # this chunk's frames, [C] each
    previous: list[tuple[str, np.ndarray]] = field(default_factory=list)  # the last chunk's text and codes [C, frames]
    spoken: list[np.ndarray] = field(default_factory=list)  # the frames of all finished chunks
    frames: int = 0  # frames queued so far, all chunks together
    playing: float | None = None  # when its listener's playback began (its first frame checked; perf_counter)
    last_turn: float = 0.0  # when it last had a frame queued (perf_counter)
    # Frames of noise its random stream owes before the next chunk: the sequential engine draws one
    # frame past <|im_end|> (queued before the check); a request that yielded that step did not.
    owed_draws: int = 0
    adapter_slot: int = 0  # the slot of its LoRA adapter, held while it is active (0: none)

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


class Frames(Protocol):
    """Sampled frames on their way to the host (the runner's `HostFrames`)."""

    def row(self, i: int) -> np.ndarray: ...


class Queued(NamedTuple):
    """A frame queued on the GPU: whose, which chunk and frame of it, and where to read it."""

    request: Request
    chunk: int
    index: int  # frame of the chunk
    row: int  # row of `frames`
    frames: Frames


@dataclass
class Schedule:
    """What one iteration does besides decoding: requests admitted into slots, those whose
    own set-up failed (with why), and those whose next chunk of text starts."""

    admitted: list[Request]
    refused: list[tuple[Ticket, Exception]]
    starting: list[Request]


@dataclass
class Checked:
    """A queued frame's verdict: its codes to deliver, if any; whether its request was
    cancelled (to retire) or is now complete (all its chunks spoken); whether a session's
    sentence (chunk) ended with it."""

    codes: np.ndarray | None = None
    cancelled: bool = False
    complete: bool = False
    sentence_end: bool = False


class Scheduler:
    """The waiting queue, the slots and each request's progress. `add`, `schedule` and the
    counts run under the engine's lock; the rest on the engine's thread."""

    def __init__(self, slots: int, max_queue: int, im_end: int, generator: Callable[[int | None], object],
                 forced_lengths: bool = False, frame_rate: float = 21.5, horizon_s: float = 2.0,
                 pieces: tuple[int, int] = (4, 64), step_rows: int = 0, clock: Callable[[], float] = time.perf_counter,
                 adapters: AdapterGate | None = None):
        self.slots, self.max_queue = slots, max_queue
        self.im_end = im_end  # the code that ends a chunk
        # Listener-aware turns (`decoding`): frames a second of audio; seconds of slack a stream may
        # have before it yields (0: nobody yields); the codec's first and largest piece of a stream
        # in frames (audio reaches the listener a whole piece at a time; frames before the first
        # piece go first); most rows a step (0: all).
        self.frame_rate, self.horizon_s, self.step_rows = frame_rate, horizon_s, step_rows
        self.first_frames, self.largest_piece = pieces
        self.clock = clock
        self.step_s = 0.0  # recent seconds between two decode steps (a moving average)
        self._last_step: float | None = None
        # Benchmarks only (FISH_SM_BENCHMARK_LENGTHS): <|im_end|> ends nothing, every chunk runs to
        # its max_new frames, so random weights load the GPU with the lengths a benchmark intends.
        self.forced_lengths = forced_lengths
        self._generator = generator  # a request's random stream, from its seed
        self.adapters = adapters
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._active: list[Request] = []  # in admission order
        self._free = list(range(slots))  # a heap: the lowest free slot is taken first

    # -- the queue ----------------------------------------------------------------------

    def add(self, ticket: Ticket) -> None:
        """Queue a ticket; raises `Overloaded` when it is bounded and no slot and no queue place is free."""
        waiting = sum(t.bounded for t in self._waiting)
        if ticket.bounded and waiting >= self.slots - len(self._active) + self.max_queue:
            raise Overloaded(f"all {self.slots} slots are busy and {self.max_queue} requests wait already",
                             retry_after_s=1)
        self._waiting.append(ticket)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    def active(self) -> list[Request]:
        return list(self._active)

    def waiting(self) -> list[Ticket]:
        return list(self._waiting)

    def take_all_waiting(self) -> list[Ticket]:
        waiting, self._waiting = list(self._waiting), collections.deque()
        return waiting

    def drop_active(self) -> list[Request]:
        """Every active request, let go of without moving any (the engine has stopped)."""
        active, self._active = self._active, []
        return active

    # -- one iteration ------------------------------------------------------------------

    def schedule(self) -> Schedule:
        """Waiting tickets into free slots, and the requests whose next chunk starts now
        (those just admitted and those done with a chunk that have another)."""
        admitted, refused = self._take_waiting()
        starting = [r for r in self._active if r.finished_chunk and not r.ticket.cancelled
                    and r.chunk + 1 < len(r.chunks)]
        return Schedule(admitted, refused, starting)

    def _take_waiting(self) -> tuple[list[Request], list[tuple[Ticket, Exception]]]:
        """Waiting tickets moved into free slots, and those whose own text, parameters or
        adapter could not be set up, with why: they fail alone. A ticket whose adapter is still
        being read keeps its place while those behind it go ahead."""
        taken, refused, held = [], [], []
        while self._waiting and len(self._active) < self.slots:
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
                # A session's chunks are its sentences, a list that grows as they arrive.
                chunks = ticket.texts if isinstance(ticket, Session) else split_text(ticket.job.text,
                                                                                    ticket.job.chunk_length)
                request = Request(ticket, chunks, self._generator(ticket.job.params.seed), adapter_slot=adapter_slot)
            except Exception as exc:
                self._release_adapter(adapter_slot)
                refused.append((ticket, exc))
                continue
            request.slot = heapq.heappop(self._free)
            request.last_turn = self.clock()
            self._active.append(request)
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

    def chunk_started(self, request: Request, length: int, max_new: int) -> None:
        """The request's chunk is prefilled from a prompt of `length` tokens, its first frame
        sampled with it, and it may have `max_new` frames."""
        request.length, request.max_new, request.computed = length, max_new, 1
        request.finished_chunk, request.codes = False, []
        request.frames += 1
        request.last_turn = self.clock()

    def wanting(self) -> list[Request]:
        """The requests that want another frame."""
        return [r for r in self._active if not r.finished_chunk and r.computed < r.max_new and not r.ticket.cancelled]

    def decoding(self) -> list[Request]:
        """The requests that decode a frame at this step, most urgent first: those that want
        one, less the streams whose listeners have more than `horizon_s` of audio ahead (unless
        requests wait for a slot), at most `step_rows` of them."""
        now = self.clock()
        crowded = bool(self._waiting) and not self._free  # finishing sooner frees a slot for them
        turns = []
        for r in self.wanting():
            slack = self.slack(r, now)
            if slack > self.horizon_s > 0 and not crowded:
                continue  # its listener has enough to play: it yields this step
            turns.append((slack, r.slot, r))
        turns.sort(key=lambda t: t[:2])
        if self.step_rows > 0:
            turns = turns[: self.step_rows]
        return [r for _, _, r in turns]

    def next_turn_in(self) -> float:
        """Seconds until there is work: 0 when a ticket can take a slot, a chunk can start, a
        request was cancelled or wants a frame now; else until the first stream that yields
        wants one again (inf: nothing to do until something arrives)."""
        if self._free and any(self._admissible(t) for t in self._waiting):
            return 0.0
        if any(r.ticket.cancelled or (r.finished_chunk and r.chunk + 1 < len(r.chunks)) for r in self._active):
            return 0.0
        if self.ended_sessions():
            return 0.0
        if self.decoding():
            return 0.0
        now = self.clock()
        waits = [self.slack(r, now) - self.horizon_s for r in self.wanting()]
        return max(min(waits), 0.0) if waits else math.inf

    def slack(self, request: Request, now: float) -> float:
        """How long the request can go without a frame, in seconds. A stream: until its listener
        has played the audio of its finished codec pieces, less the steps that finishing its
        next piece takes at the recent pace (-inf before its first audio). A whole request:
        `horizon_s` less how long it has waited since its last frame (it waits behind streams
        with more slack than that)."""
        if not request.ticket.job.stream:
            return self.horizon_s - (now - request.last_turn)
        if isinstance(request.ticket, Session):
            return -math.inf  # a voice agent's turn: each sentence as soon as it can be
        if request.playing is None or request.frames < self.first_frames:
            return -math.inf
        audible, next_piece = self._pieces_around(request.frames)
        runs_out = request.playing + audible / self.frame_rate
        return runs_out - now - (next_piece - request.frames) * self.step_s

    def _pieces_around(self, frames: int) -> tuple[int, int]:
        """The frames in a stream's finished codec pieces, and where its next piece ends."""
        done, piece = 0, self.first_frames
        while done + piece <= frames:
            done += piece
            piece = min(2 * piece, self.largest_piece)
        return done, done + piece

    def advance(self, requests: list[Request]) -> None:
        """A step has queued one more frame for each of these."""
        now = self.clock()
        if requests:
            if self._last_step is not None:  # idle gaps count as at most 0.1 s: a step takes less
                self.step_s += 0.1 * (min(now - self._last_step, 0.1) - self.step_s)
            self._last_step = now
        for r in requests:
            r.computed += 1
            r.frames += 1
            r.last_turn = now

    def check(self, queued: Queued) -> Checked:
        """The stop checks for a frame queued earlier: <|im_end|> (unless lengths are forced: then
        its frame's codes are spoken like any other's) or the chunk's last frame ends the chunk,
        the last chunk's end completes the request."""
        request = queued.request
        if request.chunk != queued.chunk or request.finished_chunk or request.slot < 0:
            return Checked()  # the frame queued after its chunk's last one
        if request.ticket.cancelled:
            return Checked(cancelled=True)
        frame = queued.frames.row(queued.row)
        session = isinstance(request.ticket, Session)
        if int(frame[0]) == self.im_end and not self.forced_lengths:
            request.owed_draws = min(queued.index + 2, request.max_new) - request.computed
            return Checked(complete=self._finish_chunk(request), sentence_end=session)
        if "first_frame" not in request.ticket.timings:
            request.ticket.timings["first_frame"] = time.perf_counter() - request.ticket.submitted
        if request.playing is None:
            request.playing = self.clock()
        codes = frame[1:].copy()
        request.codes.append(codes)
        last = queued.index + 1 >= request.max_new
        complete = self._finish_chunk(request) if last else False
        return Checked(codes=codes, complete=complete, sentence_end=last and session)

    def _finish_chunk(self, request: Request) -> bool:
        """End the request's chunk (its codes become the next prompt's context); True when it was the last."""
        request.finished_chunk = True
        text = request.chunks[request.chunk]
        request.previous = [(text, np.stack(request.codes, axis=1))] if request.codes else []
        request.spoken.extend(request.codes)
        return self._all_spoken(request)

    @staticmethod
    def _all_spoken(request: Request) -> bool:
        """No chunk left to speak, and (a session) no more text to come."""
        ticket = request.ticket
        return request.chunk + 1 >= len(request.chunks) and (not isinstance(ticket, Session) or ticket.closed)

    def ended_sessions(self) -> list[Request]:
        """Sessions closed while waiting for their next sentence, with nothing left to speak."""
        return [r for r in self._active if isinstance(r.ticket, Session) and r.finished_chunk
                and not r.ticket.cancelled and self._all_spoken(r)]

    def cancelled(self) -> list[Request]:
        return [r for r in self._active if r.ticket.cancelled]

    def retire(self, request: Request) -> None:
        """Free the request's slot (it must hold one)."""
        self._active.remove(request)
        heapq.heappush(self._free, request.slot)
        self._release_adapter(request.adapter_slot)
        request.slot, request.finished_chunk, request.adapter_slot = -1, True, 0

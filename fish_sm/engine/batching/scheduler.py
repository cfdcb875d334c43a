"""The batching engine's scheduler: which requests wait and which hold slots, where each one
is in its text, and when it stops. Plain Python over requests, no tensors: the runner does
the model's work for what it decides (`ModelRunner`).

Active requests occupy slots 0..n-1, so a step runs the smallest captured batch size that
holds them; a retiring request's slot is refilled by moving the last one into it (`retire`
says which, the runner copies its rows). A waiting queue of bounded length holds the rest;
beyond it `add` refuses at once (`Overloaded`)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import numpy as np

from fish_sm.contract import SamplingParams
from fish_sm.engine.batching.request import Overloaded, Ticket
from fish_sm.engine.text import split_text


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

    @property
    def params(self) -> SamplingParams:
        return self.ticket.job.params

    @property
    def retired(self) -> bool:
        return self.slot < 0


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


class Move(NamedTuple):
    """A request moving from slot `src` into slot `dst`, with the `live` positions of its KV cache."""

    src: int
    dst: int
    live: int


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
    cancelled (to retire) or is now complete (all its chunks spoken)."""

    codes: np.ndarray | None = None
    cancelled: bool = False
    complete: bool = False


class Scheduler:
    """The waiting queue, the slots and each request's progress. `add`, `schedule` and the
    counts run under the engine's lock; the rest on the engine's thread."""

    def __init__(self, slots: int, max_queue: int, im_end: int, generator: Callable[[int | None], object],
                 forced_lengths: bool = False):
        self.slots, self.max_queue = slots, max_queue
        self.im_end = im_end  # the code that ends a chunk
        # Benchmarks only (FISH_SM_BENCHMARK_LENGTHS): <|im_end|> ends nothing, every chunk runs to
        # its max_new frames, so random weights load the GPU with the lengths a benchmark intends.
        self.forced_lengths = forced_lengths
        self._generator = generator  # a request's random stream, from its seed
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._active: list[Request] = []  # _active[i].slot == i

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
        """Waiting tickets moved into free slots, and those whose own text or parameters
        could not be set up, with why: they fail alone."""
        taken, refused = [], []
        while self._waiting and len(self._active) < self.slots:
            ticket = self._waiting.popleft()
            if ticket.cancelled:
                continue
            try:
                request = Request(ticket, split_text(ticket.job.text, ticket.job.chunk_length),
                                  self._generator(ticket.job.params.seed), slot=len(self._active))
            except Exception as exc:
                refused.append((ticket, exc))
                continue
            self._active.append(request)
            taken.append(request)
        return taken, refused

    def next_chunk(self, request: Request) -> None:
        request.chunk += 1

    def chunk_started(self, request: Request, length: int, max_new: int) -> None:
        """The request's chunk is prefilled from a prompt of `length` tokens, its first frame
        sampled with it, and it may have `max_new` frames."""
        request.length, request.max_new, request.computed = length, max_new, 1
        request.finished_chunk, request.codes = False, []

    def decoding(self) -> list[Request]:
        """The requests that want another frame from this step."""
        return [r for r in self._active if not r.finished_chunk and r.computed < r.max_new and not r.ticket.cancelled]

    def advance(self, requests: list[Request]) -> None:
        """A step has queued one more frame for each of these."""
        for r in requests:
            r.computed += 1

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
        if int(frame[0]) == self.im_end and not self.forced_lengths:
            return Checked(complete=self._finish_chunk(request))
        if "first_frame" not in request.ticket.timings:
            request.ticket.timings["first_frame"] = time.perf_counter() - request.ticket.submitted
        codes = frame[1:].copy()
        request.codes.append(codes)
        complete = self._finish_chunk(request) if queued.index + 1 >= request.max_new else False
        return Checked(codes=codes, complete=complete)

    def _finish_chunk(self, request: Request) -> bool:
        """End the request's chunk (its codes become the next prompt's context); True when it was the last."""
        request.finished_chunk = True
        text = request.chunks[request.chunk]
        request.previous = [(text, np.stack(request.codes, axis=1))] if request.codes else []
        request.spoken.extend(request.codes)
        return request.chunk + 1 >= len(request.chunks)

    def cancelled(self) -> list[Request]:
        return [r for r in self._active if r.ticket.cancelled]

    def retire(self, request: Request) -> Move | None:
        """Free the request's slot (it must hold one); the last active request moves into
        it: that move, for the runner to copy its rows, or None when it was the last."""
        slot, last = request.slot, self._active[-1]
        request.slot, request.finished_chunk = -1, True
        self._active.pop()
        if last is request:
            return None
        move = Move(last.slot, slot, last.length + last.computed)
        last.slot = slot
        self._active[slot] = last
        return move

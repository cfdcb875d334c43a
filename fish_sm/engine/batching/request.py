"""What callers hand the batching engine and what they get back: jobs, tickets and their
events, and the engine's refusals."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fish_sm.contract import SamplingParams
from fish_sm.contract import DEFAULT_CHUNK_LENGTH
from fish_sm.engine.synthesis import Reference, Synthesis
from fish_sm.errors import FishSMError


class Overloaded(FishSMError):
    """Every slot is busy and the waiting queue is full."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStopped(FishSMError):
    """The engine no longer serves: it was stopped, or one of its threads failed."""


@dataclass(frozen=True)
class Job:
    """One request for the batching engine."""

    text: str
    references: tuple[Reference, ...] = ()
    chunk_length: int = DEFAULT_CHUNK_LENGTH
    params: SamplingParams = SamplingParams()
    stream: bool = False  # audio in pieces as frames are decoded (see codec_stream), else the whole at the end
    adapter: str | None = None  # a LoRA adapter's name (see `Engine.enable_adapters`)


# What a ticket's sink receives, in this order: ("admitted", None) when it leaves the queue
# for a slot, ("audio", float32 samples) any number of times (once, when not streaming), then
# ("done", Synthesis without audio) or ("error", exc); an error may also come first. A session
# also gets ("spoken", i) after the last audio of its i-th sentence.
Event = tuple[str, object]


class Ticket:
    """A submitted job: its events go to `sink` (called from the engine's threads), or,
    without one, to a queue read by `events()`. `cancel()` frees its slot at the next step."""

    def __init__(self, job: Job, sink: Callable[[Event], None] | None = None):
        self.job = job
        self.cancelled = False
        self.bounded = True  # counts against the engine's max_queue while it waits
        self.on_cancel: Callable[["Ticket"], None] | None = None  # tells the engine (set by it)
        self.request = None  # the engine's `Request` for it, once admitted
        self.submitted = time.perf_counter()
        self.timings: dict[str, float] = {}
        self._queue: queue.SimpleQueue | None = None
        if sink is None:
            self._queue = queue.SimpleQueue()
            sink = self._queue.put
        self._sink = sink

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel(self)

    def emit(self, kind: str, payload) -> None:
        if not self.cancelled:
            self._sink((kind, payload))

    def events(self):
        """Blocking iteration over the events (only without a sink)."""
        while True:
            kind, payload = self._queue.get()
            yield kind, payload
            if kind in ("done", "error"):
                return

    def result(self) -> Synthesis:
        """Wait for the whole utterance (blocking; only without a sink)."""
        pieces, summary = [], None
        for kind, payload in self.events():
            if kind == "error":
                raise payload
            if kind == "audio":
                pieces.append(payload)
            elif kind == "done":
                summary = payload
        summary.audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return summary


class Session(Ticket):
    """A streamed request whose text arrives while it speaks (a voice agent's LLM writing it):
    each `speak` is one more chunk, spoken in order, each conditioned on the one before as the
    chunks of a long text are, its audio decoded as a codec stream of its own so it ends with
    its sentence. Between sentences it gives its slot back (parked) and takes one again for
    the next; `close` ends it once all is spoken, `clear` cuts what it was given and goes on,
    `cancel` ends it at once. Made by `BatchEngine.open_session`."""

    def __init__(self, job: Job, sink: Callable[[Event], None] | None, speak: Callable[["Session", str], None],
                 close: Callable[["Session"], None], clear: Callable[["Session"], None] | None = None):
        super().__init__(job, sink)
        self.texts: list[str] = []  # the sentences so far (the engine's chunks of this request)
        self.closed = False
        self.skip_to = 0  # sentences before this one were cut by a `clear` (none is spoken)
        self._speak, self._close, self._clear = speak, close, clear

    def speak(self, text: str) -> None:
        """Queue one more sentence (raises `InputError` for text the engine cannot take)."""
        self._speak(self, text)

    def close(self) -> None:
        """No more text: the session ends once everything queued is spoken."""
        self._close(self)

    def clear(self) -> None:
        """Barge-in that keeps the session: the sentence being spoken stops at the next step,
        those queued are dropped, audio not yet out is discarded; ("cleared", None) follows
        every event of what was cut, and the session takes new text as before."""
        self._clear(self)

"""The batching engine's codec thread: codes to audio in scheduled pieces, many requests'
pieces batched, on a thread and CUDA stream of its own beside the decode loop."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fish_sm.engine.codec_stream import CodecStream, StreamingCodec
from fish_sm.engine.engine import Engine, Synthesis
from fish_sm.engine.generate import HostCopy, to_device
from fish_sm.engine.batching.request import EngineStopped, Ticket

logger = logging.getLogger("fish_sm.batching")

# A piece of a stream with more than SPARE_S seconds of audio unplayed may wait up to HOLD_S for
# others of its length (CodecWorker._held).
HOLD_S, SPARE_S = 0.1, 0.3


class CodecWorker:
    """Codes to audio on a thread (and CUDA stream) of its own, piece by piece as frames
    arrive (`StreamingCodec`): streamed requests get each piece, the others one
    concatenation at the end. Before each batch everything queued is taken in; a batch is
    ready pieces of one scheduled length, the shortest (one piece per request, since a
    request's next piece needs the state its last one left)."""

    def __init__(self, engine: Engine, first_piece: int, largest_piece: int, precision: str = "auto"):
        self.engine = engine
        # auto: StreamingCodec's defaults (on a GPU, the back in float16 and TF32 fronts);
        # float32: the codec's own dtype throughout.
        if precision not in ("auto", "float32"):
            raise ValueError(f"codec precision {precision!r}: choose auto or float32")
        exact = {"back_dtype": engine.codec.dtype, "front_tf32": False} if precision == "float32" else {}
        self.codec = StreamingCodec(engine.codec, first_piece, largest_piece, **exact)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Audio] = {}  # id(ticket) -> its codec state, frames and audio so far
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the codec thread, if it failed
        self._cuda = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        # Pieces of streams with audio to spare wait up to `hold_s` for more of their length, so
        # the codec decodes fewer, larger batches beside the decode loop (0: never wait).
        self.hold_s, self.spare_s = HOLD_S, SPARE_S

    def capture(self, pieces: int) -> None:
        with self._on_stream():
            self.codec.capture(pieces)

    def _on_stream(self):
        return torch.cuda.stream(self._cuda) if self._cuda is not None else contextlib.nullcontext()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fish-sm-codec", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    # Each queue item is a list of (kind, ticket, codes): a step's frames travel together.
    def frames(self, frames: list[tuple[Ticket, np.ndarray]]) -> None:
        self._queue.put([("frame", ticket, codes) for ticket, codes in frames])

    def finish(self, ticket: Ticket, codes: list[np.ndarray]) -> None:
        self._queue.put([("finish", ticket, codes)])

    def end_sentence(self, ticket: Ticket, index: int) -> None:
        """A session's sentence `index` ends with the frames handed over so far: its last piece
        is decoded as such, ("spoken", index) follows its audio, and the next sentence starts
        a codec stream of its own."""
        self._queue.put([("sentence", ticket, index)])

    def cancel(self, ticket: Ticket) -> None:
        self._queue.put([("cancel", ticket, None)])

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def _run(self) -> None:
        """The codec thread; an error it cannot pin on a batch stops it (and, through
        `alive()`, the engine), failing the requests whose audio it held."""
        try:
            self._serve()
        except BaseException as exc:  # logged here; the thread then ends quietly
            logger.exception("the codec worker failed; it decodes no more audio")
            self.failure = exc
            error = EngineStopped(f"the codec worker stopped after an internal error ({type(exc).__name__})")
            for entry in list(self._streams.values()):
                entry.ticket.emit("error", error)
            self._streams.clear()

    def _serve(self) -> None:
        with torch.inference_mode(), self._on_stream():
            running = True
            while running:
                try:
                    items = [self._queue.get(timeout=self._next_due())]
                except queue.Empty:  # a held piece is due
                    items = []
                running = None not in items
                try:
                    self._take_all(items)
                    # One batch at a time, taking in what arrived meanwhile before choosing the
                    # next: a request's first piece waits behind one batch, not a whole round.
                    while self._decode_next():
                        self._summarise_finished()
                        items = self._drain()
                        running = running and None not in items
                        self._take_all(items)
                    self._summarise_finished()
                except Exception as exc:  # never a dead codec thread: whoever it held gets the error
                    logger.exception("codec worker failed")
                    for entry in self._streams.values():
                        entry.ticket.emit("error", exc)
                    self._streams.clear()

    def _drain(self) -> list:
        items = []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self._queue.get_nowait())
        return items

    def _take_all(self, items: list) -> None:
        for batch in items:
            for kind, ticket, codes in batch or ():  # (None: the stop sentinel)
                self._take(kind, ticket, codes)

    def _take(self, kind: str, ticket: Ticket, codes) -> None:
        key = id(ticket)
        if kind == "cancel" or ticket.cancelled:  # (frames may be handed over just before a cancel)
            self._streams.pop(key, None)
            return
        entry = self._streams.setdefault(key, _Audio(ticket))
        if kind == "frame":
            entry.frames.append(codes)
        elif kind == "sentence":
            entry.sentences.append([len(entry.frames) - sum(n for n, _ in entry.sentences), codes])
            self._sentences_done(entry)
        else:
            entry.finished, entry.all_codes = time.perf_counter(), codes

    def _decode_next(self) -> bool:
        """Decode one batch of ready pieces, the shortest ones (a request's first pieces go
        before the long pieces of requests already playing), and deliver it; False when no
        piece is due. A group of pieces waits (`_held`) while it is short of a full batch and
        every stream in it has audio to spare."""
        ready: dict[int, list[_Audio]] = {}
        now = time.perf_counter()
        for entry in self._streams.values():
            n = self.codec.next_frames(entry.stream)
            if entry.sentences:  # a sentence's last piece may be short
                n = min(n, entry.sentences[0][0])
            if (n and len(entry.frames) >= n) or (entry.finished and entry.frames):
                # By scheduled length, what a piece costs (a last, shorter piece is padded to it),
                # so streams ending together go a batch at a time and first pieces go between.
                ready.setdefault(n, []).append(entry)
                entry.ready_since = entry.ready_since or now
        due = [n for n, entries in ready.items() if not self._held(n, entries, now)]
        if not due:
            return False
        n = min(due)
        group = [(entry, entry.frames[:n]) for entry in ready[n][: self.codec.rows_for(n)]]
        for entry, _ in group:
            del entry.frames[:n]
            entry.ready_since = 0.0
        for (entry, _), samples in zip(group, self._decode_group(group)):
            if samples is not None:
                self._deliver(entry, samples)
                if entry.sentences:
                    entry.sentences[0][0] -= n
                    self._sentences_done(entry)
        return True

    def _sentences_done(self, entry: "_Audio") -> None:
        """Sentences whose audio is all out: their end is said, the next starts a new codec stream."""
        while entry.sentences and entry.sentences[0][0] <= 0:
            _, index = entry.sentences.pop(0)
            entry.stream = CodecStream()
            entry.ticket.emit("spoken", index)

    def _held(self, n: int, entries: list["_Audio"], now: float) -> bool:
        """Whether a group of ready pieces of length `n` waits: fewer than a batch, none held
        `hold_s` yet, and every one of a stream that has played less than it was given by more
        than `spare_s` (so a request's first pieces and its last, which the client waits for,
        never wait; nor a request whose whole audio is wanted at its end)."""
        if self.hold_s <= 0 or len(entries) >= self.codec.rows_for(n):
            return False
        return all(e.ticket.job.stream and not e.finished and not e.sentences and now < e.ready_since + self.hold_s
                   and e.spare(now) > self.spare_s for e in entries)

    def _next_due(self) -> float | None:
        """Seconds until a held piece is due (None: nothing is held)."""
        now = time.perf_counter()
        held = [e for e in self._streams.values() if e.ready_since]
        if not held:
            return None
        return max(0.0, min(min(e.ready_since + self.hold_s, now + e.spare(now) - self.spare_s) for e in held) - now)

    def _summarise_finished(self) -> None:
        for key, entry in list(self._streams.items()):
            if entry.finished and not entry.frames:
                del self._streams[key]
                self._summarise(entry)

    def _decode_group(self, group: list[tuple["_Audio", list[np.ndarray]]]) -> list[np.ndarray | None]:
        try:
            return self._pieces(group)
        except Exception:  # find the one that fails: each alone (their states are as they were)
            logger.exception("codec failed on a batch of %d pieces; retrying them one by one", len(group))
        audio = []
        for entry, frames in group:
            try:
                audio += self._pieces([(entry, frames)])
            except Exception as exc:
                self._streams.pop(id(entry.ticket), None)
                entry.ticket.emit("error", exc)
                audio.append(None)
        return audio

    def _pieces(self, ready: list[tuple["_Audio", list[np.ndarray]]]) -> list[np.ndarray]:
        dev = self.engine.device
        # Host copies through pinned memory (`to_device`, `HostCopy`): a pageable copy waits for
        # the whole batch inside the driver, and the decode loop's CUDA calls wait with it.
        pieces = [(entry.stream, to_device(torch.from_numpy(np.stack(frames, axis=1))[None], dev)) for entry, frames in ready]
        saved = [entry.stream.snapshot() for entry, _ in ready]
        try:
            audio = self.codec.push_many(pieces)
        except Exception:
            for (entry, _), stream in zip(ready, saved):  # as they were, for a retry
                entry.stream = stream
            raise
        copies = [HostCopy(a[0].float()) for a in audio]
        return [copy.get().numpy().copy() for copy in copies]  # (the pinned blocks back at once)

    def _deliver(self, entry: "_Audio", samples: np.ndarray) -> None:
        ticket = entry.ticket
        if ticket.job.stream:
            if "first_audio" not in ticket.timings:
                ticket.timings["first_audio"] = time.perf_counter() - ticket.submitted
                entry.playing_since = time.perf_counter()
            entry.given_s += len(samples) / self.engine.sample_rate
            ticket.emit("audio", samples)
        else:
            entry.audio.append(samples)

    def _summarise(self, entry: "_Audio") -> None:
        ticket, codes = entry.ticket, entry.all_codes
        if not ticket.job.stream:
            ticket.emit("audio", np.concatenate(entry.audio) if entry.audio else np.zeros(0, np.float32))
        ticket.timings["decode"] = time.perf_counter() - entry.finished
        ticket.timings["total"] = time.perf_counter() - ticket.submitted
        n = len(codes)
        seconds = n * self.engine.frame_length / self.engine.sample_rate
        stacked = torch.from_numpy(np.stack(codes, axis=1)) if codes else torch.zeros(self.engine.config.num_codebooks, 0, dtype=torch.long)
        ticket.emit("done", Synthesis(audio=None, sample_rate=self.engine.sample_rate, frames=n, seconds=seconds,
                                      rtf=ticket.timings["total"] / seconds if seconds else float("inf"),
                                      timings=dict(ticket.timings), codes=stacked))


@dataclass
class _Audio:
    """A request's place in the codec: its decoder state, frames not yet decoded, audio so far."""

    ticket: Ticket
    stream: CodecStream = field(default_factory=CodecStream)
    frames: list = field(default_factory=list)
    audio: list = field(default_factory=list)
    finished: float = 0.0  # when its last frame was handed over (0: still decoding)
    all_codes: list = field(default_factory=list)
    ready_since: float = 0.0  # when its next piece's frames were all there (0: not yet)
    playing_since: float = 0.0  # its first audio (streamed)
    given_s: float = 0.0  # audio streamed so far, in seconds
    # A session's ended sentences not yet all decoded: [frames of it still in `frames`, its index]
    sentences: list = field(default_factory=list)

    def spare(self, now: float) -> float:
        """Seconds of streamed audio a listener who began at the first piece has not reached yet."""
        return self.given_s - (now - self.playing_since) if self.playing_since else 0.0

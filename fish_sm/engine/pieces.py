"""How a stream's audio is cut into codec pieces: the first piece short (first audio soon), the
next ones growing up to a largest length (the codec runs fewer, larger batches), e.g. 4, 8, 16,
32, 64, 64, ... frames. The codec (`StreamingCodec`), its worker and the scheduler, which times
each stream's turns by the pieces its listener has, all read one `PieceSchedule`.

A listener waits on the ramp unless its stream decodes faster than its pieces grow: while
piece i plays, piece i+1 is decoded, so pieces that double need frames at twice real time (and
more, for the codec's latency). Under load a step takes longer and a stream gets one frame a
step, so `repeats` > 1 holds each length for that many pieces before it grows: growth of about
`2 ** (1 / repeats)` a piece. No tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PieceSchedule:
    """Pieces of `first` frames, each length `repeats` times, doubling while below `largest`
    (this ramp), then every piece `largest`."""

    first: int = 4
    largest: int = 64
    repeats: int = 1
    ramp: np.ndarray = field(init=False, repr=False, compare=False)  # the lengths before the largest's run, in order
    bounds: np.ndarray = field(init=False, repr=False, compare=False)  # frames before each ramp piece, then the ramp's end
    scheduled: np.ndarray = field(init=False, repr=False, compare=False)  # every length a piece may have, shortest first

    def __post_init__(self):
        if self.first < 1 or self.largest < 1:
            raise ValueError(f"pieces of {self.first} frames first, {self.largest} at most: both at least 1")
        if self.repeats < 1:
            raise ValueError(f"piece repeats {self.repeats}: at least 1")
        ramp, n = [self.first] * self.repeats, 2 * self.first
        while n < self.largest:
            ramp += [n] * self.repeats
            n *= 2
        object.__setattr__(self, "ramp", np.array(ramp, np.int64))
        object.__setattr__(self, "bounds", np.concatenate([[0], np.cumsum(ramp, dtype=np.int64)]).astype(np.int64))
        object.__setattr__(self, "scheduled", np.array(sorted({*ramp, self.largest}), np.int64))

    @property
    def ramp_end(self) -> int:
        """Frames before the ramp's last piece is followed by `largest` ones."""
        return int(self.bounds[-1])

    def lengths(self) -> list[int]:
        """Every length a piece may be scheduled at, shortest first."""
        return self.scheduled.tolist()

    def frames(self, index):
        """Frames in piece `index` (an int, or an array of them)."""
        index = np.asarray(index, np.int64)
        k = len(self.ramp)
        out = np.where(index < k, self.ramp[np.minimum(index, k - 1)], self.largest)
        return int(out) if out.ndim == 0 else out

    def start(self, index):
        """Frames of a stream before its piece `index` (an int, or an array of them)."""
        index = np.asarray(index, np.int64)
        k = len(self.ramp)
        out = np.where(index <= k, self.bounds[np.minimum(index, k)], self.ramp_end + (index - k) * self.largest)
        return int(out) if out.ndim == 0 else out

    def around(self, frames) -> tuple[np.ndarray, np.ndarray]:
        """For each count of a stream's frames: the frames in its finished pieces, and where the
        piece that holds its next frame ends."""
        frames = np.asarray(frames, np.int64)
        on_ramp = np.searchsorted(self.bounds, frames, side="right") - 1
        index = np.where(frames < self.ramp_end, on_ramp, len(self.ramp) + (frames - self.ramp_end) // self.largest)
        return self.start(index), self.start(index + 1)

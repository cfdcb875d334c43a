"""Per-slot state of the batching engine as arrays, one entry per KV-cache slot: what a step
needs of every request it decodes (positions, noise keys, lengths, stops, pacing) read and
updated for all rows at once, so a step costs the same host time at 8 rows as at 512.

The scheduler writes an entry when it admits a request and when an event happens to it (a
chunk starts or ends, its listener starts playing); a step updates the entries of its rows
by array operations; the runner reads them to build the step's inputs. numpy arrays, no
tensors: the table is plain data that a test can fill by hand."""

from __future__ import annotations

import numpy as np

from fish_sm.engine.sampling import round_bf16
from fish_sm.kernels import noise_keys


class SlotTable:
    """Every slot's request state. Entries of a free slot are stale except `active` (False)
    and `generation` (bumped at each admission, so a frame queued for a slot's previous
    request is told apart from its next one's)."""

    def __init__(self, slots: int, codebooks: int, max_frames: int):
        self.slots = slots
        self.active = np.zeros(slots, bool)
        self.generation = np.zeros(slots, np.int64)
        self.stream = np.zeros(slots, bool)  # audio streamed to a listener
        self.session = np.zeros(slots, bool)  # a voice agent's session (text arriving as it speaks)
        self.cancelled = np.zeros(slots, bool)
        self.finished_chunk = np.ones(slots, bool)  # no more frames wanted from its current chunk
        self.chunk = np.full(slots, -1, np.int64)  # index of its current chunk
        self.chunks = np.zeros(slots, np.int64)  # chunks known so far (a session's grow)
        self.length = np.zeros(slots, np.int64)  # prompt tokens of the current chunk
        self.computed = np.zeros(slots, np.int64)  # frames of the current chunk queued so far
        self.max_new = np.zeros(slots, np.int64)  # frames the current chunk may have
        self.frames = np.zeros(slots, np.int64)  # frames queued so far, all chunks together
        self.playing = np.full(slots, np.nan)  # when its listener began to play (its first frame checked)
        self.last_turn = np.zeros(slots)  # when it last had a frame queued
        self.seed = np.zeros(slots, np.uint64)  # its random stream's seed (`kernels.noise_key`)
        self.draws = np.zeros(slots, np.int64)  # frames of noise drawn so far
        # Its sampling parameters, rounded to bf16 as the model's own values are: temperature,
        # top_p, repetition penalty (a free slot's are 1, what padding rows of a step read).
        self.sampling = np.ones((3, slots), np.float32)
        self.adapter = np.zeros(slots, np.int64)  # its LoRA adapter's slot (0: none)
        self.lane = np.full(slots, -1, np.int64)  # its stream's lane in the codec worker
        # This chunk's codes as they are checked, [slot, codebook, frame of the chunk]: a chunk's
        # codes become the next chunk's prompt and the request's spoken codes when it ends.
        self.codes = np.zeros((slots, codebooks, max_frames), np.int16)

    def admit(self, slot: int, *, stream: bool, session: bool, chunks: int, seed: int, adapter: int,
              now: float, sampling: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> None:
        """A request takes the slot (its codec lane is set when the engine opens its stream);
        `sampling`: its temperature, top_p and repetition penalty."""
        self.sampling[:, slot] = round_bf16(np.asarray(sampling, np.float32))
        self.active[slot], self.stream[slot], self.session[slot] = True, stream, session
        self.cancelled[slot], self.finished_chunk[slot] = False, True
        self.chunk[slot], self.chunks[slot] = -1, chunks
        self.length[slot] = self.computed[slot] = self.max_new[slot] = self.frames[slot] = 0
        self.playing[slot], self.last_turn[slot] = np.nan, now
        self.seed[slot], self.draws[slot] = np.uint64(seed), 0
        self.adapter[slot], self.lane[slot] = adapter, -1
        self.generation[slot] += 1

    def free(self, slot: int) -> None:
        self.active[slot], self.finished_chunk[slot], self.adapter[slot], self.lane[slot] = False, True, 0, -1
        self.sampling[:, slot] = 1.0

    def wanting(self) -> np.ndarray:
        """The slots whose requests want another frame."""
        return np.flatnonzero(self.active & ~self.finished_chunk & (self.computed < self.max_new) & ~self.cancelled)

    def starting(self) -> np.ndarray:
        """The slots whose requests are done with a chunk and have another to start."""
        return np.flatnonzero(self.active & self.finished_chunk & ~self.cancelled & (self.chunk + 1 < self.chunks))

    def next_keys(self, slots: np.ndarray) -> np.ndarray:
        """The noise keys of these slots' next frames (counting them drawn)."""
        keys = noise_keys(self.seed[slots], self.draws[slots])
        self.draws[slots] += 1
        return keys

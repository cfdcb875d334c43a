"""The batching scheduler as a unit: listener-aware turns, slots, no starvation (no tensors, a
clock of the test's own)."""

import random

import numpy as np

from fish_sm.contract import SamplingParams
from fish_sm.engine.batching.request import Job, Ticket
from fish_sm.engine.batching.scheduler import Queued, Scheduler

IM_END = 99
RATE = 20.0  # frames a second of audio


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Frames:
    """A step's frames as the runner hands them over: code 0 (not <|im_end|>) on every row."""

    def row(self, i: int) -> np.ndarray:
        return np.array([1, 2, 3], dtype=np.int64)


def scheduler(clock, slots=4, step_rows=0, horizon_s=2.0):
    # Codec pieces of one frame after a first of 4: audio reaches the listener frame by frame.
    return Scheduler(slots, max_queue=8, im_end=IM_END, generator=lambda seed: None, frame_rate=RATE,
                     horizon_s=horizon_s, pieces=(4, 1), step_rows=step_rows, clock=clock)


def admit(s: Scheduler, *, stream: bool, max_new: int = 1000, text: str = "Hello there.") -> list:
    s.add(Ticket(Job(text, stream=stream, params=SamplingParams(seed=1))))
    admitted = s.schedule().admitted
    for r in admitted:
        s.next_chunk(r)
        s.chunk_started(r, length=10, max_new=max_new)
        s.check(Queued(r, r.chunk, 0, 0, Frames()))  # its first frame: the listener starts playing
    return admitted


def run_frames(s: Scheduler, request, frames: int) -> None:
    """`frames` more frames queued and checked for the request."""
    for _ in range(frames):
        s.advance([request])
        s.check(Queued(request, request.chunk, request.computed - 1, 0, Frames()))


def test_a_stream_with_its_horizon_buffered_yields_until_its_listener_catches_up():
    clock = Clock()
    s = scheduler(clock)
    ahead, behind = admit(s, stream=True)[0], admit(s, stream=True)[0]
    run_frames(s, ahead, 99)  # 100 frames: 5 s of audio
    run_frames(s, behind, 29)  # 30 frames: 1.5 s
    clock.now += 1.0
    assert s.decoding() == [behind]  # 4 s ahead yields; 0.5 s ahead decodes
    run_frames(s, behind, 50)  # 4 s of audio, 3 s ahead: both yield
    assert s.decoding() == []
    assert abs(s.next_turn_in() - 1.0) < 0.05  # behind's listener is at 2 s of buffer in 1 s (less a step)
    clock.now += 2.5  # ahead: 1.5 s ahead, behind: 0.5 s: both want frames, the closer first
    assert s.decoding() == [behind, ahead]


def test_a_stream_counts_only_the_audio_of_its_finished_codec_pieces():
    """Audio leaves the codec a piece at a time (4, 8, 16, ... frames): frames of an unfinished
    piece are not yet audible, and the steps its rest takes count against the slack."""
    clock = Clock()
    s = Scheduler(4, max_queue=8, im_end=IM_END, generator=lambda seed: None, frame_rate=RATE, horizon_s=2.0,
                  pieces=(4, 16), clock=clock)
    r = admit(s, stream=True)[0]
    run_frames(s, r, 59)  # 60 frames: pieces of 4, 8, 16, 16 (44 frames) finished, 16 more of the next
    assert s._pieces_around(60) == (60, 76) and s._pieces_around(59) == (44, 60)
    s.step_s = 0.05
    assert abs(s.slack(r, clock.now) - (60 / RATE - 16 * 0.05)) < 1e-9
    run_frames(s, r, 1)
    s.step_s = 0.05
    assert abs(s.slack(r, clock.now) - (60 / RATE - 15 * 0.05)) < 1e-9  # 61 frames: still 60 audible


def test_first_frames_then_the_streams_closest_to_underrun_go_first():
    clock = Clock()
    s = scheduler(clock, slots=4, step_rows=2)
    old = admit(s, stream=True)[0]
    run_frames(s, old, 39)  # 2 s of audio
    close = admit(s, stream=True)[0]
    run_frames(s, close, 19)  # 1 s of audio
    clock.now += 0.8
    new = admit(s, stream=True)[0]  # before its first audio (fewer than 4 frames)
    assert s.decoding() == [new, close]  # first audio, then 0.2 s ahead; 1.2 s ahead waits for a free row


def test_nobody_yields_while_requests_wait_for_a_slot():
    clock = Clock()
    s = scheduler(clock, slots=1)
    only = admit(s, stream=True)[0]
    run_frames(s, only, 99)
    assert s.decoding() == []  # 5 s ahead: it yields
    s.add(Ticket(Job("Next.", stream=True)))
    assert s.decoding() == [only]  # a request waits for its slot: finish sooner
    assert s.next_turn_in() == 0.0


def test_whole_requests_fill_spare_rows_and_gain_priority_as_they_wait():
    clock = Clock()
    s = scheduler(clock, slots=4, step_rows=1)
    stream = admit(s, stream=True)[0]
    run_frames(s, stream, 29)  # 1.5 s ahead
    whole = admit(s, stream=False)[0]
    assert s.decoding() == [stream]  # a whole request just served waits behind a stream with less than 2 s
    clock.now += 0.6  # the stream has 0.9 s ahead; the whole request waited 0.6 s: slack 1.4 s
    assert s.decoding() == [stream]
    s.advance([stream])
    clock.now += 0.6  # stream: 31 frames, 0.35 s ahead; whole: slack 0.8 s
    assert s.decoding() == [stream]
    run_frames(s, stream, 40)  # stream 2.35 s ahead: it yields, the whole request fills the row
    assert s.decoding() == [whole]


def test_a_retired_request_frees_its_slot_at_once_for_the_next():
    clock = Clock()
    s = scheduler(clock, slots=2)
    a, b = admit(s, stream=True)[0], admit(s, stream=False)[0]
    assert (a.slot, b.slot) == (0, 1)
    s.add(Ticket(Job("Waiting.", stream=True)))
    assert s.schedule().admitted == []  # no slot free
    a.ticket.cancel()
    assert s.next_turn_in() == 0.0
    s.retire(a)
    assert a.retired and s.num_active == 1
    (c,) = s.schedule().admitted
    assert c.slot == 0  # the freed slot, taken at the next iteration; b kept its own
    assert b.slot == 1


def test_every_admitted_request_finishes_under_a_mixed_load():
    """Streams and whole requests arriving at random, two rows a step and 10 ms a step: every
    request gets all its frames, none waits forever, and the slots all come back."""
    rng = random.Random(0)
    clock = Clock()
    s = scheduler(clock, slots=6, step_rows=2, horizon_s=0.5)
    finished, submitted = 0, 0
    for step in range(20_000):
        if submitted < 60 and rng.random() < 0.02:
            s.add(Ticket(Job("Some text.", stream=rng.random() < 0.7)))
            submitted += 1
        for r in s.schedule().admitted:
            s.next_chunk(r)
            s.chunk_started(r, length=10, max_new=rng.randint(20, 60))
            s.check(Queued(r, r.chunk, 0, 0, Frames()))
        rows = s.decoding()
        assert len(rows) <= 2
        s.advance(rows)
        for r in rows:
            if s.check(Queued(r, r.chunk, r.computed - 1, 0, Frames())).complete:
                s.retire(r)
                finished += 1
        clock.now += 0.01
        if submitted == 60 and not s.has_work():
            break
    assert finished == submitted == 60
    assert sorted(s._free) == list(range(6))

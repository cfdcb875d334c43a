"""The batching scheduler as a unit: listener-aware turns, slots, no starvation, and its array
decisions against a per-request statement of the same rules (no tensors, a clock of the
test's own)."""

import math
import random

import numpy as np

from fish_sm.contract import SamplingParams
from fish_sm.engine.batching.request import Job, Session, Ticket
from fish_sm.engine.batching.scheduler import Scheduler, StepRows
from fish_sm.engine.pieces import PieceSchedule
from fish_sm.engine.sampling import round_bf16

IM_END = 99
RATE = 20.0  # frames a second of audio
CODEBOOKS = 2
SPEECH = np.array([1, 2, 3])  # a frame that is not <|im_end|>


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(clock, slots=4, step_rows=0, horizon_s=2.0, pieces=(4, 1), forced=False, max_queue=8):
    # Codec pieces of one frame after a first of 4: audio reaches the listener frame by frame.
    return Scheduler(slots, max_queue=max_queue, im_end=IM_END, generator=lambda seed: None, frame_rate=RATE,
                     horizon_s=horizon_s, pieces=PieceSchedule(*pieces), step_rows=step_rows, clock=clock, forced_lengths=forced,
                     codebooks=CODEBOOKS, max_frames=1024)


def rows_of(s: Scheduler, requests, index=None) -> StepRows:
    """Rows of frames queued now for these requests (each at its latest computed frame)."""
    slots = np.array([r.slot for r in requests], np.int64)
    at = s.table.computed[slots] - 1 if index is None else np.full(len(slots), index)
    return StepRows(slots, s.table.generation[slots].copy(), s.table.chunk[slots].copy(), at, lambda: None)


def check(s: Scheduler, requests, frames=None, index=None):
    frames = np.tile(SPEECH, (len(requests), 1)) if frames is None else frames
    return s.check(rows_of(s, requests, index), frames)


def admit(s: Scheduler, *, stream: bool, max_new: int = 1000, text: str = "Hello there.") -> list:
    s.add(Ticket(Job(text, stream=stream, params=SamplingParams(seed=1))))
    admitted = s.schedule().admitted
    for r in admitted:
        s.next_chunk(r)
        s.chunk_started(r, length=10, max_new=max_new)
        check(s, [r], index=0)  # its first frame: the listener starts playing
    return admitted


def run_frames(s: Scheduler, request, frames: int) -> None:
    """`frames` more frames queued and checked for the request."""
    for _ in range(frames):
        s.advance(np.array([request.slot]))
        check(s, [request])


def slots(*requests) -> list[int]:
    return [r.slot for r in requests]


def test_a_stream_with_its_horizon_buffered_yields_until_its_listener_catches_up():
    clock = Clock()
    s = scheduler(clock)
    ahead, behind = admit(s, stream=True)[0], admit(s, stream=True)[0]
    run_frames(s, ahead, 99)  # 100 frames: 5 s of audio
    run_frames(s, behind, 29)  # 30 frames: 1.5 s
    clock.now += 1.0
    assert list(s.decoding()) == slots(behind)  # 4 s ahead yields; 0.5 s ahead decodes
    run_frames(s, behind, 50)  # 4 s of audio, 3 s ahead: both yield
    assert not s.decoding().size
    assert abs(s.next_turn_in() - 1.0) < 0.05  # behind's listener is at 2 s of buffer in 1 s (less a step)
    clock.now += 2.5  # ahead: 1.5 s ahead, behind: 0.5 s: both want frames, the closer first
    assert list(s.decoding()) == slots(behind, ahead)


def test_a_stream_counts_only_the_audio_of_its_finished_codec_pieces():
    """Audio leaves the codec a piece at a time (4, 8, 16, ... frames): frames of an unfinished
    piece are not yet audible, and the steps its rest takes count against the slack."""
    clock = Clock()
    s = scheduler(clock, pieces=(4, 16))
    r = admit(s, stream=True)[0]
    run_frames(s, r, 59)  # 60 frames: pieces of 4, 8, 16, 16 (44 frames) finished, 16 more of the next
    assert [int(x) for x in s.pieces.around(60)] == [60, 76] and [int(x) for x in s.pieces.around(59)] == [44, 60]
    s.step_s = 0.05
    assert abs(s.slack(np.array([r.slot]), clock.now)[0] - (60 / RATE - 16 * 0.05)) < 1e-9
    run_frames(s, r, 1)
    s.step_s = 0.05
    assert abs(s.slack(np.array([r.slot]), clock.now)[0] - (60 / RATE - 15 * 0.05)) < 1e-9  # 61: still 60 audible


def test_first_frames_then_the_streams_closest_to_underrun_go_first():
    clock = Clock()
    s = scheduler(clock, slots=4, step_rows=2)
    old = admit(s, stream=True)[0]
    run_frames(s, old, 39)  # 2 s of audio
    close = admit(s, stream=True)[0]
    run_frames(s, close, 19)  # 1 s of audio
    clock.now += 0.8
    new = admit(s, stream=True)[0]  # before its first audio (fewer than 4 frames)
    assert list(s.decoding()) == slots(new, close)  # first audio, then 0.2 s ahead; 1.2 s ahead waits for a row


def test_nobody_yields_while_requests_wait_for_a_slot():
    clock = Clock()
    s = scheduler(clock, slots=1)
    only = admit(s, stream=True)[0]
    run_frames(s, only, 99)
    assert not s.decoding().size  # 5 s ahead: it yields
    s.add(Ticket(Job("Next.", stream=True)))
    assert list(s.decoding()) == slots(only)  # a request waits for its slot: finish sooner
    assert s.next_turn_in() == 0.0


def test_whole_requests_fill_spare_rows_and_gain_priority_as_they_wait():
    clock = Clock()
    s = scheduler(clock, slots=4, step_rows=1)
    stream = admit(s, stream=True)[0]
    run_frames(s, stream, 29)  # 1.5 s ahead
    whole = admit(s, stream=False)[0]
    assert list(s.decoding()) == slots(stream)  # a whole request just served waits behind a stream with < 2 s
    clock.now += 0.6  # the stream has 0.9 s ahead; the whole request waited 0.6 s: slack 1.4 s
    assert list(s.decoding()) == slots(stream)
    s.advance(np.array([stream.slot]))
    clock.now += 0.6  # stream: 31 frames, 0.35 s ahead; whole: slack 0.8 s
    assert list(s.decoding()) == slots(stream)
    run_frames(s, stream, 40)  # stream 2.35 s ahead: it yields, the whole request fills the row
    assert list(s.decoding()) == slots(whole)


def test_a_retired_request_frees_its_slot_at_once_for_the_next():
    clock = Clock()
    s = scheduler(clock, slots=2)
    a, b = admit(s, stream=True)[0], admit(s, stream=False)[0]
    assert (a.slot, b.slot) == (0, 1)
    s.add(Ticket(Job("Waiting.", stream=True)))
    assert s.schedule().admitted == []  # no slot free
    s.cancel(a.ticket)
    assert s.next_turn_in() == 0.0
    assert s.take_cancelled() == [a]
    s.retire(a)
    assert a.retired and s.num_active == 1
    (c,) = s.schedule().admitted
    assert c.slot == 0  # the freed slot, taken at the next iteration; b kept its own
    assert b.slot == 1


def test_admissions_wait_for_a_free_codec_lane_as_for_a_slot():
    """A stream's codec lane outlives its slot while its last pieces decode: with slots free
    but no lane, requests wait, and are admitted as lanes come back."""
    clock, lanes = Clock(), [1]
    s = scheduler(clock, slots=4)
    s.lanes_free = lambda: lanes[0]
    for text in ("One.", "Two.", "Three."):
        s.add(Ticket(Job(text, stream=True)))
    assert len(s.schedule().admitted) == 1
    lanes[0] = 0
    assert s.schedule().admitted == [] and s.num_waiting == 2
    lanes[0] = 5
    assert len(s.schedule().admitted) == 2 and s.num_waiting == 0


def test_frames_queued_for_a_slot_s_previous_request_are_dropped():
    """A step queued before its request ended, checked after another took the slot: the new
    request's entry has another generation, so the old rows deliver nothing."""
    clock = Clock()
    s = scheduler(clock, slots=1)
    (a,) = admit(s, stream=True, max_new=3)
    s.advance(np.array([a.slot]))
    stale = rows_of(s, [a])  # frame 1 queued...
    slot = a.slot
    s.retire(a)  # ...then a left (cancelled, say) and b took the slot
    (b,) = admit(s, stream=True)
    assert b.slot == slot
    checked = s.check(stale, np.tile(SPEECH, (1, 1)))
    assert checked.lanes.size == 0 and checked.ended == []


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
            check(s, [r], index=0)
        rows = s.decoding()
        assert len(rows) <= 2
        s.advance(rows)
        for ended in check(s, [s.requests[slot] for slot in rows]).ended:
            assert ended.complete
            s.retire(ended.request)
            finished += 1
        clock.now += 0.01
        if submitted == 60 and not s.has_work():
            break
    assert finished == submitted == 60
    assert sorted(s._free) == list(range(6))


# -- the array decisions against the rules stated request by request ------------------------------


class Reference:
    """The scheduler's rules stated one request at a time (as the engine ran them before they
    became array operations): slack, whose turn, and what a checked frame means."""

    def __init__(self, s: Scheduler):
        self.s = s

    def slack(self, slot: int, now: float) -> float:
        s, t = self.s, self.s.table
        if not t.stream[slot]:
            return s.horizon_s - (now - t.last_turn[slot])
        if t.session[slot] or math.isnan(t.playing[slot]) or t.frames[slot] < s.pieces.first:
            return -math.inf
        done, piece = 0, s.pieces.first
        while done + piece <= t.frames[slot]:
            done += piece
            piece = min(2 * piece, s.pieces.largest)
        return t.playing[slot] + done / s.frame_rate - now - (done + piece - t.frames[slot]) * s.step_s

    def decoding(self) -> list[int]:
        s, t, now = self.s, self.s.table, self.s.clock()
        crowded = bool(s._waiting) and not s._free
        turns = []
        for slot in range(s.slots):
            if not (t.active[slot] and not t.finished_chunk[slot] and t.computed[slot] < t.max_new[slot]
                    and not t.cancelled[slot]):
                continue
            slack = self.slack(slot, now)
            if slack > s.horizon_s > 0 and not crowded:
                continue
            turns.append((slack, slot))
        turns.sort()
        return [slot for _, slot in turns][: s.step_rows or None]

    def verdicts(self, rows: StepRows, frames: np.ndarray) -> list[tuple]:
        """(slot, delivered, ended, first audio) for each row, before the check changes anything."""
        s, t, out = self.s, self.s.table, []
        for i, slot in enumerate(rows.slots):
            live = (t.active[slot] and t.generation[slot] == rows.generation[i] and t.chunk[slot] == rows.chunk[i]
                    and not t.finished_chunk[slot] and not t.cancelled[slot])
            end = live and frames[i, 0] == s.im_end and not s.forced_lengths
            deliver = live and not end
            last = deliver and rows.index[i] + 1 >= t.max_new[slot]
            out.append((int(slot), deliver, bool(end or last), deliver and math.isnan(t.playing[slot])))
        return out


def test_a_slot_keeps_its_sampling_parameters_rounded_as_the_model_rounds_them():
    """The table holds each request's temperature, top_p and penalty as bf16 values (what the
    model's own bf16 tensors hold), and a freed slot's go back to 1 (padding rows read them)."""
    import torch

    values = np.concatenate([np.random.default_rng(0).uniform(0, 4, 50_000), [0.7, 0.8, 1.1, 1e-30, 3.0e38]])
    values = values.astype(np.float32)
    np.testing.assert_array_equal(round_bf16(values), torch.from_numpy(values).to(torch.bfloat16).float().numpy())
    clock = Clock()
    s = scheduler(clock)
    s.add(Ticket(Job("Hello there.", params=SamplingParams(seed=1, temperature=0.7, top_p=0.8, repetition_penalty=1.1))))
    (request,) = s.schedule().admitted
    expected = torch.tensor([0.7, 0.8, 1.1]).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(s.table.sampling[:, request.slot], expected)
    slot = request.slot
    s.retire(request)
    np.testing.assert_array_equal(s.table.sampling[:, slot], [1, 1, 1])


def test_array_decisions_equal_the_per_request_rules_over_random_histories():
    """Random histories of streams, whole requests and sessions arriving, chunks of random
    lengths, <|im_end|> at random frames, cancels and a clock that jumps: at every step the
    slots decoding (and their order), the slack of every request, and each checked row's
    verdict (delivered, chunk ended, first audio) are those of the per-request rules."""
    for seed in range(6):
        rng = random.Random(seed)
        clock = Clock()
        s = scheduler(clock, slots=8, step_rows=rng.choice([0, 3, 5]), horizon_s=rng.choice([0.0, 0.5, 2.0]),
                      pieces=(4, rng.choice([8, 16, 64])), forced=seed == 5, max_queue=16)
        s.step_s = 0.02
        ref = Reference(s)
        pending: list[StepRows] = []
        for step in range(600):
            if rng.random() < 0.4:
                kind = rng.random()
                if kind < 0.15:
                    ticket = Session(Job("", stream=True), None, lambda *a: None, lambda *a: None)
                    ticket.texts.extend(["One.", "Two."])
                else:
                    ticket = Ticket(Job("Some text. More text follows here.", stream=kind < 0.75, chunk_length=50))
                try:
                    s.add(ticket)
                except Exception:
                    pass
            active = s.active()
            if active and rng.random() < 0.03:
                s.cancel(rng.choice(active).ticket)
            for r in s.take_cancelled():
                s.retire(r)
            schedule = s.schedule()
            first = []
            for r in schedule.starting:  # (the admitted among them)
                s.next_chunk(r)
                s.chunk_started(r, length=10, max_new=rng.randint(2, 40))
                first.append(r)
            want = ref.decoding()
            got = s.decoding()
            assert list(got) == want, (seed, step)
            wanting = s.table.wanting()
            if wanting.size:
                np.testing.assert_allclose(s.slack(wanting, clock.now), [ref.slack(x, clock.now) for x in wanting])
            s.advance(got)
            step_rows = rows_of(s, [s.requests[x] for x in got]) if got.size else None
            if first:
                pending.append(rows_of(s, first, index=0))
            for rows in pending:
                frames = np.tile(SPEECH, (len(rows.slots), 1))
                frames[[rng.random() < 0.05 for _ in rows.slots], 0] = IM_END
                expected = ref.verdicts(rows, frames)
                checked = s.check(rows, frames)
                delivered = [slot for slot, deliver, _, _ in expected if deliver]
                assert list(s.table.lane[delivered]) == list(checked.lanes)
                assert [e.request.slot for e in checked.ended] == [slot for slot, _, ended, _ in expected if ended]
                for e in checked.ended:
                    if e.complete:
                        s.retire(e.request)
                for slot, _, _, first_audio in expected:
                    if first_audio:
                        assert s.table.playing[slot] == clock.now
            pending = [step_rows] if step_rows is not None else []
            clock.now += rng.choice([0.005, 0.02, 0.3])
            for session in [r.ticket for r in s.active() if isinstance(r.ticket, Session)]:
                if rng.random() < 0.05 and not session.closed:
                    session.closed = True
                    s.session_closed(session)
            for r in s.ended_sessions():
                s.retire(r)

"""The batching engine: requests batched against each run alone (the engine's one-slot batching
engine), the codec worker, overload and cancels (CPU, float32, tiny checkpoint)."""

import time

import numpy as np
import pytest
import torch

from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine, CodecWorker, Job, Overloaded, Ticket, batch_sizes
from fish_sm.engine.batching.codec_worker import CaptureLock
from fish_sm.engine.batching.runner import ModelRunner
from fish_sm.engine.generate import HostCopy, HostStaging, WaitClock, admission_shape, to_device
from fish_sm.engine.sampling import SamplingParams
from fish_sm.errors import InputError

TEXTS = [
    "Hello there.",
    "A somewhat longer sentence, so that more frames come out of it. Then a second sentence follows.",
    "Short.",
    "One more test sentence here!",
]


def stopping(engine: Engine) -> Engine:
    """Make <|im_end|> likely enough that requests stop on their own at different frames
    (random weights almost never choose it)."""
    with torch.no_grad():
        engine.model.head.weight[-1] *= 8
    return engine


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    return stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu"))


@pytest.fixture(scope="module")
def voices(solo, tone):
    return [solo.encode_reference((tone(1.0, 44100)[:, 0], 44100), "a reference voice"),
            solo.encode_reference((tone(0.7, 44100, freq=330.0)[:, 0], 44100), "another voice")]


def mixed_jobs(voices) -> list[Job]:
    jobs = []
    for i in range(10):
        jobs.append(Job(TEXTS[i % 4], references=() if i % 3 == 0 else (voices[i % 2],),
                        chunk_length=60 if i % 4 == 1 else 200,
                        params=SamplingParams(seed=i, max_new_tokens=20 + 7 * i, temperature=0.6 + 0.04 * i,
                                              top_p=0.7 + 0.03 * i, repetition_penalty=1.0 + 0.05 * i)))
    return jobs


def run_alone(engine: Engine, job: Job):
    p = job.params
    return engine.synthesize(job.text, reference=list(job.references), chunk_length=job.chunk_length,
                             temperature=p.temperature, top_p=p.top_p, repetition_penalty=p.repetition_penalty,
                             max_new_tokens=p.max_new_tokens, seed=p.seed)


@pytest.fixture(scope="module")
def alone(solo, voices):
    """Each of mixed_jobs run alone (`Engine.synthesize`: a one-slot batching engine), once for the
    tests that compare with it."""
    return [run_alone(solo, job) for job in mixed_jobs(voices)]


def test_concurrent_requests_match_each_run_alone(tiny_checkpoint, alone, voices):
    jobs = mixed_jobs(voices)
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=8)
    with batcher:
        tickets = [batcher.submit(job) for job in jobs]  # ten jobs, eight slots: two wait for a free one
        batched = [t.result() for t in tickets]
    lengths = {r.frames for r in alone}
    assert len(lengths) > 5, "the jobs should end at different frames"
    assert any(r.frames < j.params.max_new_tokens for r, j in zip(alone, jobs)), "some should stop on <|im_end|>"
    for job, a, b in zip(jobs, alone, batched):
        assert torch.equal(a.codes, b.codes), job
        np.testing.assert_allclose(b.audio, a.audio, atol=1e-5)
    # Every step ran several requests at once: far fewer steps than frames.
    assert batcher.steps < 0.5 * sum(r.frames for r in alone)


def test_admissions_padded_as_captured_ones_give_the_same_codes(tiny_checkpoint, alone, voices, monkeypatch):
    """On CUDA, prompts from position 0 (no reused voice prefix) are admitted by graphs
    captured for a few (batch, width) shapes: padded to a power-of-two width (at least
    32), spare rows repeating the first prompt into its own cache row, causal attention.
    The same padding, run eagerly here, leaves every code as it was; prompts after a
    prefix are admitted apart, unpadded."""
    monkeypatch.setattr(ModelRunner, "_admission_shape",
                        lambda self, b, w: admission_shape(b, w, self.slots, self.max_seq_len))
    jobs = mixed_jobs(voices)[:7]  # jobs 0, 3 and 6 without a voice
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=8)
    shapes, admission_inputs = [], batcher.runner._admission_inputs

    def recording(group):
        inputs = admission_inputs(group)
        shapes.append((len(group), inputs[0].shape[0], inputs[0].shape[-1], inputs[-1]))  # prompts, rows, width, from 0
        return inputs

    batcher.runner._admission_inputs = recording
    with batcher:
        with batcher._lock:  # all seven admitted in one step
            tickets = [batcher.submit(job) for job in jobs]
        batched = [t.result() for t in tickets]
    first = shapes[:2]
    assert first[0][0] == 3 and first[0][1] == 4 and first[0][2] in (32, 64) and first[0][3], shapes
    assert first[1][0] == 4 and first[1][1] == 4 and not first[1][3], shapes
    for job, a, b in zip(jobs, alone, batched):
        assert torch.equal(b.codes, a.codes), job


@pytest.mark.parametrize("repeats, ramp", [(1, [2, 4, 8, 8]), (3, [2, 2, 2, 4, 4, 4, 8, 8])])
def test_streamed_pieces_concatenate_to_the_whole(tiny_checkpoint, voices, repeats, ramp):
    """Pieces on the schedule (each length `repeats` times before it doubles) join into the
    whole request's audio."""
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=4,
                          first_piece=2, largest_piece=8, piece_repeats=repeats)
    job = Job(TEXTS[1], references=(voices[0],), chunk_length=60, params=SamplingParams(seed=3, max_new_tokens=60))
    with batcher:
        whole = batcher.submit(job).result()
        ticket = batcher.submit(Job(**{**job.__dict__, "stream": True}))
        pieces = [p for kind, p in ticket.events() if kind == "audio"]
    frames = [len(p) // batcher.engine.frame_length for p in pieces]
    assert frames[: len(ramp)] == ramp and sum(frames) == whole.frames
    # Float32 convolutions on the CPU sum in an order that depends on the threads they get: a
    # few 1e-6 apart on a loaded machine, where a misplaced frame would be 1e-1.
    np.testing.assert_allclose(np.concatenate(pieces), whole.audio, atol=1e-5)
    # Decoded piece by piece, the audio is the codec's whole-sequence decode.
    with torch.inference_mode():
        at_once = batcher.engine.codec.decode(whole.codes[None])[0].numpy()
    np.testing.assert_allclose(whole.audio, at_once, atol=1e-4)


def test_streams_paced_to_their_listeners_give_the_codes_they_give_alone(tiny_checkpoint, alone, voices):
    """Streams that take turns (at most two rows a step, and yielding whenever their listener has
    0.1 s buffered) in every order still give each request its own codes. (When a stream yields
    is the scheduler's tests' subject, on a clock of their own: here the machine's speed would
    decide it.)"""
    jobs = [Job(**{**job.__dict__, "stream": True}) for job in mixed_jobs(voices)[:4]]
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=4,
                          horizon_s=0.1, step_rows=2)
    scheduler, yielded = batcher.scheduler, []
    decoding = scheduler.decoding

    def counted():
        rows = decoding()
        yielded.append(len(scheduler.table.wanting()) - len(rows))
        return rows

    scheduler.decoding = counted
    with batcher:
        tickets = [batcher.submit(job) for job in jobs]
        paced = [t.result() for t in tickets]
    for a, b in zip(alone, paced):
        assert torch.equal(b.codes, a.codes)
    assert sum(yielded) > 0, "streams should have yielded turns"


def test_overload_is_refused_at_once_and_cancel_frees_the_slot(tiny_checkpoint):
    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=1, max_queue=1)
    long_job = Job("A long utterance that keeps its slot busy.", params=SamplingParams(seed=0, max_new_tokens=2000))
    with batcher:
        first = batcher.submit(long_job)
        _wait(lambda: batcher.load()["active"] == 1)
        queued = batcher.submit(long_job)  # the one queue place
        with pytest.raises(Overloaded):
            batcher.submit(long_job)
        # Refused while the slot and the queue place were still held: it did not wait for either.
        assert batcher.load() == {"slots": 1, "active": 1, "waiting": 1, "max_queue": 1}
        first.cancel()  # as a client disconnecting does
        _wait(lambda: batcher.load() == {"slots": 1, "active": 1, "waiting": 0, "max_queue": 1})
        queued.cancel()
        _wait(lambda: batcher.load()["active"] == 0)
        done = batcher.submit(Job("Now it is free.", params=SamplingParams(seed=1, max_new_tokens=8))).result()
    assert done.frames == 8


def test_the_step_s_launch_is_counted_within_its_phase(solo):
    """The engine's stats split the decode step's launch (its graph's replay, here the eager
    step) out of the step phase: a part of it, for every step run."""
    batcher = BatchEngine(solo, max_batch=2)
    with batcher:
        before = batcher.stats.snapshot()
        for ticket in [batcher.submit(Job(text, params=SamplingParams(seed=i, max_new_tokens=6)))
                       for i, text in enumerate(TEXTS[:2])]:
            ticket.result()
        after = batcher.stats.snapshot()
    launch = after["launch_s"] - before["launch_s"]
    assert after["steps"] > before["steps"] and 0 < launch <= after["phases_s"]["step"] - before["phases_s"]["step"]


def test_a_closed_loop_level_keeps_each_client_to_one_request_at_a_time(tiny_checkpoint, monkeypatch):
    from benchmarks import engine as benchmark

    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=2, max_queue=0)
    submit, tickets = batcher.submit, []

    def recorded(job, sink=None):  # (with no queue place, a third request in flight is refused)
        tickets.append(submit(job, sink))
        return tickets[-1]

    monkeypatch.setattr(batcher, "submit", recorded)
    with batcher:
        level = benchmark.batching_level(batcher, 2, 6, True, rounds=3)
    assert level["rounds"] == 3 and level["stopped_early"] == 0
    assert level["aggregate_frames_per_s"] * level["wall_s"] == pytest.approx(2 * 3 * 6)
    # The decode span: inside the wall, and every frame after each request's first counted in it.
    assert 0 < level["decode_span_s"] < level["wall_s"]
    assert level["aggregate_decode_frames_per_s"] * level["decode_span_s"] == pytest.approx(2 * 3 * 5)
    assert len({t.job.params.seed for t in tickets}) == 6
    # The steady window ends with the first client's last frame: inside the span, and it holds
    # at least that client's frames after its first request's first (it started the span or
    # started with it) and no more than every frame.
    last = [max(t.submitted + t.timings["queue"] + t.timings["generate"] for t in tickets
                if t.job.params.seed % 2 == c) for c in (0, 1)]  # client c sends seeds c, 2 + c, 4 + c
    first = min(t.submitted + t.timings["first_frame"] for t in tickets)
    assert level["steady_window_s"] == pytest.approx(min(last) - first)
    assert 0 < level["steady_window_s"] <= level["decode_span_s"]
    frames = level["steady_decode_frames_per_s"] * level["steady_window_s"]
    assert 2 * 5 <= frames <= 2 * 3 * 5 + 1e-6


def test_steady_window_counts_each_request_pro_rata():
    from benchmarks.engine import _overlap

    assert _overlap(1.0, 3.0, 0.0, 5.0) == 1.0  # wholly inside
    assert _overlap(1.0, 3.0, 2.0, 5.0) == pytest.approx(0.5)  # half after the start
    assert _overlap(1.0, 3.0, 0.0, 1.5) == pytest.approx(0.25)  # a quarter before the end
    assert _overlap(4.0, 6.0, 0.0, 3.0) == 0.0  # after the window
    assert _overlap(2.0, 2.0, 0.0, 3.0) == 1.0 and _overlap(4.0, 4.0, 0.0, 3.0) == 0.0  # one frame


def test_the_codec_precision_reaches_the_streaming_codec(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    fast = BatchEngine(engine, max_batch=1)._codec.codec  # on a GPU: float16 back and front
    assert fast.front_tf32 and fast.back.dtype == fast.front.dtype == engine.codec.dtype  # (the CPU's stay float32)
    exact = BatchEngine(engine, max_batch=1, codec_precision="float32")._codec.codec
    assert not exact.front_tf32 and exact.back.dtype == exact.front.dtype == engine.codec.dtype == torch.float32
    with pytest.raises(ValueError, match="codec precision 'float16'"):
        BatchEngine(engine, max_batch=1, codec_precision="float16")


def test_bad_jobs_fail_alone(tiny_checkpoint):
    """A prompt too long for the cache fails in the same admission as two good ones, which
    start first; retiring it moves the last good one into its slot, which must not change
    that one's codes."""
    solo = Engine.from_pretrained(tiny_checkpoint, device="cpu", max_seq_len=64)
    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu", max_seq_len=64), max_batch=3)
    good = [Job(text, params=SamplingParams(seed=i, max_new_tokens=5)) for i, text in enumerate(("Fine.", "Also fine."))]
    with batcher:
        with pytest.raises(Exception, match="non-empty"):
            batcher.submit(Job("   "))
        with batcher._lock:  # all three wait for the same admission
            tickets = [batcher.submit(good[0]),
                       batcher.submit(Job("word " * 200, chunk_length=1000, params=SamplingParams(seed=0))),
                       batcher.submit(good[1])]
        with pytest.raises(Exception, match="prompt is"):
            tickets[1].result()
        results = [tickets[0].result(), tickets[2].result()]
    for job, result in zip(good, results):
        assert result.frames == 5 and torch.equal(result.codes, run_alone(solo, job).codes)


def test_prompts_beyond_one_prefill_are_split(tiny_checkpoint, solo, monkeypatch):
    """With a small prefill budget the admissions run as several padded prefills; codes are unchanged."""
    from fish_sm.engine.batching import runner

    monkeypatch.setattr(runner, "PREFILL_TOKENS", 48)
    jobs = [Job(text, params=SamplingParams(seed=i, max_new_tokens=12)) for i, text in enumerate(TEXTS)]
    groups = runner._prefill_groups([(None, torch.zeros(11, n), 0) for n in (10, 12, 20, 30)])
    assert [len(g) for g in groups] == [2, 1, 1]
    # Bounded by the captured shapes they pad to, a burst goes as groups that graphs take.
    monkeypatch.setattr(runner, "PREFILL_TOKENS", 4096)
    burst = runner._prefill_groups([(None, torch.zeros(11, 39), 0)] * 100,
                                   lambda b, w: admission_shape(b, w, 512, 2048))
    assert [len(g) for g in burst] == [64, 36]
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=4)
    with batcher:
        with batcher._lock:
            tickets = [batcher.submit(job) for job in jobs]
        batched = [t.result() for t in tickets]
    for job, b in zip(jobs, batched):
        assert torch.equal(b.codes, run_alone(solo, job).codes), job


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes(64, 2) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert batch_sizes(100, 2)[-3:] == [64, 96, 100]
    assert batch_sizes(40, 4) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40]


def _wait(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_codec_failure_fails_only_its_request(tiny_checkpoint, solo):
    """A batch of pieces that fails is retried piece by piece, each stream from the state it
    had before (the pieces of batches that ran before the failure are delivered as they came):
    the request whose piece fails gets the error, the others in that batch still get their
    whole audio."""
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=4)
    codec = batcher._codec.codec
    half, cursed = codec._half, []

    def failing(graphs, run, n, b, lanes, starts, x):
        if graphs is codec.backs:  # a batch of backs
            cursed[:] = cursed or [int(lanes[0])]  # the lane of the first piece the codec ever decodes
            if cursed[0] in lanes[:b].tolist():  # (this batch's lanes have not moved on: its commits come after its back)
                if b == 1:  # retried alone, it fails for good: its lane serves the next one
                    cursed[0] = -1
                raise RuntimeError("codec broke")
        return half(graphs, run, n, b, lanes, starts, x)

    codec._half = failing
    jobs = [Job(TEXTS[i % 4], params=SamplingParams(seed=i, max_new_tokens=12)) for i in range(3)]
    with batcher:
        with batcher._lock:  # all three admitted in one step: their first pieces one batch
            tickets = [batcher.submit(job) for job in jobs]
        outcomes = []
        for ticket in tickets:
            try:
                outcomes.append(ticket.result())
            except RuntimeError as exc:
                outcomes.append(exc)
        later = Job(TEXTS[3], params=SamplingParams(seed=7, max_new_tokens=12))
        after = batcher.submit(later).result()  # the worker lives on
    failed = [o for o in outcomes if isinstance(o, RuntimeError)]
    assert len(failed) == 1 and str(failed[0]) == "codec broke"
    for job, out in zip(jobs, outcomes):
        if not isinstance(out, RuntimeError):
            np.testing.assert_allclose(out.audio, run_alone(solo, job).audio, atol=1e-4)
    np.testing.assert_allclose(after.audio, run_alone(solo, later).audio, atol=1e-4)


def decode_next(worker: CodecWorker) -> bool:
    """One batch of ready pieces decoded and delivered, as the worker's thread does with its
    queue drained: False when no piece is due."""
    batch = worker._launch()
    if batch is None:
        return False
    worker._finish(batch)
    return True


class HandDriven:
    """A codec worker not started, driven by hand as the engine drives it: a stream opened in a
    lane per ticket, frames handed over a step (one frame a stream) at a time."""

    def __init__(self, worker: CodecWorker):
        self.worker, self.events, self.audio, self.lane = worker, {}, {}, {}
        self.heard: list[str] = []  # whose audio came, in order

    def open(self, name: str, stream: bool = True) -> str:
        ticket = Ticket(Job(TEXTS[0], stream=stream), sink=lambda event: self._heard(name, event))
        self.lane[name] = self.worker.lanes.take()
        self.worker._take("open", self.lane[name], ticket)
        return name

    def _heard(self, name: str, event) -> None:
        self.events.setdefault(name, []).append(event[0])
        if event[0] == "audio":
            self.audio.setdefault(name, []).append(event[1])
            self.heard.append(name)

    def give(self, name: str, codes: list) -> None:
        for frame in codes:
            self.worker._take("frames", np.array([self.lane[name]]), np.asarray(frame)[None])

    def finish(self, name: str, spoken: list) -> None:
        self.worker._take("finish", self.lane[name], [np.stack(spoken, axis=1)] if spoken else [])

    def state(self, name: str):
        return self.worker._state, self.lane[name]


def frozen_clock(monkeypatch) -> list[float]:
    """The codec worker's clock, moved by hand."""
    from fish_sm.engine.batching import codec_worker

    clock = [100.0]
    monkeypatch.setattr(codec_worker.time, "perf_counter", lambda: clock[0])
    return clock


def test_with_nothing_on_the_gpu_every_ready_piece_goes_in_one_batch(solo):
    """Pieces of several lengths, first pieces and long ones, share a batch when the GPU has
    none: no piece waits behind a round of others."""
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
    hand = HandDriven(worker)
    rng = np.random.default_rng(0)
    frames = lambda n: list(rng.integers(0, 1024, (n, solo.config.num_codebooks)))
    playing = [hand.open(f"playing{i}") for i in range(3)]
    for name in playing:
        hand.give(name, frames(4 + 8 + 16 + 32))
    while decode_next(worker):  # their first four pieces, one batch each
        pass
    assert all(hand.events[name] == ["audio"] * 4 for name in playing)
    for name in playing:
        hand.give(name, frames(64))
    hand.open("new")
    hand.give("new", frames(4))
    batch = worker._launch()
    assert sorted(batch.taken.tolist()) == [4, 64, 64, 64]
    hand.heard.clear()
    worker._finish(batch)
    assert hand.events["new"] == ["audio"] and all(len(hand.events[name]) == 5 for name in playing)
    assert hand.heard[0] == "new"  # the shortest pieces run first, and their audio goes at once
    assert not decode_next(worker)


def test_a_batch_that_fails_after_its_short_pieces_ran_delivers_them_once(solo):
    """A batch whose longer pieces fail after its shorter ones ran (`PartlyRun`): the pieces
    that ran are delivered as they came, not decoded a second time from a state that has moved
    on, and the others retried alone; each stream's audio is its codes' whole decode."""
    worker = CodecWorker(solo, first_piece=4, largest_piece=16, lanes=4)
    hand = HandDriven(worker)
    rng = np.random.default_rng(5)
    codes = {name: list(rng.integers(0, 1024, (28, solo.config.num_codebooks))) for name in ("a", "b")}
    a, b = hand.open("a"), hand.open("b")
    hand.give(a, codes[a][:4])
    hand.give(b, codes[b][:4])
    assert decode_next(worker)  # both first pieces
    hand.give(a, codes[a][4:12])
    assert decode_next(worker)  # a's second
    hand.give(a, codes[a][12:28])  # a's third piece: 16 frames
    hand.give(b, codes[b][4:12])  # b's second: 8, from the state its first left
    codec, half, broke = worker.codec, worker.codec._half, []

    def failing_once(graphs, run, n, batch, lanes, starts, x):
        if graphs is codec.backs and n == 16 and not broke:
            broke.append(n)
            raise RuntimeError("codec broke")
        return half(graphs, run, n, batch, lanes, starts, x)

    codec._half = failing_once
    assert decode_next(worker)  # b's piece ran, a's failed: b's is delivered and a's retried alone
    assert broke and hand.events[a] == ["audio"] * 3 and hand.events[b] == ["audio"] * 2
    hand.give(b, codes[b][12:28])
    while decode_next(worker):
        pass
    with torch.inference_mode():
        for name in (a, b):
            whole = solo.codec.decode(torch.from_numpy(np.stack(codes[name], axis=1))[None])[0].numpy()
            np.testing.assert_allclose(np.concatenate(hand.audio[name]), whole, atol=1e-4)


def test_while_a_batch_is_on_the_gpu_pieces_with_audio_to_spare_wait(solo, monkeypatch):
    """With a batch on the GPU, a piece goes in the next only when it is urgent (its listener
    has less than `spare_s` of audio left, or it is a stream's first or last piece) or a full
    batch of its length is ready; the others wait for the batch, gathering company. A whole
    request's piece waits at most `whole_wait_s`."""
    clock = frozen_clock(monkeypatch)
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=16)
    worker.codec.max_batch_frames = 128  # two pieces of 64 fill a batch
    hand = HandDriven(worker)
    rng = np.random.default_rng(2)
    frames = lambda n: list(rng.integers(0, 1024, (n, solo.config.num_codebooks)))
    a, b, other, whole = hand.open("a"), hand.open("b"), hand.open("other"), hand.open("whole", stream=False)
    hand.give(a, frames(4 + 8 + 16 + 32))
    hand.give(b, frames(4 + 8 + 16 + 32))
    hand.give(other, frames(4 + 8))
    while decode_next(worker):  # a and b: 2.79 s of audio given, other 0.56 s, none played yet
        pass

    def first_piece(name: str):
        hand.open(name)
        hand.give(name, frames(4))
        return worker._launch()

    flying = first_piece("x0")
    assert flying.lanes.tolist() == [hand.lane["x0"]]
    hand.give(a, frames(64))
    hand.give(other, frames(16))
    assert worker._launch() is None  # both have audio to spare: they wait for the batch on the GPU
    state, lane = hand.state(other)
    clock[0] = state.playing_since[lane] + state.given_s[lane] - worker.spare_s / 2  # its listener nearly caught up
    due = worker._launch()
    assert due.lanes.tolist() == [lane]  # a, with seconds left, still waits
    hand.give(b, frames(64))
    full = worker._launch()  # two pieces of 64: a full batch goes
    assert sorted(full.lanes.tolist()) == sorted([hand.lane[a], hand.lane[b]])
    for batch in (flying, due, full):
        worker._finish(batch)
    assert [len(hand.events[name]) for name in (a, b, other)] == [5, 5, 3]

    flying = first_piece("x1")
    fresh = first_piece("x2")  # a stream's first piece goes at once, beside a batch on the GPU
    assert fresh.lanes.tolist() == [hand.lane["x2"]]
    hand.give(whole, frames(4))
    started = worker._launch()
    assert started.lanes.tolist() == [hand.lane[whole]]  # a whole request's first piece too
    worker._finish(started)  # (the other two still on the GPU)
    hand.give(whole, frames(8))
    hand.give(a, frames(30))  # short of a's next piece
    assert worker._launch() is None  # the whole request's second piece waits ...
    clock[0] += worker.whole_wait_s
    assert worker._launch().lanes.tolist() == [hand.lane[whole]]  # ... whole_wait_s at most
    hand.finish(a, [])  # a's last frames are in: its short last piece goes at once
    last = worker._launch()
    assert last.lanes.tolist() == [hand.lane[a]] and last.taken.tolist() == [30]


def test_a_batch_holds_the_pieces_wanted_soonest(solo, monkeypatch):
    """More pieces due than a batch holds (`max_frames`): those whose listeners run out of
    audio first go, the others in the next batch."""
    frozen_clock(monkeypatch)  # (deadlines from given audio alone)
    worker = CodecWorker(solo, first_piece=4, largest_piece=8, lanes=8)
    worker.codec.max_batch_frames = 8  # one piece of 8 fills a back's batch ...
    worker.max_frames = 16  # ... and a batch holds two at most
    hand = HandDriven(worker)
    rng = np.random.default_rng(1)
    frames = lambda n: list(rng.integers(0, 1024, (n, solo.config.num_codebooks)))
    names = [hand.open(f"s{i}") for i in range(4)]
    for i, name in enumerate(names):  # s3 has the least audio given, s0 the most
        hand.give(name, frames(4 + 8 * (3 - i)))
        while decode_next(worker):
            pass
    for name in names:
        hand.give(name, frames(8))
    ahead = worker._launch()  # nothing on the GPU: every piece is due, two at a time
    assert sorted(ahead.lanes.tolist()) == sorted([hand.lane["s3"], hand.lane["s2"]])
    following = worker._launch()
    assert sorted(following.lanes.tolist()) == sorted([hand.lane["s1"], hand.lane["s0"]])
    worker._finish(ahead)
    worker._finish(following)
    assert [len(hand.events[name]) for name in names] == [5, 4, 3, 2]


def test_a_session_s_next_sentence_starts_without_waiting_for_company(solo, monkeypatch):
    """A session's next sentence starts a codec stream afresh: its first piece goes at once
    beside a batch on the GPU, though the listener has seconds of the last sentence to play;
    its next piece waits as a stream's would."""
    frozen_clock(monkeypatch)
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
    hand = HandDriven(worker)
    rng = np.random.default_rng(4)
    frames = lambda n: list(rng.integers(0, 1024, (n, solo.config.num_codebooks)))
    agent, other = hand.open("agent"), hand.open("other")
    hand.give(agent, frames(4 + 8 + 16))
    while decode_next(worker):
        pass
    worker._take("sentence", hand.lane[agent], 0)  # its first sentence ends with the frames given
    assert hand.events[agent] == ["audio", "audio", "audio", "spoken"]
    state, lane = hand.state(agent)
    assert state.pieces[lane] == 0 and state.spare(np.array([lane]), 100.0)[0] > worker.spare_s
    hand.give(other, frames(4))
    flying = worker._launch()
    hand.give(agent, frames(4 + 8))
    first = worker._launch()
    assert first.lanes.tolist() == [lane]  # the next sentence's first piece
    worker._finish(first)
    assert hand.events[agent][-1] == "audio"
    assert worker._launch() is None  # its second waits for company, as a stream's does
    worker._finish(flying)
    assert decode_next(worker) and len(hand.events[agent]) == 6


def test_batches_queued_ahead_give_each_stream_the_audio_of_batches_run_in_turn(solo):
    """Two batches on the GPU at once (the worker's `depth`): a lane with a piece in the first
    has none in the second, and every stream gets, in order, the samples that batches chosen
    and decoded one at a time give it."""
    rng = np.random.default_rng(5)
    given = {f"s{i}": list(rng.integers(0, 1024, (4 + 8 + 16, solo.config.num_codebooks))) for i in range(3)}
    heard = {}
    for ahead in (False, True):
        worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
        hand = HandDriven(worker)
        for name, codes in given.items():
            hand.open(name)
            hand.give(name, codes[:4] if name == "s2" else codes)
        if ahead:
            first = worker._launch()  # every stream's first piece
            hand.give("s2", given["s2"][4:])
            second = worker._launch()
            assert second is None  # each lane has its piece in the first batch
            worker._finish(first)
            second = worker._launch()
            assert sorted(second.lanes) == [hand.lane["s0"], hand.lane["s1"], hand.lane["s2"]]
            third = worker._launch()
            assert third is None
            worker._finish(second)
            while (batch := worker._launch()) is not None:
                ahead_of = worker._launch()  # nothing else ready: every ready lane is in `batch`
                assert ahead_of is None
                worker._finish(batch)
        else:
            assert decode_next(worker)
            hand.give("s2", given["s2"][4:])
            while decode_next(worker):
                pass
        assert all(len(hand.audio[name]) == 3 for name in given)
        heard[ahead] = {name: np.concatenate(hand.audio[name]) for name in given}
    for name in given:
        np.testing.assert_array_equal(heard[True][name], heard[False][name])


def test_a_stream_cut_or_ended_while_its_piece_is_on_the_gpu_gets_none_of_it(solo):
    """A clear, a sentence's end or a cancel that the worker takes in while a batch holding the
    stream's piece is still on the GPU: the cut piece's audio is not delivered (a clear), the
    sentence's "spoken" follows its audio (its end), and a lane given back and taken by another
    stream meanwhile never gets the old stream's audio (a cancel)."""
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
    hand = HandDriven(worker)
    rng = np.random.default_rng(6)
    frames = lambda n: list(rng.integers(0, 1024, (n, solo.config.num_codebooks)))
    cut, ends, gone = hand.open("cut"), hand.open("ends"), hand.open("gone")
    for name in (cut, ends, gone):
        hand.give(name, frames(4))
    batch = worker._launch()
    worker._take("clear", hand.lane[cut], None)
    worker._take("sentence", hand.lane[ends], 0)  # its sentence is the piece on the GPU
    assert ends not in hand.events  # not spoken before its audio
    lane = hand.lane[gone]
    worker._take("cancel", lane, None)
    assert worker.lanes.take() == lane
    hand.lane["new"] = lane
    worker._take("open", lane, Ticket(Job(TEXTS[0], stream=True), sink=lambda event: hand._heard("new", event)))
    new_codes = frames(4)
    hand.give("new", new_codes)
    # A stream that starts afresh reads none of its lane's state: its piece may go at once (the
    # GPU runs it after the flying batch, whose state it overwrites).
    fresh = worker._launch()
    assert list(fresh.lanes) == [lane]
    worker._finish(batch)
    assert hand.events[cut] == ["cleared"] and hand.events[ends] == ["audio", "spoken"]
    assert "gone" not in hand.events and "new" not in hand.events
    worker._finish(fresh)
    state, _ = hand.state(cut)
    assert state.pieces[hand.lane[cut]] == 0 and state.pieces[lane] == 1
    hand.give(cut, frames(4))
    while decode_next(worker):
        pass
    assert hand.events[cut] == ["cleared", "audio"] and hand.events["new"] == ["audio"]
    alone = HandDriven(CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8))
    alone.open("new")
    alone.give("new", new_codes)
    assert decode_next(alone.worker)
    np.testing.assert_array_equal(hand.audio["new"][0], alone.audio["new"][0])


def test_a_lane_ring_grows_when_a_stream_s_codec_falls_behind(solo):
    """Frames pile up in a lane beyond its ring (the codec far behind the decode loop): the ring
    grows, and every frame comes out as it went in. Lanes are as many as the codec was sized for."""
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
    hand = HandDriven(worker)
    rng = np.random.default_rng(3)
    others = {hand.open(f"other{i}"): rng.integers(0, 1024, (5, solo.config.num_codebooks)) for i in range(2)}
    for other, codes in others.items():
        hand.give(other, list(codes))
    name = hand.open("long")
    given = rng.integers(0, 1024, (700, solo.config.num_codebooks))
    hand.give(name, list(given))
    state, lane = hand.state(name)
    assert state.ring.shape[-1] >= 700
    np.testing.assert_array_equal(state.read(np.array([lane]), 700)[0], given.T)
    for other, codes in others.items():  # the others' frames kept their places
        np.testing.assert_array_equal(state.read(np.array([hand.lane[other]]), 5)[0], codes.T)
    assert worker.lanes.free() == 5
    for i in range(5):
        hand.open(f"many{i}")
    assert worker.lanes.free() == 0
    with pytest.raises(RuntimeError, match="every one of the codec's 8 lanes is taken"):
        worker.lanes.take()
    worker.lanes.release(hand.lane["many0"])
    assert worker.lanes.free() == 1 and worker.lanes.take() == hand.lane["many0"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_host_copies_both_ways_keep_values_and_use_pinned_memory(device):
    """What the decode loop and the codec thread copy between host and GPU: on CUDA through
    pinned memory, asynchronously (a pageable copy stalled the other thread's CUDA calls)."""
    x = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    on = to_device(x, torch.device(device))
    back = HostCopy(on * 2)
    assert on.device.type == device and torch.equal(on.cpu(), x)
    assert torch.equal(back.get(), x * 2)
    assert back.get().is_pinned() == (device == "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_thread_s_waits_for_the_gpu_are_counted_apart_from_its_work(device):
    """A `WaitClock` adds up the wall and CPU time of the waits it is held around (their CPU: a
    driver spinning in them); `HostCopy.get` counts its wait on one, and on the CPU, where
    there is nothing to wait for, counts none."""
    clock = WaitClock()
    with clock:
        time.sleep(0.02)
    assert clock.wall_s >= 0.02 and clock.cpu_s < clock.wall_s
    with clock:  # a spin
        began = time.thread_time()
        while time.thread_time() - began < 0.01:
            pass
    assert 0.01 <= clock.cpu_s <= clock.wall_s
    x = torch.arange(6, dtype=torch.float32, device=device)
    waits = WaitClock()
    assert torch.equal(HostCopy(x * 2).get(waits), torch.arange(6.0) * 2)
    assert (waits.wall_s > 0) == (device == "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_staged_copies_keep_every_array_through_the_ring(device):
    """A step's arrays go to the GPU as one copy through a ring of pinned buffers: each array
    arrives whole, aligned, with its dtype and shape, also after the ring has wrapped (and one
    too large for the buffers goes on its own)."""
    staging = HostStaging(torch.device(device), nbytes=1024, depth=2)
    rng = np.random.default_rng(0)
    for turn in range(5):
        ints = rng.integers(-2**62, 2**62, (5, 7 + turn))
        floats = rng.standard_normal((3, 7 + turn, 1)).astype(np.float32)
        small = np.arange(3)
        a, b, c = staging.copy(ints, floats, small)
        assert [t.device.type for t in (a, b, c)] == [device] * 3
        assert a.dtype == torch.int64 and b.dtype == torch.float32 and b.shape == (3, 7 + turn, 1)
        if device == "cuda":
            assert all(t.data_ptr() % HostStaging.ALIGN == 0 for t in (a, b, c))
        np.testing.assert_array_equal(a.cpu().numpy(), ints)
        np.testing.assert_array_equal(b.cpu().numpy(), floats)
        np.testing.assert_array_equal(c.cpu().numpy(), small)
    big = np.arange(1000)
    (out,) = staging.copy(big)
    np.testing.assert_array_equal(out.cpu().numpy(), big)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_queued_ahead_on_the_gpu_give_the_audio_of_batches_run_in_turn_on_cuda(tiny_checkpoint):
    """The codec thread with two batches on the GPU at once (captured graphs replayed back to
    back, each lane's state committed in stream order) gives every stream the samples it gives
    with one batch at a time, streams that start in a lane given back meanwhile included."""
    engine = Engine.from_pretrained(tiny_checkpoint, device="cuda")
    rng = np.random.default_rng(7)
    waves = [[rng.integers(0, 1024, (engine.config.num_codebooks, int(n))) for n in rng.integers(30, 140, 12)]
             for _ in range(2)]  # two waves of streams: the second's lanes are the first's, given back
    heard = {}
    for depth in (1, 2):
        worker = CodecWorker(engine, first_piece=4, largest_piece=16, depth=depth, lanes=12)
        worker.capture()
        worker.start()
        heard[depth] = []
        for wave in waves:
            tickets = [Ticket(Job("x", stream=True)) for _ in wave]
            lanes = [worker.lanes.take() for _ in wave]
            for lane, ticket in zip(lanes, tickets):
                worker.open(lane, ticket)
            for i in range(max(c.shape[1] for c in wave)):
                live = [(lane, c[:, i]) for lane, c in zip(lanes, wave) if i < c.shape[1]]
                worker.frames(np.array([lane for lane, _ in live]), np.stack([frame for _, frame in live]))
                for lane, c in zip(lanes, wave):
                    if i == c.shape[1] - 1:
                        worker.finish(lane, [c])
            for ticket in tickets:
                audio = [payload for kind, payload in ticket.events() if kind == "audio"]
                heard[depth].append(np.concatenate(audio))
        worker.stop()
    for one, two in zip(heard[1], heard[2]):
        np.testing.assert_array_equal(one, two)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steady_decoding_never_synchronizes_with_the_gpu_on_cuda(tiny_checkpoint):
    """Once every stream is admitted, the loop's iterations (the schedule, the step's staged
    inputs and replay, the stop checks on the frames copied home, the codec's pushes and audio)
    wait for the GPU only on their events: a `.item()`, `.cpu()`, pageable copy or synchronize,
    per row or per step, would hold the loop and every launch of the codec's thread with it.
    Steady decoding of 8 streams runs under torch's sync debug mode set to raise, where such an
    op fails the engine and so its requests."""
    frames = 1000
    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cuda"), max_batch=8, forced_lengths=True,
                          horizon_s=0.0)  # every stream decodes at every step
    batcher.compile(capture_all=True)  # nothing left to capture while serving
    jobs = [Job(TEXTS[i % len(TEXTS)], stream=True, params=SamplingParams(seed=i, max_new_tokens=frames))
            for i in range(8)]
    with batcher:
        tickets = [batcher.submit(job) for job in jobs]
        _wait(lambda: batcher.load()["active"] == 8)
        admitted = batcher.steps
        _wait(lambda: batcher.steps >= admitted + 4)  # past the admissions and first frames
        torch.cuda.set_sync_debug_mode("error")
        try:
            began = batcher.steps
            _wait(lambda: batcher.steps >= began + 50 or not batcher.alive())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert batcher.alive(), repr(batcher.failure)
        results = [ticket.result() for ticket in tickets]
    assert [r.frames for r in results] == [frames] * 8


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_the_second_gpu_gives_the_codes_of_one_on_the_first(tiny_checkpoint):
    """An engine loaded on cuda:1, as the second engine core loads it, runs there (its Triton
    kernels, events and side streams on its own GPU, which loading makes current) and gives the
    codes that an engine on cuda:0 gives."""
    codes = []
    try:
        for index in (0, 1):
            engine = Engine.from_pretrained(tiny_checkpoint, device=f"cuda:{index}")
            assert torch.cuda.current_device() == index
            result = engine.synthesize(TEXTS[0], seed=3, max_new_tokens=24)
            engine.batching().stop()
            codes.append(result.codes.cpu())
            del engine
    finally:
        torch.cuda.set_device(0)
    torch.testing.assert_close(codes[0], codes[1], rtol=0, atol=0)


SENTENCES = ["The first sentence is here.", "A second one follows it now.", "And the third ends it all."]


def test_a_session_speaks_each_sentence_as_it_arrives_with_the_codes_of_the_long_text(tiny_checkpoint, solo):
    """Sentences given one at a time (the session idle in between) give the codes of the same
    sentences spoken as one long text, a chunk each, with the same seed; each sentence's audio
    is its own codes decoded alone, followed by its ("spoken", i)."""
    params = SamplingParams(seed=5, max_new_tokens=30)
    whole = run_alone(solo, Job(" ".join(SENTENCES), chunk_length=30, params=params))
    batcher = BatchEngine(stopping(Engine.from_pretrained(tiny_checkpoint, device="cpu")), max_batch=2)
    with batcher:
        session = batcher.open_session(Job("", chunk_length=30, params=params, stream=True))
        events = session.events()
        heard: list[list] = [[] for _ in SENTENCES]
        for i, sentence in enumerate(SENTENCES):
            session.speak(sentence)
            for kind, payload in events:  # this sentence's audio, then its end, before the next one is given
                if kind == "audio":
                    heard[i].append(payload)
                if kind == "spoken":
                    assert payload == i
                    assert batcher.load()["active"] == 0  # idle between sentences: parked, its slot free
                    break
                assert kind in ("admitted", "audio"), (kind, payload)
        session.close()
        rest = list(events)
    assert [kind for kind, _ in rest] == ["done"]
    assert torch.equal(rest[-1][1].codes, whole.codes)
    start = 0
    for pieces in heard:
        audio = np.concatenate(pieces)
        frames = len(audio) // batcher.engine.frame_length
        with torch.inference_mode():
            alone_audio = batcher.engine.codec.decode(whole.codes[None, :, start : start + frames])[0].numpy()
        np.testing.assert_allclose(audio, alone_audio, atol=1e-4)
        start += frames
    assert start == whole.frames


def test_a_cleared_session_keeps_its_slot_and_speaks_only_what_follows(tiny_checkpoint, solo):
    """`Session.clear` (barge-in that keeps the session), active and still waiting: what was
    given before it is never spoken (the cut sentence stops, its frames are dropped), ("cleared",
    None) comes after the audio that was already out, and a sentence after it is spoken with its
    index, from a prompt without the cut one: the codes a fresh session would give it."""
    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=1, max_queue=1)
    long = SamplingParams(seed=0, max_new_tokens=500)
    with batcher:
        first = batcher.open_session(Job("", params=long, stream=True))
        first.speak("A sentence long enough to be cut off while it is spoken.")
        events = first.events()
        assert [next(events)[0] for _ in range(2)] == ["admitted", "audio"]
        waiting = batcher.open_session(Job("Never spoken.", params=SamplingParams(seed=2, max_new_tokens=8),
                                           stream=True))  # one slot: it waits
        waiting.speak("Nor this.")
        waiting.clear()
        assert next(waiting.events()) == ("cleared", None)  # at once: nothing of it was out
        first.clear()
        kinds = []
        for kind, _ in events:
            kinds.append(kind)
            if kind == "cleared":
                break
        assert set(kinds) <= {"audio", "cleared"}
        first.speak("Short one.")
        first.close()
        rest = list(events)
        waiting.speak("Spoken after all.")
        waiting.close()
        after = list(waiting.events())
    assert [k for k, _ in rest if k != "audio"] == ["spoken", "done"] and rest[-2] == ("spoken", 1)
    assert [k for k, _ in after if k != "audio"] == ["admitted", "spoken", "done"] and after[-2] == ("spoken", 2)
    alone = run_alone(solo, Job("Spoken after all.", params=SamplingParams(seed=2, max_new_tokens=8)))
    assert torch.equal(after[-1][1].codes, alone.codes)


def test_an_idle_session_gives_its_slot_to_others_and_comes_back_for_its_next_sentence(tiny_checkpoint):
    """Parked between sentences, a session holds no slot: with one slot, a request submitted
    meanwhile runs to its end while the session stays open; the session's next sentence takes
    the slot again, ahead of what waits, and it ends with all its sentences' codes."""
    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=1, max_queue=2)
    with batcher:
        session = batcher.open_session(Job("", params=SamplingParams(seed=3, max_new_tokens=6), stream=True))
        events = session.events()
        session.speak("The first sentence.")
        assert [kind for kind, _ in _until(events, "spoken")][0] == "admitted"
        other = batcher.submit(Job("Meanwhile, another request.", params=SamplingParams(seed=4, max_new_tokens=6)))
        assert other.result().frames > 0  # the session's slot was free for it
        session.clear()  # parked: nothing to cut, and it says so
        assert next(events) == ("cleared", None)
        session.speak("The second sentence.")
        assert ("spoken", 1) in _until(events, "spoken")
        session.close()
        rest = list(events)
    done = rest[-1][1]
    assert rest[-1][0] == "done" and done.codes.shape[1] == done.frames > 0


def _until(events, kind: str) -> list:
    out = []
    for event in events:
        out.append(event)
        if event[0] == kind:
            return out
    raise AssertionError(f"no {kind!r} event")


def test_a_cancelled_session_frees_its_slot_at_once(tiny_checkpoint):
    batcher = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=1, max_queue=1)
    with batcher:
        first = batcher.open_session(Job("", params=SamplingParams(seed=0, max_new_tokens=500), stream=True))
        first.speak("A sentence long enough to be cut off while it is spoken.")
        events = first.events()
        assert next(events)[0] == "admitted"
        assert next(events)[0] == "audio"
        second = batcher.open_session(Job("Next, please.", params=SamplingParams(seed=1, max_new_tokens=8),
                                          stream=True))  # waits: one slot
        first.cancel()  # barge-in
        second.close()
        kinds = [kind for kind, _ in second.events()]
    assert kinds[0] == "admitted" and kinds[-1] == "done" and "spoken" in kinds
    with pytest.raises(InputError):
        first.speak("")


def test_graphs_left_to_capture_wait_for_an_idle_engine_or_a_load_that_needs_them(tiny_checkpoint):
    """A capture between two steps holds up every stream for its duration: the engine takes
    one when it is idle, when a decode's rows are served badly by the captured steps (several
    steps of the largest, or one more than twice their size) and the size that holds them is
    still to be captured, which then goes first, or for a prompt after a kept prefix just seen
    (its shape wanted now); not under a load the graphs it has already serve."""
    runner = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=32).runner
    runner.ready_sizes = [1, 2, 4]
    runner._to_capture = [entry for b in (8, 16, 32) for entry in (("decode", b, 256, True), ("decode", b, 512, False),
                                                                   ("first", b))] + [("admission", 8, 64)]
    assert runner.capture_due(idle=True) and not runner.capture_due(idle=False)
    runner._want(3)
    assert runner.wanted is None and not runner.capture_due(idle=False)
    runner._want(30)  # a burst: eight steps of four rows
    assert runner.wanted == 32 and runner.capture_due(idle=False)
    assert runner._to_capture[runner._next_capture()] == ("decode", 32, 256, True)
    runner._to_capture = [e for e in runner._to_capture if e[:2] not in (("decode", 32), ("first", 32))]
    runner.ready_sizes = [1, 2, 4, 32]
    runner._want(30)
    assert runner.wanted is None and not runner.capture_due(idle=False)
    runner._want(5)  # eight rows' size, served by 32
    assert runner.wanted == 8 and runner._to_capture[runner._next_capture()] == ("decode", 8, 256, True)
    runner._want(12)  # sixteen rows' size, served by 32: near enough
    assert runner.wanted is None
    runner._to_capture.insert(0, ("continued", 1, 64, 512))
    assert runner.capture_due(idle=False) and runner._next_capture() == 0
    runner._to_capture = []
    assert not runner.capture_due(idle=True)


def test_the_engine_s_captures_go_before_the_codec_s_capturing_thread(solo, monkeypatch):
    """While the engine's thread needs graphs for its load (`urge`), the codec's capturing
    thread starts no capture (it used to take the lock again as soon as it let go, and the
    engine, and every stream, waited through all of its shapes); the engine's own capture
    waits only for the one in progress, and the codec's resume once the urge ends."""
    lock = CaptureLock()
    assert lock.acquire()  # a codec capture in progress
    lock.urge(True)
    assert not lock.acquire(blocking=False, urgent=True)  # the engine's waits for it...
    lock.release()
    assert not lock.acquire(blocking=False)  # ...and the codec's next one for the engine's
    assert lock.acquire(blocking=False, urgent=True)
    lock.release()
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
    worker.codec.pending_captures = [(4, 4), (8, 4)]
    captured = []
    monkeypatch.setattr(worker.codec, "capture_next", lambda: captured.append(worker.codec.pending_captures.pop(0)))
    worker.capture_lock.urge(True)
    worker.start()
    assert worker.capture_lock.acquire(blocking=True, urgent=True)  # the engine's capture, between two steps
    worker.capture_lock.release()
    assert captured == []  # the codec's thread waits while the engine urges
    worker.capture_lock.urge(False)
    worker._capturer.join()
    assert captured == [(4, 4), (8, 4)]
    worker.stop()


def test_the_codec_s_capturing_thread_takes_the_shapes_left_one_at_a_time_under_the_lock(solo, monkeypatch, caplog):
    """What `capture` leaves (on a GPU) a thread of the worker's own captures once started, one
    shape at a time under the capture lock the engine's thread shares, waking the engine after
    each; a capture that fails is logged and the shapes left are dropped (their batches run
    without graphs), and the worker keeps decoding. The captures themselves are the GPU's
    (tests/engine/test_codec_stream.py); here the thread around them, on the CPU."""
    worker = CodecWorker(solo, first_piece=4, largest_piece=64, lanes=8)
    codec = worker.codec
    codec.pending_captures = [(4, 4), (8, 4), (4, 8), (16, 4)]
    captured, woken = [], []

    def capture_next():
        assert worker.capture_lock.locked()
        shape = codec.pending_captures.pop(0)
        if shape == (4, 8):
            raise RuntimeError("no memory for this graph")
        captured.append(shape)

    monkeypatch.setattr(codec, "capture_next", capture_next)
    worker.on_captured = lambda: woken.append(len(captured))
    worker.start()
    worker._capturer.join()
    assert captured == [(4, 4), (8, 4)] and not codec.capturing and woken == [1, 2, 2]
    assert "a graph capture failed; 1 shapes left run without graphs" in caplog.text
    ticket = Ticket(Job("x", stream=True))
    worker.open(worker.lanes.take(), ticket)  # the worker still decodes
    worker.frames(np.array([0]), np.zeros((1, solo.config.num_codebooks), np.int64))
    worker.finish(0, [np.zeros((solo.config.num_codebooks, 1), np.int64)])
    kinds = [kind for kind, _ in ticket.events()]  # (ends with its last event)
    worker.stop()
    assert kinds == ["audio", "done"]

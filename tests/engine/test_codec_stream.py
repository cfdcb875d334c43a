"""Piece-by-piece codec decoding: the schedule, lanes of state, and batches of pieces."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fish_sm.engine.codec_stream import ConvBack, PartlyRun, StreamingCodec, decode_in_pieces
from fish_sm.engine.pieces import PieceSchedule
from fish_sm.errors import FishSMError
from fish_sm.model.codec import CodecConfig, codec_from_state_dict
from fish_sm.model.random_weights import build_codec_state_dict


def push_batch(pieces: StreamingCodec, batch: list[tuple[int, int, torch.Tensor]]) -> list[torch.Tensor]:
    """One `push` of (lane, piece index, codes [1, rows, n]) each: their audio, in order."""
    frames = [c.shape[-1] for _, _, c in batch]
    codes = torch.cat([F.pad(c, (0, max(frames) - c.shape[-1])) for _, _, c in batch])
    return pieces.push([lane for lane, _, _ in batch], [p for _, p, _ in batch], codes, frames).tensors()


def _streamed_in_rounds(pieces: StreamingCodec, codes: list[torch.Tensor], starts) -> list[torch.Tensor]:
    """Each stream's audio, streamed as a server would: every round, one `push` of the next
    scheduled piece of each stream that has joined (stream i in lane i from round starts[i])."""
    out, at, index = [[] for _ in codes], [0] * len(codes), [0] * len(codes)
    rounds = 0
    while any(a < c.shape[-1] for a, c in zip(at, codes)):
        batch = []
        for i, c in enumerate(codes):
            if rounds >= starts[i] and at[i] < c.shape[-1]:
                m = min(pieces.next_frames(index[i]), c.shape[-1] - at[i])
                batch.append((i, index[i], c[..., at[i] : at[i] + m]))
                at[i] += m
                index[i] += 1
        for (i, _, _), audio in zip(batch, push_batch(pieces, batch)):
            out[i].append(audio)
        rounds += 1
    return [torch.cat(o, dim=-1) for o in out]


def test_schedule_doubles_up_to_the_largest_piece():
    pieces = PieceSchedule(4, 64)
    assert [pieces.frames(i) for i in range(7)] == [4, 8, 16, 32, 64, 64, 64]
    assert [pieces.start(i) for i in range(7)] == [0, 4, 12, 28, 60, 124, 188]
    assert [PieceSchedule(3, 8).start(i) for i in range(5)] == [0, 3, 9, 17, 25]  # a largest off the doubling
    assert [PieceSchedule(8, 8).frames(i) for i in range(3)] == [8, 8, 8]


def test_a_schedule_with_repeats_holds_each_length_for_that_many_pieces():
    pieces = PieceSchedule(4, 64, repeats=2)
    assert pieces.frames(np.arange(10)).tolist() == [4, 4, 8, 8, 16, 16, 32, 32, 64, 64]
    assert pieces.start(np.arange(10)).tolist() == [0, 4, 8, 16, 24, 40, 56, 88, 120, 184]
    assert pieces.lengths() == [4, 8, 16, 32, 64] and pieces.ramp_end == 120


@pytest.mark.parametrize("first, largest, repeats", [(4, 64, 1), (4, 64, 2), (3, 8, 3), (8, 8, 1), (4, 1, 1)])
def test_the_pieces_around_a_count_of_frames_are_the_schedule_s(first, largest, repeats):
    """What the scheduler reads (`around`: the frames of the finished pieces, the end of the next)
    agrees with where the codec's pieces start."""
    pieces = PieceSchedule(first, largest, repeats)
    starts = [pieces.start(i) for i in range(40)]
    assert all(b - a == pieces.frames(i) for i, (a, b) in enumerate(zip(starts, starts[1:])))
    frames = np.arange(starts[-1])
    done, end = pieces.around(frames)
    for n, d, e in zip(frames.tolist(), done.tolist(), end.tolist()):
        i = max(j for j, s in enumerate(starts) if s <= n)
        assert (d, e) == (starts[i], starts[i + 1]), n


def test_a_last_piece_runs_the_back_over_the_shortest_scheduled_length_that_holds_it(engine):
    codec = StreamingCodec(engine.codec, first=4, largest=64)
    assert [codec.back_frames(n) for n in (1, 4, 5, 12, 16, 17, 33, 63, 64)] == [4, 4, 8, 16, 16, 32, 64, 64, 64]
    assert StreamingCodec(engine.codec, first=4, largest=48).back_frames(40) == 48  # a largest off the doubling


@pytest.mark.parametrize("first, largest, repeats", [(2, 8, 1), (8, 8, 1), (3, 8, 1), (2, 8, 2)])  # (8, 8): full length from the first piece
def test_pieces_decode_like_the_whole_sequence(engine, first, largest, repeats):
    codes = torch.randint(0, 1024, (1, engine.codec.n_rows, 45), generator=torch.Generator().manual_seed(0))
    pieces = StreamingCodec(engine.codec, first=first, largest=largest, lanes=2, repeats=repeats)
    with torch.inference_mode():
        torch.testing.assert_close(decode_in_pieces(pieces, codes), engine.codec.decode(codes), atol=1e-4, rtol=0)


def test_the_back_over_channels_last_2d_tensors_decodes_like_the_whole_sequence(engine):
    """What the back runs on CUDA: [B, C, 1, T] channels-last tensors and 2-D convolutions
    of height 1 (prepared weights, transposed convs as interleaved ordinary convs)."""
    codes = torch.randint(0, 1024, (1, engine.codec.n_rows, 45), generator=torch.Generator().manual_seed(2))
    pieces = StreamingCodec(engine.codec, first=2, largest=8)
    pieces.back = ConvBack(engine.codec, compiled=False, channels_last=True)
    pieces.allocate(2)
    assert all(len(shape) == 3 for shape in pieces.back.shapes)  # contexts [C, 1, L] a row
    try:
        with torch.inference_mode():
            torch.testing.assert_close(decode_in_pieces(pieces, codes), engine.codec.decode(codes), atol=1e-4, rtol=0)
    finally:
        for m in engine.codec.decoder.modules():  # the session's engine: as it was
            m.__dict__.update({k: None for k in ("weight_2d", "phases_2d") if k in m.__dict__})


def test_lanes_keep_their_streams_apart_and_a_lane_starts_afresh_at_piece_zero(engine):
    """Two streams in two lanes, pieces interleaved, give each its own whole-sequence audio;
    a lane used again from piece 0 forgets the stream it held (its cache masked, its convs'
    contexts zero), as a session's next sentence does."""
    codec = engine.codec
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 30), generator=torch.Generator().manual_seed(1 + i)) for i in range(3)]
    pieces = StreamingCodec(codec, first=2, largest=8, lanes=3)
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes[:2], (0, 1))
        for i in range(2):
            torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)
        torch.testing.assert_close(decode_in_pieces(pieces, codes[2], lane=0), codec.decode(codes[2]), atol=1e-4, rtol=0)


def test_a_push_that_fails_leaves_every_lane_as_it_was(engine, monkeypatch):
    """A batch's states are written back once both its halves ran: after a back that raises
    in a push's only batch, the same pieces pushed again decode as if the failure never
    happened."""
    codec = engine.codec
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 14), generator=torch.Generator().manual_seed(5 + i)) for i in range(2)]
    pieces = StreamingCodec(codec, first=2, largest=8, lanes=2)
    run = pieces.back.run
    with torch.inference_mode():
        out = [push_batch(pieces, [(i, 0, c[..., :2]) for i, c in enumerate(codes)])]
        monkeypatch.setattr(pieces.back, "run", lambda *a: (_ for _ in ()).throw(RuntimeError("back broke")))
        with pytest.raises(RuntimeError, match="back broke"):
            push_batch(pieces, [(i, 1, c[..., 2:6]) for i, c in enumerate(codes)])  # the fronts ran, then this
        monkeypatch.setattr(pieces.back, "run", run)
        out.append(push_batch(pieces, [(i, 1, c[..., 2:6]) for i, c in enumerate(codes)]))
        out.append(push_batch(pieces, [(i, 2, c[..., 6:14]) for i, c in enumerate(codes)]))
    for i, c in enumerate(codes):
        torch.testing.assert_close(torch.cat([o[i] for o in out], dim=-1), codec.decode(c), atol=1e-4, rtol=0)


def test_a_push_that_fails_after_a_batch_ran_gives_that_batch_s_audio(engine, monkeypatch):
    """Pieces of two lengths, the longer's back raising: the push says the shorter ones ran
    (`PartlyRun`, with their audio, their lanes moved on); the longer one, pushed again alone,
    decodes as if the failure never happened."""
    codec = engine.codec
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 6), generator=torch.Generator().manual_seed(9 + i)) for i in range(2)]
    pieces = StreamingCodec(codec, first=2, largest=8, lanes=2)
    run = pieces.back.run
    with torch.inference_mode():
        first = push_batch(pieces, [(1, 0, codes[1][..., :2])])  # lane 1 a piece ahead: its next is 4 frames
        monkeypatch.setattr(pieces.back, "run", lambda z, c: (_ for _ in ()).throw(RuntimeError("back broke"))
                            if z.shape[-1] == 4 * pieces.back.steps else run(z, c))
        with pytest.raises(PartlyRun) as failed:
            push_batch(pieces, [(0, 0, codes[0][..., :2]), (1, 1, codes[1][..., 2:6])])
        assert isinstance(failed.value.__cause__, RuntimeError)
        ran = failed.value.pieces.host()
        assert ran[1] is None and ran[0] is not None  # lane 0's first piece ran; lane 1's did not
        monkeypatch.setattr(pieces.back, "run", run)
        again = push_batch(pieces, [(1, 1, codes[1][..., 2:6])])
        rest = push_batch(pieces, [(0, 1, codes[0][..., 2:6])])
    torch.testing.assert_close(torch.cat([torch.from_numpy(ran[0])[None], rest[0]], dim=-1), codec.decode(codes[0]),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([first[0], again[0]], dim=-1), codec.decode(codes[1]), atol=1e-4, rtol=0)


def test_a_push_checks_its_lanes_and_the_streams_length(engine):
    pieces = StreamingCodec(engine.codec, first=2, largest=8, lanes=2)
    codes = torch.zeros(1, engine.codec.n_rows, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="lanes must be in"):
        pieces.push([2], [0], codes, [2])  # lane 2 is the scratch lane
    with pytest.raises(FishSMError, match="longer than the codec streams"):
        pieces.push([0], [10**5], torch.zeros(1, engine.codec.n_rows, 8, dtype=torch.long), [8])
    with pytest.raises(ValueError, match="at most its scheduled frames"):
        pieces.push([0], [0], torch.zeros(1, engine.codec.n_rows, 4, dtype=torch.long), [4])  # a first piece is 2


def test_pieces_of_several_streams_decode_together_like_each_alone(engine):
    """`push`: streams at different points of the schedule share batches (fronts at
    the same piece index, backs of the same length, at most `max_batch_frames` frames), and
    each still gets its own whole-sequence audio."""
    codec = engine.codec
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 30), generator=torch.Generator().manual_seed(10 + i)) for i in range(5)]
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16, lanes=5)  # two full pieces a batch
    assert pieces.rows_for(8) == 2
    starts = [0, 0, 1, 3, 3]  # later streams join while earlier ones are on longer pieces
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes, starts)
        for i in range(len(codes)):
            torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)


def test_fronts_at_one_piece_index_and_backs_of_one_length_run_as_batches(engine, monkeypatch):
    """Fronts and backs of one piece length stack, up to `max_batch_frames` frames a batch,
    so short pieces go in larger batches. Each stream still gets its own audio."""
    codec = engine.codec
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16, lanes=4)
    assert [pieces.rows_for(n) for n in (2, 4, 8)] == [8, 4, 2]
    fronts, backs = [], []
    decode, step = codec.quantizer.decode, pieces.back._step
    monkeypatch.setattr(codec.quantizer, "decode", lambda codes, state=None: fronts.append(codes.shape[0]) or decode(codes, state))
    monkeypatch.setattr(pieces.back, "_step", lambda z, c: backs.append((z.shape[0], z.shape[-1])) or step(z, c))
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 22), generator=torch.Generator().manual_seed(20 + i)) for i in range(4)]
    out = [[] for _ in codes]
    with torch.inference_mode():
        for index, (at, n) in enumerate(((0, 2), (2, 4), (6, 8), (14, 8))):
            for i, audio in enumerate(push_batch(pieces, [(i, index, c[..., at : at + n]) for i, c in enumerate(codes)])):
                out[i].append(audio)
        assert fronts == [4, 4, 2, 2, 2, 2]
        assert [(b, t // pieces.back.steps) for b, t in backs] == [(4, 2), (4, 4), (2, 8), (2, 8), (2, 8), (2, 8)]
        for i in range(len(codes)):
            torch.testing.assert_close(torch.cat(out[i], dim=-1), codec.decode(codes[i]), atol=1e-4, rtol=0)


def test_last_pieces_shorter_than_scheduled_run_with_the_others(engine, monkeypatch):
    """Streams ending at different lengths inside one scheduled piece: both halves of each run
    over the shortest scheduled length that holds its frames (the codec is causal), batched
    with the others of that length; each keeps only its own samples, as if whole."""
    codec = engine.codec
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16, lanes=3)
    fronts, backs = [], []
    decode, step = codec.quantizer.decode, pieces.back._step
    monkeypatch.setattr(codec.quantizer, "decode", lambda codes, state=None: fronts.append(codes.shape) or decode(codes, state))
    monkeypatch.setattr(pieces.back, "_step", lambda z, c: backs.append((z.shape[0], z.shape[-1])) or step(z, c))
    lengths = (2 + 1, 2 + 3, 2 + 4)  # last pieces of 1, 3 and 4 frames where 4 are scheduled
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(40 + n)) for n in lengths]
    out = [[] for _ in codes]
    with torch.inference_mode():
        for index, (at, n) in enumerate(((0, 2), (2, 4))):
            for i, audio in enumerate(push_batch(pieces, [(i, index, c[..., at : at + n]) for i, c in enumerate(codes)])):
                out[i].append(audio)
    assert [(shape[0], shape[-1]) for shape in fronts] == [(3, 2), (1, 2), (2, 4)]
    assert [(b, t // pieces.back.steps) for b, t in backs] == [(3, 2), (1, 2), (2, 4)]  # 1 frame: 2; 3 and 4: 4
    assert (pieces.frames_run, pieces.frames_given) == (3 * 2 + 1 * 2 + 2 * 4, 3 * 2 + 1 + 3 + 4)  # (the padding counted)
    for i, n in enumerate(lengths):
        whole = torch.cat(out[i], dim=-1)
        assert whole.shape[-1] == n * codec.frame_length
        torch.testing.assert_close(whole, codec.decode(codes[i]), atol=1e-4, rtol=0)


def test_a_push_runs_its_shortest_pieces_first_and_sends_each_batch_home_as_it_ran(engine):
    """Whatever the rows' order, a push's batches run by length, the shortest (a stream's first
    pieces) first, front then back; `home` gives each back batch's audio in that order, the
    same samples as the device tensors."""
    codec = engine.codec
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16, lanes=3)
    codes = torch.randint(0, 1024, (3, codec.n_rows, 8), generator=torch.Generator().manual_seed(70))
    with torch.inference_mode():
        out = pieces.push([0, 1, 2], [2, 0, 1], codes, [8, 2, 4], home=True)  # pieces of 8, 2 and 4 frames
        parts = list(out.home())
        on_device = out.tensors()
    assert [rows.tolist() for rows, _ in parts] == [[1], [2], [0]]
    for rows, audio in parts:
        for row, samples in zip(rows, audio):
            np.testing.assert_array_equal(samples, on_device[row][0].numpy())
    assert [a.shape[-1] for a in out.host()] == [n * codec.frame_length for n in (8, 2, 4)]


def test_full_length_fronts_at_different_indices_share_a_batch_past_the_window(monkeypatch):
    """Streams at different piece indices stack their full-length fronts, each row at its own
    positions, its keys read from its lane's ring in order (masked before position 0) and the
    oldest dropped once past the window; each stream still gets its whole-sequence audio."""
    config = dataclasses.replace(CodecConfig.tiny(), quantizer_window=6)
    codec = codec_from_state_dict(build_codec_state_dict(config, seed=3)).eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, lanes=4)  # three full pieces a batch
    batches = []
    half = pieces._half
    monkeypatch.setattr(pieces, "_half", lambda graphs, run, n, b, lanes, starts, x: (
        graphs is pieces.fronts and batches.append((n, sorted(starts[:b].tolist())))) or half(graphs, run, n, b, lanes, starts, x))
    lengths, starts = (26, 19, 30, 23), (0, 1, 2, 4)
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(60 + n)) for n in lengths]
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes, starts)
        full = [b for n, b in batches if n == 4]
        assert any(len(set(b)) > 1 for b in full) and max(len(b) for b in full) == 3
        assert max(max(b) for b in full) > 12  # pieces well past the 6-frame window
        for i in range(len(codes)):
            torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)


def _snr_db(audio: torch.Tensor, reference: torch.Tensor) -> float:
    return 10 * torch.log10(reference.pow(2).sum() / (audio - reference).pow(2).sum()).item()


def test_the_back_in_float16_decodes_within_its_rounding_of_float32(engine):
    """The back as served on CUDA: a float16 copy of the decoder, float32 audio out; the
    codec's own decoder (whole decodes) stays float32."""
    codes = torch.randint(0, 1024, (1, engine.codec.n_rows, 45), generator=torch.Generator().manual_seed(3))
    pieces = StreamingCodec(engine.codec, first=2, largest=8, back_dtype=torch.float16, lanes=1)
    assert pieces.back.decoder is not engine.codec.decoder
    assert engine.codec.decoder.model[0].conv.weight.dtype == torch.float32
    with torch.inference_mode():
        audio, whole = decode_in_pieces(pieces, codes), engine.codec.decode(codes)
    assert audio.dtype == torch.float32 and audio.shape == whole.shape
    assert 40 < _snr_db(audio, whole) < 100  # float16's rounding: close, and not float32 itself
    assert StreamingCodec(engine.codec, first=2, largest=8).back.dtype == torch.float32  # the CPU's default


def test_the_codec_captures_every_batch_its_lanes_allow_powers_of_two_first():
    """Graphs for 1, 2, ..., 8, 10, 12, 14, 16, 20, ... pieces of each scheduled length, up to a
    batch or the lanes (a batch holds a lane once), in the order a server captures them once
    serving: the powers of two and the largest, small first, then the sizes between them."""
    codec = codec_from_state_dict(build_codec_state_dict(CodecConfig.tiny(), seed=4), device="cpu").eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, lanes=5)
    assert pieces.capture_shapes() == [(2, 1), (4, 1), (2, 2), (4, 2), (4, 3), (2, 4), (2, 5), (2, 3)]
    assert StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, lanes=1).capture_shapes() == [(2, 1), (4, 1)]
    wide = StreamingCodec(codec, first=2, largest=4, max_batch_frames=48, lanes=64).capture_shapes()
    assert wide[:11] == [(2, 1), (4, 1), (2, 2), (4, 2), (2, 4), (4, 4), (2, 8), (4, 8), (4, 12), (2, 16), (2, 24)]
    assert wide[-4:] == [(4, 10), (2, 12), (2, 14), (2, 20)]
    pieces.capture(2)  # on the CPU nothing is captured, nor left to capture
    assert not pieces.fronts and not pieces.capturing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("early", [None, 2])
def test_captured_fronts_and_back_decode_like_the_whole_sequence_on_cuda(monkeypatch, early):
    """The per-index and full-length front graphs and the compiled, captured back, streams
    joining at different rounds (float32 throughout, TF32 off: with it, pieces and whole
    decodes differ by up to ~3e-3 from the convolutions' shapes alone). `early`: only batches
    of up to 2 pieces captured first (as a server starts), the larger ones running the
    compiled back and the eager front; then the rest captured, one shape at a time."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config = dataclasses.replace(CodecConfig.tiny(), quantizer_window=6)
    codec = codec_from_state_dict(build_codec_state_dict(config, seed=4), device="cuda").eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, back_dtype=torch.float32,
                            front_dtype=torch.float32, front_tf32=False, lanes=5)
    every = [(2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (4, 1), (4, 2), (4, 3)]  # (at most 5 rows: 5 lanes)
    with torch.inference_mode():
        pieces.capture(early)
    if early:
        assert sorted(pieces.fronts) == [(2, 1), (2, 2), (4, 1), (4, 2)] and sorted(pieces.backs) == [(2, 2), (4, 2)]
        assert pieces.pending_captures == [(4, 3), (2, 4), (2, 5), (2, 3)]  # powers of two first
    lengths, starts = (26, 19, 30, 23, 9), (0, 1, 2, 4, 4)
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(70 + n)).cuda()
             for n in lengths]
    for _ in range(2 if early else 1):
        with torch.inference_mode():
            out = _streamed_in_rounds(pieces, codes, starts)
            for i in range(len(codes)):
                torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)
            while pieces.capturing:
                pieces.capture_next()
        # A single piece's back replays the two-row graph: never a one-row back, compiled apart.
        assert sorted(pieces.fronts) == every and sorted(pieces.backs) == [s for s in every if s[1] > 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_codec_as_served_stays_close_to_float32_on_cuda(monkeypatch):
    """The default on a GPU (both halves in float16, graphs captured on a stream of their own)
    against a whole float32 decode without TF32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config = dataclasses.replace(CodecConfig.tiny(), quantizer_window=6)
    codec = codec_from_state_dict(build_codec_state_dict(config, seed=4), device="cuda").eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, lanes=3)
    assert pieces.back.dtype == pieces.front.dtype == torch.float16
    with torch.inference_mode():
        pieces.capture()
    # Not the stream graphs are captured on by default, as the decode step's are: cuBLAS's workspace goes by stream.
    default = torch.cuda.graph(torch.cuda.CUDAGraph()).capture_stream
    assert pieces.captures.stream.cuda_stream != default.cuda_stream
    assert not torch.backends.cuda.matmul.allow_tf32  # on only while the fronts were captured
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(80 + n)).cuda()
             for n in (26, 19, 30)]
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes, (0, 1, 2))
        for i in range(len(codes)):
            assert _snr_db(out[i], codec.decode(codes[i])) > 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_push_never_waits_for_the_gpu_on_cuda():
    """A push only queues work: a pageable copy or a `.item()` in it would wait inside the
    driver for the codec's queued kernels, and the decode loop's launches on the other thread
    would wait with it. Pushes of two piece lengths run under torch's sync debug mode set to raise."""
    codec = codec_from_state_dict(build_codec_state_dict(CodecConfig.tiny(), seed=4), device="cuda").eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, lanes=4)
    codes = torch.randint(0, 1024, (3, codec.n_rows, 4), device="cuda")
    with torch.inference_mode():
        pieces.capture()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pieces.push([0, 1, 2], [0, 0, 0], codes[..., :2], [2, 2, 1])
            audio = pieces.push([0, 1, 2], [1, 1, 1], codes, [4, 3, 4], home=True).tensors()  # (copies home as served)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [a.shape[-1] for a in audio] == [n * codec.frame_length for n in (4, 3, 4)]

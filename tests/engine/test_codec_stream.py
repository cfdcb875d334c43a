"""Piece-by-piece codec decoding: the schedule, and the state plumbing the CUDA graphs use."""

import dataclasses

import pytest
import torch

from fish_sm.engine.codec_stream import CodecStream, ConvBack, FullFronts, StreamingCodec, _flatten, _rebuild, decode_in_pieces, piece_frames
from fish_sm.model.codec import CodecConfig, codec_from_state_dict
from fish_sm.model.random_weights import build_codec_state_dict


def _streamed_in_rounds(pieces: StreamingCodec, codes: list[torch.Tensor], starts) -> list[torch.Tensor]:
    """Each stream's audio, streamed as a server would: every round, one `push_many` of the
    next scheduled piece of each stream that has joined (stream i from round starts[i])."""
    streams, out, at = [CodecStream() for _ in codes], [[] for _ in codes], [0] * len(codes)
    rounds = 0
    while any(a < c.shape[-1] for a, c in zip(at, codes)):
        batch = []
        for i, c in enumerate(codes):
            if rounds >= starts[i] and at[i] < c.shape[-1]:
                m = min(pieces.next_frames(streams[i]), c.shape[-1] - at[i])
                batch.append((i, c[..., at[i] : at[i] + m]))
                at[i] += m
        for (i, _), audio in zip(batch, pieces.push_many([(streams[i], c) for i, c in batch])):
            out[i].append(audio)
        rounds += 1
    return [torch.cat(o, dim=-1) for o in out]


def test_schedule_doubles_up_to_the_largest_piece():
    assert [piece_frames(i, 4, 64) for i in range(7)] == [4, 8, 16, 32, 64, 64, 64]


def test_a_last_piece_runs_the_back_over_the_shortest_scheduled_length_that_holds_it(engine):
    codec = StreamingCodec(engine.codec, first=4, largest=64)
    assert [codec.back_frames(n) for n in (1, 4, 5, 12, 16, 17, 33, 63, 64)] == [4, 4, 8, 16, 16, 32, 64, 64, 64]
    assert StreamingCodec(engine.codec, first=4, largest=48).back_frames(40) == 48  # a largest off the doubling


@pytest.mark.parametrize("first, largest", [(2, 8), (8, 8), (3, 8)])  # (8, 8): full length from the first piece
def test_pieces_decode_like_the_whole_sequence(engine, first, largest):
    codes = torch.randint(0, 1024, (1, engine.codec.n_rows, 45), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(decode_in_pieces(StreamingCodec(engine.codec, first=first, largest=largest), codes),
                                   engine.codec.decode(codes), atol=1e-4, rtol=0)


def test_the_back_over_channels_last_2d_tensors_decodes_like_the_whole_sequence(engine):
    """What the back runs on CUDA: [B, C, 1, T] channels-last tensors and 2-D convolutions
    of height 1 (prepared weights, transposed convs as interleaved ordinary convs)."""
    codes = torch.randint(0, 1024, (1, engine.codec.n_rows, 45), generator=torch.Generator().manual_seed(2))
    pieces = StreamingCodec(engine.codec, first=2, largest=8)
    pieces.back = ConvBack(engine.codec, compiled=False, channels_last=True)
    assert all(len(shape) == 3 for shape in pieces.back.shapes)  # contexts [C, 1, L] a row
    try:
        with torch.inference_mode():
            torch.testing.assert_close(decode_in_pieces(pieces, codes), engine.codec.decode(codes), atol=1e-4, rtol=0)
    finally:
        for m in engine.codec.decoder.modules():  # the session's engine: as it was
            m.__dict__.update({k: None for k in ("weight_2d", "phases_2d") if k in m.__dict__})


def test_state_copied_through_flat_tensors_decodes_the_same(engine):
    """What a graph replay does with a stream's state: out through flat tensors (copies) and back."""
    codec = engine.codec
    codes = torch.randint(0, 1024, (1, codec.n_rows, 30), generator=torch.Generator().manual_seed(1))
    pieces = StreamingCodec(codec, first=2, largest=8)
    stream, out = CodecStream(), []
    with torch.inference_mode():
        for at, n in ((0, 2), (2, 4), (6, 8), (14, 8), (22, 8)):
            out.append(pieces.push(stream, codes[..., at : at + n]))
            layout, tensors = _flatten(stream.state)
            stream.state = _rebuild(layout, torch._foreach_mul(tensors, 1))
        assert stream.pieces == 5
        torch.testing.assert_close(torch.cat(out, dim=-1), codec.decode(codes), atol=1e-4, rtol=0)


def test_pieces_of_several_streams_decode_together_like_each_alone(engine):
    """`push_many`: streams at different points of the schedule share batches (fronts at
    the same piece index, backs of the same length, at most `max_batch_frames` frames), and
    each still gets its own whole-sequence audio."""
    codec = engine.codec
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 30), generator=torch.Generator().manual_seed(10 + i)) for i in range(5)]
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16)  # two pieces a batch
    assert pieces.max_rows == 2
    starts = [0, 0, 1, 3, 3]  # later streams join while earlier ones are on longer pieces
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes, starts)
        for i in range(len(codes)):
            torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)


def test_fronts_at_one_piece_index_and_backs_of_one_length_run_as_batches(engine, monkeypatch):
    """Pieces at one index stack their fronts (the state they carry has the same shapes for
    every stream), full-length ones up to `max_batch_frames` frames; backs stack up to
    `max_batch_frames` frames, so short pieces go in larger batches. Each stream still gets
    its own audio."""
    codec = engine.codec
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16)
    assert [pieces.front_rows(i) for i in range(4)] == [8, 4, 1, 1]
    assert [pieces.rows_for(n) for n in (2, 4, 8)] == [8, 4, 2]
    fronts, backs = [], []
    decode, step = codec.quantizer.decode, pieces.back._step
    monkeypatch.setattr(codec.quantizer, "decode", lambda codes, state=None: fronts.append(codes.shape[0]) or decode(codes, state))
    monkeypatch.setattr(pieces.back, "_step", lambda z, c: backs.append((z.shape[0], z.shape[-1])) or step(z, c))
    codes = [torch.randint(0, 1024, (1, codec.n_rows, 22), generator=torch.Generator().manual_seed(20 + i)) for i in range(4)]
    streams, out = [CodecStream() for _ in codes], [[] for _ in codes]
    with torch.inference_mode():
        for at, n in ((0, 2), (2, 4), (6, 8), (14, 8)):
            for i, audio in enumerate(pieces.push_many([(s, c[..., at : at + n]) for s, c in zip(streams, codes)])):
                out[i].append(audio)
        assert fronts == [4, 4, 2, 2, 2, 2]
        assert [(b, t // pieces.back.steps) for b, t in backs] == [(4, 2), (4, 4), (2, 8), (2, 8), (2, 8), (2, 8)]
        for i in range(len(codes)):
            torch.testing.assert_close(torch.cat(out[i], dim=-1), codec.decode(codes[i]), atol=1e-4, rtol=0)


def test_last_pieces_shorter_than_scheduled_run_with_the_others(engine, monkeypatch):
    """Streams ending at different lengths inside one scheduled piece: their fronts are padded
    to it and run as one batch, each back runs over the shortest scheduled length that holds
    its frames (the decoder is causal); each keeps only its own samples, as if whole."""
    codec = engine.codec
    pieces = StreamingCodec(codec, first=2, largest=8, max_batch_frames=16)
    fronts, backs = [], []
    decode, step = codec.quantizer.decode, pieces.back._step
    monkeypatch.setattr(codec.quantizer, "decode", lambda codes, state=None: fronts.append(codes.shape) or decode(codes, state))
    monkeypatch.setattr(pieces.back, "_step", lambda z, c: backs.append((z.shape[0], z.shape[-1])) or step(z, c))
    lengths = (2 + 1, 2 + 3, 2 + 4)  # last pieces of 1, 3 and 4 frames where 4 are scheduled
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(40 + n)) for n in lengths]
    streams, out = [CodecStream() for _ in codes], [[] for _ in codes]
    with torch.inference_mode():
        for at, n in ((0, 2), (2, 4)):
            for i, audio in enumerate(pieces.push_many([(s, c[..., at : at + n]) for s, c in zip(streams, codes)])):
                out[i].append(audio)
    assert [shape[0] for shape in fronts] == [3, 3] and fronts[-1][-1] == 4
    assert [(b, t // pieces.back.steps) for b, t in backs] == [(3, 2), (1, 2), (2, 4)]  # 1 frame: 2; 3 and 4: 4
    for i, n in enumerate(lengths):
        whole = torch.cat(out[i], dim=-1)
        assert whole.shape[-1] == n * codec.frame_length
        torch.testing.assert_close(whole, codec.decode(codes[i]), atol=1e-4, rtol=0)


def test_full_length_fronts_at_different_indices_share_a_batch_past_the_window(monkeypatch):
    """`FullFronts`: streams at different piece indices stack their full-length fronts, each
    row at its own positions, with KV caches padded to the window while not yet full and
    dropping the oldest keys once past it; each stream still gets its whole-sequence audio."""
    config = dataclasses.replace(CodecConfig.tiny(), quantizer_window=6)
    codec = codec_from_state_dict(build_codec_state_dict(config, seed=3)).eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12)  # three full pieces a batch
    batches = []
    call = FullFronts.__call__
    monkeypatch.setattr(FullFronts, "__call__", lambda self, streams, codes: batches.append(
        sorted(s.pieces for s in streams)) or call(self, streams, codes))
    lengths, starts = (26, 19, 30, 23), (0, 1, 2, 4)
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(60 + n)) for n in lengths]
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes, starts)
        assert any(len(set(b)) > 1 for b in batches) and max(len(b) for b in batches) == 3
        assert max(max(b) for b in batches) > 3  # pieces well past the 6-frame window
        for i in range(len(codes)):
            torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)


def _snr_db(audio: torch.Tensor, reference: torch.Tensor) -> float:
    return 10 * torch.log10(reference.pow(2).sum() / (audio - reference).pow(2).sum()).item()


def test_the_back_in_float16_decodes_within_its_rounding_of_float32(engine):
    """The back as served on CUDA: a float16 copy of the decoder, float32 audio out; the
    codec's own decoder (whole decodes) stays float32."""
    codes = torch.randint(0, 1024, (1, engine.codec.n_rows, 45), generator=torch.Generator().manual_seed(3))
    pieces = StreamingCodec(engine.codec, first=2, largest=8, back_dtype=torch.float16)
    assert pieces.back.decoder is not engine.codec.decoder
    assert engine.codec.decoder.model[0].conv.weight.dtype == torch.float32
    with torch.inference_mode():
        audio, whole = decode_in_pieces(pieces, codes), engine.codec.decode(codes)
    assert audio.dtype == torch.float32 and audio.shape == whole.shape
    assert 40 < _snr_db(audio, whole) < 100  # float16's rounding: close, and not float32 itself
    assert StreamingCodec(engine.codec, first=2, largest=8).back.dtype == torch.float32  # the CPU's default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_fronts_and_back_decode_like_the_whole_sequence_on_cuda(monkeypatch):
    """The per-index and full-length front graphs and the compiled, captured back, streams
    joining at different rounds (float32 throughout, TF32 off: with it, pieces and whole
    decodes differ by up to ~3e-3 from the convolutions' shapes alone)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config = dataclasses.replace(CodecConfig.tiny(), quantizer_window=6)
    codec = codec_from_state_dict(build_codec_state_dict(config, seed=4), device="cuda").eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12, back_dtype=torch.float32, front_tf32=False)
    with torch.inference_mode():
        pieces.capture(6)
    assert sorted(pieces.full.graphs) == [1, 2, 3]
    lengths, starts = (26, 19, 30, 23, 9), (0, 1, 2, 4, 4)
    codes = [torch.randint(0, 1024, (1, codec.n_rows, n), generator=torch.Generator().manual_seed(70 + n)).cuda()
             for n in lengths]
    with torch.inference_mode():
        out = _streamed_in_rounds(pieces, codes, starts)
        for i in range(len(codes)):
            torch.testing.assert_close(out[i], codec.decode(codes[i]), atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_codec_as_served_stays_close_to_float32_on_cuda(monkeypatch):
    """The default on a GPU (the back in float16, TF32 matmuls in the fronts, graphs captured on
    a stream of their own) against a whole float32 decode without TF32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config = dataclasses.replace(CodecConfig.tiny(), quantizer_window=6)
    codec = codec_from_state_dict(build_codec_state_dict(config, seed=4), device="cuda").eval()
    pieces = StreamingCodec(codec, first=2, largest=4, max_batch_frames=12)
    assert pieces.back.dtype == torch.float16 and pieces.captures.tf32
    with torch.inference_mode():
        pieces.capture(6)
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

"""Piece-by-piece codec decoding: the schedule, and the state plumbing the CUDA graphs use."""

import torch

from fish_sm.engine.codec_stream import CodecStream, StreamingCodec, _flatten, _rebuild, piece_frames


def test_schedule_doubles_up_to_the_largest_piece():
    assert [piece_frames(i, 4, 64) for i in range(7)] == [4, 8, 16, 32, 64, 64, 64]


def test_state_copied_through_flat_tensors_decodes_like_the_codec(engine):
    codec = engine.codec
    codes = torch.randint(0, 1024, (1, codec.n_rows, 45), generator=torch.Generator().manual_seed(0))
    pieces = StreamingCodec(codec, first=2, largest=8)
    stream, out, at = CodecStream(), [], 0
    with torch.inference_mode():
        while at < codes.shape[-1]:
            n = min(pieces.next_frames(stream), codes.shape[-1] - at)
            out.append(pieces.push(stream, codes[..., at : at + n]))
            at += n
            # What a graph replay does with the state: out through flat tensors (copies), back into a state.
            layout, tensors = _flatten(stream.state)
            stream.state = _rebuild(layout, torch._foreach_mul(tensors, 1))
        whole = codec.decode(codes)
    assert stream.pieces == 7  # 2 + 4 + 8 + 8 + 8 + 8 + 7
    torch.testing.assert_close(torch.cat(out, dim=-1), whole, atol=1e-4, rtol=0)

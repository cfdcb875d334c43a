"""Streaming codec decode in pieces on a fixed schedule, replayed from CUDA graphs.

A streamed request's audio is decoded in pieces of `first` frames, then doubling up to
`largest` (4, 8, 16, 32, 64, 64, ...): each piece plays for longer than the next one takes
to make, and the codec runs a few large pieces rather than many small ones. Because the
schedule is fixed, the decoder's carried state before piece k has the same shapes (and
the same positions) for every request, so piece k can be one CUDA graph for everyone:
copy the request's state in, replay, copy the new state out (two fused copies), instead
of launching the codec's ~1,000 kernels one by one from Python. A last, shorter piece (the
end of an utterance) runs eagerly on the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from fish_sm.model.codec import Codec, KVCache, State


def piece_frames(index: int, first: int, largest: int) -> int:
    """Frames in piece `index` of a stream."""
    return min(first << min(index, 30), largest)


@dataclass
class CodecStream:
    """One request's place in the schedule and its decoder state."""

    state: State = field(default_factory=dict)
    pieces: int = 0


def _flatten(state: State) -> tuple[list, list[Tensor]]:
    """The state's layout and its tensors in a fixed order (the layout rebuilds it)."""
    layout, tensors = [], []
    for module, value in state.items():
        if isinstance(value, Tensor):
            layout.append((module, None))
            tensors.append(value)
        else:  # a transformer: (next position, per-layer KV caches)
            start, caches = value
            layout.append((module, (start, [c.keep for c in caches])))
            for c in caches:
                tensors += [c.k, c.v]
    return layout, tensors


def _rebuild(layout: list, tensors: list[Tensor]) -> State:
    state, it = {}, iter(tensors)
    for module, spec in layout:
        if spec is None:
            state[module] = next(it)
            continue
        start, keeps = spec
        caches = []
        for keep in keeps:
            cache = KVCache(keep)
            cache.k, cache.v = next(it), next(it)
            caches.append(cache)
        state[module] = (start, caches)
    return state


class PieceGraph:
    """Piece k of the schedule as one CUDA graph: static codes and state in, audio and state out."""

    def __init__(self, codec: Codec, template: State, frames: int, pool):
        device = codec._param.device
        self.layout, inputs = _flatten(template)
        self.inputs = [t.clone() for t in inputs]
        self.codes = torch.zeros(1, codec.n_rows, frames, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph: cuDNN plans, workspaces
            codec._decode(self.codes, _rebuild(self.layout, [t.clone() for t in self.inputs]))
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        state = _rebuild(self.layout, self.inputs)
        # thread_local: the decode loop keeps launching on its own thread while this captures.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.audio = codec._decode(self.codes, state)
        self.out_layout, self.outputs = _flatten(state)

    def __call__(self, stream: CodecStream, codes: Tensor) -> Tensor:
        _, tensors = _flatten(stream.state)
        if tensors:
            torch._foreach_copy_(self.inputs, tensors)
        self.codes.copy_(codes)
        self.graph.replay()
        stream.state = _rebuild(self.out_layout, torch._foreach_mul(self.outputs, 1))  # copies the graph may overwrite
        return self.audio.clone()


class StreamingCodec:
    """Decodes streams piece by piece; on CUDA the scheduled pieces replay captured graphs
    (captured the first time a piece index is reached, at most `max_graphs` of them)."""

    def __init__(self, codec: Codec, first: int = 4, largest: int = 64, max_graphs: int = 48):
        self.codec, self.first, self.largest, self.max_graphs = codec, first, largest, max_graphs
        self.graphs: dict[int, PieceGraph] = {}
        self.use_graphs = codec._param.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def next_frames(self, stream: CodecStream) -> int:
        return piece_frames(stream.pieces, self.first, self.largest)

    @torch.inference_mode()
    def push(self, stream: CodecStream, codes: Tensor) -> Tensor:
        """codes [1, rows, n] (n = next_frames, or fewer for the last piece) -> audio [1, n * frame_length]."""
        n, index = codes.shape[-1], stream.pieces
        stream.pieces += 1
        if not self.use_graphs or n != piece_frames(index, self.first, self.largest) or index >= self.max_graphs:
            return self.codec._decode(codes, stream.state)
        graph = self.graphs.get(index)
        if graph is None:
            graph = self.graphs[index] = PieceGraph(self.codec, stream.state, n, self._pool)
        return graph(stream, codes)

    def capture(self, pieces: int) -> None:
        """Capture the first `pieces` graphs now (start-up) by decoding a silent stream."""
        if not self.use_graphs:
            return
        stream = CodecStream()
        for _ in range(min(pieces, self.max_graphs)):
            n = self.next_frames(stream)
            self.push(stream, torch.zeros(1, self.codec.n_rows, n, dtype=torch.long, device=self.codec._param.device))


def decode_in_pieces(codec: StreamingCodec, codes: Tensor) -> Tensor:
    """codes [1, rows, n] decoded piece by piece as a stream would be (graphs where captured)."""
    stream, out, at = CodecStream(), [], 0
    while at < codes.shape[-1]:
        n = min(codec.next_frames(stream), codes.shape[-1] - at)
        out.append(codec.push(stream, codes[..., at : at + n]))
        at += n
    return torch.cat(out, dim=-1)

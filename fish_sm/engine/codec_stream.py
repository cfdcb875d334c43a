"""Streaming codec decode in pieces on a fixed schedule, many requests' pieces at once.

A streamed request's audio is decoded in pieces of `first` frames, then doubling up to
`largest` (4, 8, 16, 32, 64, 64, ...): each piece plays for longer than the next one takes
to make, and the codec runs a few large pieces rather than many small ones.

A piece goes through the codec in two halves:
- The front (codebook sums, the windowed transformer, the 2x2 upsampling) knows where in
  the utterance it is (RoPE positions, a KV window), so it runs one request at a time. The
  schedule is fixed, so its carried state before piece k has the same shapes and positions
  for every request: piece k is one CUDA graph for everyone (copy the request's state in,
  replay, copy the new state out) instead of a few hundred kernel launches.
- The back (the conv decoder up to 44.1 kHz, ~90% of the codec's work) is the same at
  every position: its only state is each conv's last inputs. Pieces of the same length
  from different requests are stacked into one batch, which the GPU runs 2-4x faster per
  frame than one at a time, and on CUDA it is compiled (inductor fuses the Snake
  activations and residual adds that eager mode runs as ~600 separate kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from fish_sm.engine.generate import batch_sizes
from fish_sm.model.codec import Codec, KVCache, State


def piece_frames(index: int, first: int, largest: int) -> int:
    """Frames in piece `index` of a stream."""
    return min(first << min(index, 30), largest)


@dataclass
class CodecStream:
    """One request's place in the schedule and its decoder state: the front's carried
    context (`state`) and the back's (`back`: each stateful conv's, in `ConvBack` order)."""

    state: State = field(default_factory=dict)
    back: Optional[list[Tensor]] = None
    pieces: int = 0

    def snapshot(self) -> "CodecStream":
        """A copy to go back to if a decode fails. It shares the tensors: decoding replaces
        them (and the dict and caches holding them), never writes into them."""
        layout, tensors = _flatten(self.state)
        return CodecStream(_rebuild(layout, tensors), self.back, self.pieces)


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
    """Piece k's front as one CUDA graph: static codes and state in, latents and state out."""

    def __init__(self, codec: Codec, template: State, frames: int, pool):
        device = codec._param.device
        self.layout, inputs = _flatten(template)
        self.inputs = [t.clone() for t in inputs]
        self.codes = torch.zeros(1, codec.n_rows, frames, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph: cuDNN plans, workspaces
            codec.quantizer.decode(self.codes, _rebuild(self.layout, [t.clone() for t in self.inputs]))
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        state = _rebuild(self.layout, self.inputs)
        # thread_local: the decode loop keeps launching on its own thread while this captures.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.latents = codec.quantizer.decode(self.codes, state)
        self.out_layout, self.outputs = _flatten(state)

    def __call__(self, stream: CodecStream, codes: Tensor) -> Tensor:
        _, tensors = _flatten(stream.state)
        if tensors:
            torch._foreach_copy_(self.inputs, tensors)
        self.codes.copy_(codes)
        self.graph.replay()
        stream.state = _rebuild(self.out_layout, torch._foreach_mul(self.outputs, 1))  # copies the graph may overwrite
        return self.latents.clone()


class ConvBack(nn.Module):
    """The conv decoder as a pure function of (latents, carried context): what lets pieces
    of different requests share one batch, and lets inductor compile it once for any batch
    and piece length. A zero context is exactly the zero padding of a stream's start.

    On CUDA, (rows, length) pairs captured by `capture` replay as graphs (a batch runs in
    the smallest captured row count that holds it; the spare rows' results are dropped):
    the compiled code's own launches would hold the GIL the decode loop needs."""

    def __init__(self, codec: Codec, compiled: bool):
        super().__init__()
        self.decoder = codec.decoder
        self.latent_dim = codec.config.latent_dim
        self.steps = codec.frame_length // codec.config.hop_length  # latent steps per code frame
        template: dict = {}
        with torch.inference_mode():
            self.decoder(codec._param.new_zeros(1, self.latent_dim, 1), template)
        self.stateful = [m for m in self.decoder.modules() if m in template]
        self.shapes = [tuple(template[m].shape[1:]) for m in self.stateful]
        self.compiled = torch.compile(self._step) if compiled else None
        self.warmed = False  # after start-up, a shape the compiled code has not seen runs eagerly
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, length) -> graph, inputs, outputs

    def initial(self, rows: int = 1) -> list[Tensor]:
        """The context before a stream's first piece, for `rows` streams."""
        p = self.decoder.model[0].conv.weight
        return [p.new_zeros(rows, *shape) for shape in self.shapes]

    def silence(self, rows: int, frames: int) -> Tensor:
        """Latents of `rows` pieces of `frames` code frames, all zero (start-up work)."""
        return self.decoder.model[0].conv.weight.new_zeros(rows, self.latent_dim, frames * self.steps)

    def _step(self, latents: Tensor, contexts: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        state = dict(zip(self.stateful, contexts))
        audio = self.decoder(latents, state)[:, 0]
        return audio, [state[m] for m in self.stateful]

    def capture(self, rows: int, frames: int, pool) -> None:
        """A graph for `rows` pieces of `frames` code frames (after the compiled code has run them)."""
        latents, contexts = self.silence(rows, frames), self.initial(rows)
        self._run(latents, contexts)  # compiled for this shape, and warmed up, outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            audio, new = self._run(latents, contexts)
        self.graphs[(rows, latents.shape[-1])] = (graph, latents, contexts, audio, new)

    def forward(self, latents: Tensor, contexts: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """latents [B, latent_dim, T], contexts [B, ...] each -> audio [B, samples], new contexts."""
        b, length = latents.shape[0], latents.shape[-1]
        fits = [rows for rows, n in self.graphs if n == length and rows >= b]
        if fits:
            graph, static_latents, static_contexts, audio, new = self.graphs[(min(fits), length)]
            torch._foreach_copy_([static_latents[:b]] + [c[:b] for c in static_contexts], [latents, *contexts])
            graph.replay()
            return audio[:b].clone(), [c[:b].clone() for c in new]
        return self._run(latents, contexts)

    def _run(self, latents: Tensor, contexts: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        if self.compiled is None:
            return self._step(latents, contexts)
        for t in (latents, *contexts):  # one compiled graph for every batch size,
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(latents, 2)  # and every piece length (a few range guards)
        if not self.warmed:
            return self.compiled(latents, contexts)
        with torch.compiler.set_stance("eager_on_recompile"):  # never a compile while serving
            return self.compiled(latents, contexts)


class StreamingCodec:
    """Decodes streams piece by piece. On CUDA the fronts of scheduled pieces replay captured
    graphs (captured the first time a piece index is reached, at most `max_graphs` of them)
    and the back is compiled and captured; `push_many` stacks same-length pieces into
    batches of at most `max_batch_frames // largest` pieces (bounded so that a request's
    first piece never waits long behind one batch)."""

    def __init__(self, codec: Codec, first: int = 4, largest: int = 64, max_graphs: int = 48,
                 max_batch_frames: int = 512):
        self.codec, self.first, self.largest, self.max_graphs = codec, first, largest, max_graphs
        self.max_rows = max(1, max_batch_frames // largest)  # pieces in one batch
        self.graphs: dict[int, PieceGraph] = {}
        self.use_graphs = codec._param.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.back = ConvBack(codec, compiled=self.use_graphs)

    def next_frames(self, stream: CodecStream) -> int:
        return piece_frames(stream.pieces, self.first, self.largest)

    def push(self, stream: CodecStream, codes: Tensor) -> Tensor:
        """codes [1, rows, n] (n = next_frames, or fewer for the last piece) -> audio [1, n * frame_length]."""
        return self.push_many([(stream, codes)])[0]

    @torch.inference_mode()
    def push_many(self, pieces: list[tuple[CodecStream, Tensor]]) -> list[Tensor]:
        """One piece each of different streams -> their audio, in order."""
        latents = [self._front(stream, codes) for stream, codes in pieces]
        audio: list[Optional[Tensor]] = [None] * len(pieces)
        by_length: dict[int, list[int]] = {}
        for i, z in enumerate(latents):
            by_length.setdefault(z.shape[-1], []).append(i)
        for group in by_length.values():
            for at in range(0, len(group), self.max_rows):
                batch = group[at : at + self.max_rows]
                streams = [pieces[i][0] for i in batch]
                contexts = [s.back if s.back is not None else self.back.initial() for s in streams]
                out, new = self.back(torch.cat([latents[i] for i in batch]), [torch.cat(c) for c in zip(*contexts)])
                for row, (i, s) in enumerate(zip(batch, streams)):
                    audio[i] = out[row : row + 1]
                    s.back = [c[row : row + 1] for c in new]
        return audio

    def _front(self, stream: CodecStream, codes: Tensor) -> Tensor:
        n, index = codes.shape[-1], stream.pieces
        stream.pieces += 1
        if not self.use_graphs or n != piece_frames(index, self.first, self.largest) or index >= self.max_graphs:
            return self.codec.quantizer.decode(codes.to(self.codec._param.device).long(), stream.state)
        graph = self.graphs.get(index)
        if graph is None:
            graph = self.graphs[index] = PieceGraph(self.codec, stream.state, n, self._pool)
        return graph(stream, codes)

    @torch.inference_mode()
    def working_bytes(self) -> int:
        """GPU memory the largest batch takes while it runs (measured eagerly, which keeps
        more intermediates alive than the compiled code): what its graphs' pool will hold."""
        device = self.codec._param.device
        if device.type != "cuda":
            return 0
        latents, contexts = self.back.silence(self.max_rows, self.largest), self.back.initial(self.max_rows)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.back._step(latents, contexts)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    def capture(self, pieces: int) -> None:
        """Start-up work: capture the first `pieces` front graphs by decoding silent streams
        (which compiles the back for one row and for several), then the back's graphs for
        every scheduled piece length at 1, 2, 4, ... rows."""
        if not self.use_graphs:
            return
        device = self.codec._param.device
        together, alone = [CodecStream() for _ in range(self.max_rows)], CodecStream()
        lengths = [piece_frames(index, self.first, self.largest) for index in range(min(pieces, self.max_graphs))]
        for n in lengths:
            codes = torch.zeros(1, self.codec.n_rows, n, dtype=torch.long, device=device)
            self.push_many([(stream, codes) for stream in together])
            self.push(alone, codes)
        for n in sorted(set(lengths)):
            for rows in batch_sizes(self.max_rows):
                self.back.capture(rows, n, self._pool)
        self.back.warmed = True


def decode_in_pieces(codec: StreamingCodec, codes: Tensor) -> Tensor:
    """codes [1, rows, n] decoded piece by piece as a stream would be (graphs where captured)."""
    stream, out, at = CodecStream(), [], 0
    while at < codes.shape[-1]:
        n = min(codec.next_frames(stream), codes.shape[-1] - at)
        out.append(codec.push(stream, codes[..., at : at + n]))
        at += n
    return torch.cat(out, dim=-1)

"""Streaming codec decode in pieces on a fixed schedule, many requests' pieces at once.

A streamed request's audio is decoded in pieces of `first` frames, then doubling up to
`largest` (4, 8, 16, 32, 64, 64, ...): each piece plays for longer than the next one takes
to make, and the codec runs a few large pieces rather than many small ones.

A piece goes through the codec in two halves:
- The front (codebook sums, the windowed transformer, the 2x2 upsampling) knows where in
  the utterance it is (RoPE positions, a KV window). The schedule is fixed, so its carried
  state before piece k has the same shapes and positions for every request: the fronts of
  several requests' piece k stack into one batch, and on CUDA piece k is a CUDA graph per
  batch size (copy the requests' states in, replay, copy the new states out) instead of a
  few hundred kernel launches per request. Full-length pieces (after a stream's first)
  stack whatever their index (`FullFronts`: positions are a graph input, caches padded to
  the window), so one graph per batch size serves all of them.
- The back (the conv decoder up to 44.1 kHz, ~90% of the codec's work) is the same at
  every position: its only state is each conv's last inputs. Pieces of the same length
  from different requests are stacked into one batch of at most `max_batch_frames`
  frames, which the GPU runs 2-4x faster per frame than one at a time, and on CUDA it is
  compiled (inductor fuses the Snake activations and residual adds that eager mode runs
  as ~600 separate kernels).
A stream's last piece, when shorter than its scheduled length, has its front padded to it
(the front's graph for that index) and its back run over the shortest scheduled length that
holds it (a captured graph too), not the whole scheduled length: the decoder is causal, so
the samples kept are those it would give alone.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fish_sm.engine.generate import batch_sizes
from fish_sm.model.codec import Codec
from fish_sm.model.codec.layers import CausalConv1d, CausalConvTranspose1d, KVCache, State


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


def _stack(streams: list[CodecStream]) -> State:
    """The states of streams at the same piece index as one state of that many rows."""
    layout, _ = _flatten(streams[0].state)
    return _rebuild(layout, [torch.cat(rows) for rows in zip(*(_flatten(s.state)[1] for s in streams))])


def _unstack(state: State, streams: list[CodecStream]) -> None:
    """Each stream's row of a stacked state back into the stream (views of the stacked tensors)."""
    layout, tensors = _flatten(state)
    for i, stream in enumerate(streams):
        stream.state = _rebuild(layout, [t[i : i + 1] for t in tensors])


class Captures:
    """Where the codec's CUDA graphs are captured: a memory pool and a stream of their own.

    The stream matters. PyTorch gives cuBLAS a workspace per (handle, stream), and a graph
    keeps the workspace of the stream it was captured on. Captured on `torch.cuda.graph`'s
    default stream, from the thread that captured the decode step's graphs there too, the
    codec's products shared the decode graphs' workspace, and the two replay side by side on
    two streams: with TF32 matmuls in the fronts' graphs, the GPU stalled for seconds at a time.

    `tf32`: the fronts' float32 matmuls on TF32 tensor cores, as cuDNN already runs the
    codec's float32 convolutions. The flag is process-wide, so it is on only while a front is
    captured; its graph keeps the TF32 kernels."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None, tf32: bool = True):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self.tf32 = tf32

    def graph(self, graph: torch.cuda.CUDAGraph):
        # thread_local: the decode loop keeps launching on its own thread while this captures.
        return torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local")

    def matmuls(self):
        """The fronts' matmul precision, for this block only."""
        return backend_flag(torch.backends.cuda.matmul, "allow_tf32", self.tf32)


@contextmanager
def backend_flag(backend, name: str, value):
    """A process-wide `torch.backends` flag set to `value` for this block only."""
    before = getattr(backend, name)
    setattr(backend, name, value)
    try:
        yield
    finally:
        setattr(backend, name, before)


def _captured_decode(codec: Codec, codes: Tensor, state: State, warm_up: State, captures: Captures) -> tuple:
    """`codec.decode_front(codes, state)` captured as a CUDA graph, after one run outside
    it on `warm_up`, a copy of the state (cuDNN plans, workspaces): (graph, its latents);
    `state` then holds the graph's output state."""
    device = codes.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with captures.matmuls():
        with torch.cuda.stream(side):
            codec.decode_front(codes, warm_up)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with captures.graph(graph):
            latents = codec.decode_front(codes, state)
    return graph, latents


class PieceGraph:
    """Piece k's front for up to `rows` streams as one CUDA graph: static codes and state
    in, latents and state out (spare rows run on stale inputs; their results are dropped)."""

    def __init__(self, codec: Codec, template: State, frames: int, rows: int, captures: Captures):
        device = codec.device
        self.layout, inputs = _flatten(template)
        self.inputs = [t.expand(rows, *t.shape[1:]).clone() for t in inputs]
        self.codes = torch.zeros(rows, codec.n_rows, frames, dtype=torch.long, device=device)
        state = _rebuild(self.layout, self.inputs)
        self.graph, self.latents = _captured_decode(codec, self.codes, state,
                                                    _rebuild(self.layout, [t.clone() for t in self.inputs]), captures)
        self.out_layout, self.outputs = _flatten(state)

    def __call__(self, streams: list[CodecStream], codes: Tensor) -> Tensor:
        """codes [b, rows, frames] of b <= `rows` streams -> their latents [b, ...]; their states move on."""
        b = len(streams)
        if self.inputs:
            for i, stream in enumerate(streams):
                torch._foreach_copy_([t[i : i + 1] for t in self.inputs], _flatten(stream.state)[1])
        self.codes[:b].copy_(codes)
        self.graph.replay()
        # Copies: the next replay overwrites the graph's outputs.
        _unstack(_rebuild(self.out_layout, torch._foreach_mul([t[:b] for t in self.outputs], 1)), streams)
        return self.latents[:b].clone()


def _split(state: State) -> tuple[list, list[Tensor]]:
    """A state's transformer positions and its tensors, each KV cache padded on the left to
    the window it keeps (what `Transformer._rows` takes: the padding is masked out)."""
    starts, tensors = [], []
    for value in state.values():
        if isinstance(value, Tensor):
            tensors.append(value)
            continue
        start, caches = value
        starts.append(start)
        for c in caches:
            pad = c.keep - len(c)
            tensors += [F.pad(c.k, (0, 0, pad, 0)), F.pad(c.v, (0, 0, pad, 0))] if pad else [c.k, c.v]
    return starts, tensors


def _assemble(like: State, starts: list, tensors: list[Tensor]) -> State:
    """A state laid out like `like` from positions and tensors in `_split`'s order."""
    state, positions, it = {}, iter(starts), iter(tensors)
    for module, value in like.items():
        if isinstance(value, Tensor):
            state[module] = next(it)
            continue
        caches = []
        for c in value[1]:
            cache = KVCache(c.keep)
            cache.k, cache.v = next(it), next(it)
            caches.append(cache)
        state[module] = (next(positions), caches)
    return state


class FullFronts:
    """The fronts of full-length pieces at any piece index, up to `rows` streams at once.

    After a stream's first piece, a full-length piece's front does the same work wherever
    it falls in the utterance but for its positions, and its transformer's KV caches never
    outgrow the window. So each row's positions are an input (`Transformer._rows`) and a
    cache not yet full is padded on the left (masked): streams at different indices share
    a batch, and on CUDA one graph per batch size serves every index, where fronts run one
    stream at a time would take much of the codec's GPU time."""

    POSITIONS = 1 << 15  # frames the RoPE tables are sized for (~25 minutes); later pieces run alone

    def __init__(self, codec: Codec, frames: int, rows: int, captures: Optional[Captures]):
        self.codec, self.frames, self.rows, self.captures = codec, frames, rows, captures
        self.use_graphs = captures is not None
        self.usable = codec.front_state_bounded()
        if self.usable:
            codec.front_rope(self.POSITIONS)  # sized once, before any graph reads it
        self.graphs: dict[int, RowsGraph] = {}

    def takes(self, stream: CodecStream, frames: int) -> bool:
        if not self.usable or frames != self.frames or stream.pieces == 0:
            return False
        return all(v[0] + frames <= self.POSITIONS for v in stream.state.values() if not isinstance(v, Tensor))

    def __call__(self, streams: list[CodecStream], codes: Tensor) -> Tensor:
        """codes [b, rows, frames] of b <= `rows` streams -> their latents; their states move on."""
        rows = [_split(s.state) for s in streams]
        if self.use_graphs:
            latents, outputs = self.graph(len(streams), streams[0].state)(rows, codes)
        else:
            device = codes.device
            starts = [torch.tensor(col, device=device) for col in zip(*(r[0] for r in rows))]
            state = _assemble(streams[0].state, starts, [torch.cat(col) for col in zip(*(r[1] for r in rows))])
            latents = self.codec.decode_front(codes, state)
            outputs = _split(state)[1]
        for i, stream in enumerate(streams):
            stream.state = self._moved_on(stream.state, [t[i : i + 1] for t in outputs])
        return latents

    def _moved_on(self, state: State, row: list[Tensor]) -> State:
        """The state after this piece from its row of the outputs: positions advance, and each
        cache keeps what it really holds (no more than the window, none of the padding)."""
        new, it = {}, iter(row)
        for module, value in state.items():
            if isinstance(value, Tensor):
                new[module] = next(it)
                continue
            start, caches = value
            fresh = []
            for c in caches:
                n = min(c.keep, len(c) + self.frames)
                cache = KVCache(c.keep)
                cache.k, cache.v = next(it)[:, :, -n:], next(it)[:, :, -n:]
                fresh.append(cache)
            new[module] = (start + self.frames, fresh)
        return new

    def graph(self, batch: int, like: State) -> "RowsGraph":
        """The graph for `batch` streams: the smallest captured size that holds them."""
        rows = min(r for r in batch_sizes(self.rows) if r >= batch)
        if rows not in self.graphs:
            self.graphs[rows] = RowsGraph(self.codec, like, self.frames, rows, self.captures)
        return self.graphs[rows]


class RowsGraph:
    """`FullFronts` for up to `rows` streams as one CUDA graph: positions, padded caches and
    codes in; latents and states out (spare rows run on stale inputs; their results are dropped)."""

    def __init__(self, codec: Codec, like: State, frames: int, rows: int, captures: Captures):
        device = codec.device
        template = {}
        for module, value in like.items():
            if isinstance(value, Tensor):
                template[module] = value.new_zeros(rows, *value.shape[1:])
                continue
            caches = []
            for c in value[1]:
                cache = KVCache(c.keep)
                cache.k, cache.v = (t.new_zeros(rows, t.shape[1], c.keep, t.shape[3]) for t in (c.k, c.v))
                caches.append(cache)
            template[module] = (torch.zeros(rows, dtype=torch.long, device=device), caches)
        self.like = template
        self.starts, self.inputs = _split(template)
        self.codes = torch.zeros(rows, codec.n_rows, frames, dtype=torch.long, device=device)
        state = _assemble(template, self.starts, self.inputs)
        warm_up = _assemble(template, [t.clone() for t in self.starts], [t.clone() for t in self.inputs])
        self.graph, self.latents = _captured_decode(codec, self.codes, state, warm_up, captures)
        self.outputs = _split(state)[1]
        # The RoPE table it reads, kept alive should the transformer regrow its own.
        self.table = codec.front_rope(FullFronts.POSITIONS)

    def __call__(self, rows: list[tuple[list, list[Tensor]]], codes: Tensor) -> tuple[Tensor, list[Tensor]]:
        b = len(rows)
        torch._foreach_copy_([t[i : i + 1] for i in range(b) for t in self.inputs], [t for r in rows for t in r[1]])
        for j, start in enumerate(self.starts):  # pinned, asynchronous: no wait on the GPU (see to_device)
            start[:b].copy_(torch.tensor([r[0][j] for r in rows], pin_memory=True), non_blocking=True)
        self.codes[:b].copy_(codes)
        self.graph.replay()
        # Copies: the next replay overwrites the graph's outputs.
        return self.latents[:b].clone(), torch._foreach_mul([t[:b] for t in self.outputs], 1)


def cudnn_benchmark():
    """cuDNN's benchmark mode, for this block only."""
    return backend_flag(torch.backends.cudnn, "benchmark", True)


class ConvBack(nn.Module):
    """The conv decoder as a pure function of (latents, carried context): what lets pieces
    of different requests share one batch, and lets inductor compile it once for any batch
    and piece length. A zero context is exactly the zero padding of a stream's start.

    On CUDA, (rows, length) pairs captured by `capture` replay as graphs (a batch runs in
    the smallest captured row count that holds it; the spare rows' results are dropped):
    the compiled code's own launches would hold the GIL the decode loop needs. On CUDA it
    also runs over channels-last [B, C, 1, T] tensors (`conv_2d`), which cuDNN reads as they are."""

    def __init__(self, codec: Codec, compiled: bool, channels_last: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype or codec.dtype
        # Another dtype: a copy of the decoder in it (the codec's own decodes whole utterances).
        self.decoder = codec.decoder if self.dtype == codec.dtype else copy.deepcopy(codec.decoder).to(self.dtype)
        self.audio_dtype = codec.dtype
        self.latent_dim = codec.config.latent_dim
        self.steps = codec.frame_length // codec.config.hop_length  # latent steps per code frame
        self.channels_last = channels_last  # [B, C, 1, T] in channels-last memory (`conv_2d`)
        if channels_last:
            for m in self.decoder.modules():
                if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
                    m.prepare_2d()
        template: dict = {}
        with torch.inference_mode():
            silence = torch.zeros(1, self.latent_dim, 1, dtype=self.dtype, device=codec.device)
            self.decoder(self._layout(silence), template)
        self.stateful = [m for m in self.decoder.modules() if m in template]
        self.shapes = [tuple(template[m].shape[1:]) for m in self.stateful]
        self.dtypes = [template[m].dtype for m in self.stateful]  # not all one under autocast
        self.compiled = torch.compile(self._step) if compiled else None
        self.warmed = False  # after start-up, a shape the compiled code has not seen runs eagerly
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, length) -> graph, inputs, outputs

    def initial(self, rows: int = 1) -> list[Tensor]:
        """The context before a stream's first piece, for `rows` streams."""
        p = self.decoder.model[0].conv.weight
        zeros = [p.new_zeros(rows, *shape, dtype=dtype) for shape, dtype in zip(self.shapes, self.dtypes)]
        return [z.contiguous(memory_format=torch.channels_last) for z in zeros] if self.channels_last else zeros

    def silence(self, rows: int, frames: int) -> Tensor:
        """Latents of `rows` pieces of `frames` code frames, all zero (start-up work)."""
        return self.decoder.model[0].conv.weight.new_zeros(rows, self.latent_dim, frames * self.steps)

    def _layout(self, latents: Tensor) -> Tensor:
        return latents[:, :, None].contiguous(memory_format=torch.channels_last) if self.channels_last else latents

    def _step(self, latents: Tensor, contexts: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        state = dict(zip(self.stateful, contexts))
        audio = self.decoder(self._layout(latents.to(self.dtype)), state).flatten(1)
        return audio.to(self.audio_dtype), [state[m] for m in self.stateful]

    def capture(self, rows: int, frames: int, captures: Captures) -> None:
        """A graph for `rows` pieces of `frames` code frames (after the compiled code has run them).

        cuDNN picks each conv's kernel by timing its candidates (benchmark mode) in the run
        before the capture, which the capture then finds in its cache: its heuristics' picks
        for these channels-last shapes were slower, worth the longer start-up."""
        latents, contexts = self.silence(rows, frames), self.initial(rows)
        with cudnn_benchmark():
            self._run(latents, contexts)  # compiled for this shape, and warmed up, outside the graph
            graph = torch.cuda.CUDAGraph()
            with captures.graph(graph):
                audio, new = self._run(latents, contexts)
        self.graphs[(rows, latents.shape[-1])] = (graph, latents, contexts, audio, new)

    def forward(self, latents: Tensor, contexts: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """latents [B, latent_dim, T], contexts [B, ...] each -> audio [B, samples], new contexts."""
        b, length = latents.shape[0], latents.shape[-1]
        fits = [rows for rows, n in self.graphs if n == length and rows >= b]
        if fits:
            graph, static_latents, static_contexts, audio, new = self.graphs[(min(fits), length)]
            torch._foreach_copy_([static_latents[:b]] + [c[:b] for c in static_contexts],
                                 [latents.to(self.dtype), *contexts])
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
    """Decodes streams piece by piece. `push_many` stacks the fronts of pieces at the same
    index, those of full-length pieces at any index, and the backs of same-length pieces, at
    most `max_batch_frames` frames a batch (bounded so that a request's first piece never
    waits long behind one batch). On CUDA the fronts replay captured graphs (captured the
    first time a piece index, or full length, and batch size are reached; for at most
    `max_graphs` piece indices) and the back is compiled and captured."""

    def __init__(self, codec: Codec, first: int = 4, largest: int = 64, max_graphs: int = 48,
                 max_batch_frames: int = 512, back_dtype: torch.dtype | None = None, front_tf32: bool = True):
        self.codec, self.first, self.largest, self.max_graphs = codec, first, largest, max_graphs
        self.max_batch_frames = max_batch_frames
        self.max_rows = self.rows_for(largest)  # full-length pieces in one batch
        self.graphs: dict[tuple[int, int], PieceGraph] = {}  # (piece index, rows) -> its front
        self.use_graphs = codec.device.type == "cuda"
        # Its own stream and pool (`Captures`); TF32 fronts: faster, at ~51 dB SNR against float32.
        self.front_tf32 = front_tf32  # (on CUDA: the CPU captures no graphs)
        self.captures = Captures(codec.device, tf32=front_tf32) if self.use_graphs else None
        # The back in float16 on CUDA (`back_dtype` None, a float32 codec): its inputs rounded to
        # 10-bit mantissas, as cuDNN's TF32 convolutions round them, on tensor cores twice as fast.
        if back_dtype is None:
            fp32 = codec.dtype == torch.float32
            back_dtype = torch.float16 if self.use_graphs and fp32 else codec.dtype
        self.back = ConvBack(codec, compiled=self.use_graphs, channels_last=self.use_graphs, dtype=back_dtype)
        self.full = FullFronts(codec, largest, self.max_rows, self.captures)

    def rows_for(self, frames: int) -> int:
        """Pieces of `frames` frames that go through the back in one batch."""
        return max(1, self.max_batch_frames // frames)

    def front_rows(self, index: int) -> int:
        """Pieces at `index` whose fronts run as one batch."""
        frames = piece_frames(index, self.first, self.largest)
        return self.rows_for(frames) if frames < self.largest else 1

    def next_frames(self, stream: CodecStream) -> int:
        return piece_frames(stream.pieces, self.first, self.largest)

    def back_frames(self, frames: int) -> int:
        """The shortest scheduled piece length that holds `frames` frames (a last piece's back)."""
        n = self.first
        while n < frames and n < self.largest:
            n = min(2 * n, self.largest)
        return n

    def push(self, stream: CodecStream, codes: Tensor) -> Tensor:
        """codes [1, rows, n] (n = next_frames, or fewer for the last piece) -> audio [1, n * frame_length]."""
        return self.push_many([(stream, codes)])[0]

    @torch.inference_mode()
    def push_many(self, pieces: list[tuple[CodecStream, Tensor]]) -> list[Tensor]:
        """One piece each of different streams -> their audio, in order. A stream's last piece
        may be shorter than scheduled: its front is padded to the scheduled length and runs with
        the others, its back runs over `back_frames` of it (the decoder is causal, so the samples
        kept are those it would give alone), and its audio is cut back: last pieces of streams
        that end together run as one batch, not one after another ahead of new requests'."""
        frames = [codes.shape[-1] for _, codes in pieces]
        scheduled = [self.next_frames(stream) for stream, _ in pieces]
        pieces = [(stream, F.pad(codes, (0, s - n))) for (stream, codes), n, s in zip(pieces, frames, scheduled)]
        latents = self._fronts(pieces)
        steps = self.back.steps
        latents = [z if n == s else z[..., : steps * self.back_frames(n)] for z, n, s in zip(latents, frames, scheduled)]
        audio: list[Optional[Tensor]] = [None] * len(pieces)
        by_length: dict[int, list[int]] = {}
        for i, z in enumerate(latents):
            by_length.setdefault(z.shape[-1], []).append(i)
        for length, group in by_length.items():
            most = self.rows_for(length // steps)
            for at in range(0, len(group), most):
                batch = group[at : at + most]
                streams = [pieces[i][0] for i in batch]
                contexts = [s.back if s.back is not None else self.back.initial() for s in streams]
                out, new = self.back(torch.cat([latents[i] for i in batch]), [torch.cat(c) for c in zip(*contexts)])
                for row, (i, s) in enumerate(zip(batch, streams)):
                    audio[i] = out[row : row + 1, : frames[i] * self.codec.frame_length]
                    s.back = [c[row : row + 1] for c in new]
        return audio

    def _fronts(self, pieces: list[tuple[CodecStream, Tensor]]) -> list[Tensor]:
        """The fronts' latents, in order: pieces (of the scheduled length) at the same index
        stack, and full-length ones at any index (`FullFronts`)."""
        device = self.codec.device
        latents: list[Optional[Tensor]] = [None] * len(pieces)
        groups: dict[Optional[int], list[int]] = {}  # piece index -> pieces; None: full-length ones
        for i, (stream, codes) in enumerate(pieces):
            groups.setdefault(None if self.full.takes(stream, codes.shape[-1]) else stream.pieces, []).append(i)
        for index, members in groups.items():
            most = self.max_rows if index is None else self.front_rows(index)
            for at in range(0, len(members), most):
                batch = members[at : at + most]
                streams = [pieces[i][0] for i in batch]
                z = self._front(index, streams, torch.cat([pieces[i][1] for i in batch]).to(device).long())
                for row, (i, stream) in enumerate(zip(batch, streams)):
                    latents[i] = z[row : row + 1]
                    stream.pieces += 1
        return latents

    def _front(self, index: Optional[int], streams: list[CodecStream], codes: Tensor) -> Tensor:
        """One batch of fronts: full-length (`index` None), a captured graph's, or eager."""
        if index is None:
            return self.full(streams, codes)
        if self.use_graphs and index < self.max_graphs:
            return self._graph(index, len(streams), streams[0].state)(streams, codes)
        state = _stack(streams)
        z = self.codec.decode_front(codes, state)
        _unstack(state, streams)
        return z

    def _graph(self, index: int, batch: int, template: State) -> PieceGraph:
        """The graph for `batch` fronts at `index`: the smallest captured size that holds them."""
        rows = min(r for r in batch_sizes(self.front_rows(index)) if r >= batch)
        graph = self.graphs.get((index, rows))
        if graph is None:
            frames = piece_frames(index, self.first, self.largest)
            graph = self.graphs[(index, rows)] = PieceGraph(self.codec, template, frames, rows, self.captures)
        return graph

    @torch.inference_mode()
    def working_bytes(self) -> int:
        """GPU memory the back's largest batches take while they run (what the KV cache must
        leave room for), measured as they will run: compiled, which compiles it now."""
        device = self.codec.device
        if device.type != "cuda":
            return 0
        most = 0
        for frames in (self.largest, self.first):  # few rows of long pieces, many of short ones
            rows = self.rows_for(frames)
            latents, contexts = self.back.silence(rows, frames), self.back.initial(rows)
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.back._run(latents, contexts)
            torch.cuda.synchronize(device)
            most = max(most, torch.cuda.max_memory_allocated(device) - before)
        return most

    def capture(self, pieces: int) -> None:
        """Start-up work: the front graphs of the first `pieces` piece indices at every batch
        size (a silent stream walks the schedule to give each its state; full-length pieces
        share `FullFronts`' graphs), then the back's graphs for every scheduled piece length
        at 1, 2, 4, ... rows (which compiles it)."""
        if not self.use_graphs:
            return
        device, alone = self.codec.device, CodecStream()
        lengths = [piece_frames(index, self.first, self.largest) for index in range(min(pieces, self.max_graphs))]
        for index, n in enumerate(lengths):
            if self.full.takes(alone, n):
                for rows in batch_sizes(self.max_rows):
                    self.full.graph(rows, alone.state)
            else:
                for rows in batch_sizes(self.front_rows(index)):
                    self._graph(index, rows, alone.state)
            self.push(alone, torch.zeros(1, self.codec.n_rows, n, dtype=torch.long, device=device))
        for n in sorted(set(lengths)):
            for rows in batch_sizes(self.rows_for(n)):
                self.back.capture(rows, n, self.captures)
        self.back.warmed = True


def decode_in_pieces(codec: StreamingCodec, codes: Tensor) -> Tensor:
    """codes [1, rows, n] decoded piece by piece as a stream would be (graphs where captured)."""
    stream, out, at = CodecStream(), [], 0
    while at < codes.shape[-1]:
        n = min(codec.next_frames(stream), codes.shape[-1] - at)
        out.append(codec.push(stream, codes[..., at : at + n]))
        at += n
    return torch.cat(out, dim=-1)

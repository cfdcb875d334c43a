"""Streaming codec decode in pieces on a fixed schedule, many streams' pieces at once, each
stream's decoder state a row (its lane) of tensors kept on the device for good.

A streamed request's audio is decoded in pieces on a `PieceSchedule` (4, 8, 16, 32, 64, 64, ...
frames): each piece plays for longer than the next one takes to make, and the codec runs a few
large pieces rather than many small ones.

A piece goes through the codec in two halves, each a function of (lanes, positions, inputs)
that gathers its lanes' state, runs, and returns the new state:
- The front (codebook sums, the window-limited transformer, the 2x2 upsampling) runs each
  row at its own position (`Transformer._rows`). Its transformer keeps the last `window - 1`
  keys and values of every lane in a ring (`FrontState`), read back in order, so a batch of
  fronts of one piece length serves streams at any point of their utterances, a stream's
  first piece included (its keys before position 0 are masked).
- The back (the conv decoder up to 44.1 kHz, ~90% of the codec's work) carries each conv's
  last inputs (`ContextPool`). Pieces of the same length are stacked into one batch of at
  most `max_batch_frames` frames, which the GPU runs 2-4x faster per frame than one at a
  time; on CUDA it is compiled (inductor fuses the Snake activations and residual adds that
  eager mode runs as ~600 separate kernels).
On CUDA each batch size and length of either half is a CUDA graph, gathers and new states'
writes (`commit`) included: a batch of pieces costs a few copies and replays, never work per
stream or per state tensor on the host. A batch run without graphs writes its lanes' new states
once both halves have run. So a push that fails has moved on only the lanes of the batches that
ran before the failure, and says which (`PartlyRun`, with their audio): the others are as they
were, to be retried.

A stream's last piece, when shorter than its scheduled length, runs through both halves over
the shortest scheduled length that holds it, not the whole scheduled length: the codec is
causal, so the samples kept are those it would give alone, and the state it leaves is never read.
"""

from __future__ import annotations

import contextlib
import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fish_sm.engine.generate import HostCopy, WaitClock, batch_sizes, to_device
from fish_sm.engine.pieces import PieceSchedule
from fish_sm.errors import FishSMError
from fish_sm.kernels.compile import rows_dynamic
from fish_sm.model.codec import Codec
from fish_sm.model.codec.layers import CausalConv1d, CausalConvTranspose1d, KVCache, State

CODEC_SIZES_PER_OCTAVE = 4  # batch sizes captured per doubling (`capture_shapes`)
POSITIONS = 1 << 15  # code frames a stream may last (~25 minutes): the front's RoPE table, sized once


class Captures:
    """Where the codec's CUDA graphs are captured: a memory pool and a stream of their own.

    The stream matters. PyTorch gives cuBLAS a workspace per (handle, stream), and a graph
    keeps the workspace of the stream it was captured on. Captured on `torch.cuda.graph`'s
    default stream, from the thread that captured the decode step's graphs there too, the
    codec's products shared the decode graphs' workspace, and the two replay side by side on
    two streams: with TF32 matmuls in the fronts' graphs, the GPU stalled for seconds at a time.

    `tf32`: for float32 fronts, their matmuls on TF32 tensor cores or not, as cuDNN already
    runs the codec's float32 convolutions; None for fronts in 16 bits, which leave the flag
    alone. The flag is process-wide, so it is set only while a front is captured, where it
    differs (`flips_flag`); its graph keeps the TF32 kernels."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None, tf32: bool | None = True):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self.tf32 = tf32

    def graph(self, graph: torch.cuda.CUDAGraph):
        # thread_local: the decode loop keeps launching on its own thread while this captures.
        return torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local")

    @property
    def flips_flag(self) -> bool:
        """Capturing a front sets the process-wide flag to another value than it has now."""
        return self.tf32 is not None and self.tf32 != torch.backends.cuda.matmul.allow_tf32

    def matmuls(self):
        """The fronts' matmul precision, for this block only."""
        if not self.flips_flag:
            return contextlib.nullcontext()
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


def cudnn_benchmark():
    """cuDNN's benchmark mode, for this block only."""
    return backend_flag(torch.backends.cudnn, "benchmark", True)


class Replay:
    """`fn(*inputs)` captured as one CUDA graph over static inputs, after one run outside it
    (compiling, cuDNN plans, workspaces). A call copies its values into the first rows of
    the inputs and replays; the outputs are the graph's own, valid until its next replay."""

    def __init__(self, fn: Callable, inputs: list[Tensor], captures: Captures, flags=None):
        self.inputs = inputs
        with (flags or contextlib.nullcontext)():
            device = inputs[0].device
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn(*inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with captures.graph(self.graph):
                self.outputs = fn(*inputs)

    def __call__(self, *values: Tensor):
        torch._foreach_copy_([x[: v.shape[0]] for x, v in zip(self.inputs, values)], list(values))
        self.graph.replay()
        return self.outputs


class ContextPool:
    """Each stateful conv's carried inputs for every lane: a tensor a conv, a row a lane (and
    a scratch row last, that padding rows read and write). A stream's first piece reads zeros,
    exactly the zero padding of its start."""

    def __init__(self, shapes: list[tuple], dtypes: list[torch.dtype], device: torch.device, channels_last: bool = False):
        self.shapes, self.dtypes, self.device, self.channels_last = shapes, dtypes, device, channels_last
        self.tensors: list[Tensor] = []

    def row_bytes(self) -> int:
        return sum(int(np.prod(s)) * torch.finfo(d).bits // 8 for s, d in zip(self.shapes, self.dtypes))

    def allocate(self, rows: int) -> None:
        self.tensors = [torch.zeros(rows, *s, dtype=d, device=self.device) for s, d in zip(self.shapes, self.dtypes)]
        if self.channels_last:
            self.tensors = [t.contiguous(memory_format=torch.channels_last) for t in self.tensors]

    def gather(self, lanes: Tensor, fresh: Tensor) -> list[Tensor]:
        out = []
        for t in self.tensors:
            rows = torch.where(fresh.view(-1, *[1] * (t.dim() - 1)), 0, t[lanes])
            out.append(rows.contiguous(memory_format=torch.channels_last) if self.channels_last else rows)
        return out

    def commit(self, lanes: Tensor, values: list[Tensor]) -> None:
        for t, v in zip(self.tensors, values):
            t.index_copy_(0, lanes, v)


def front_in(codec: Codec, dtype: torch.dtype) -> nn.Module:
    """The codec's front (`Codec.decode_front`: its quantizer's decode) in `dtype`: the codec's
    own quantizer, or a copy of what its decode runs (not the encoder's half) in that dtype."""
    quantizer = codec.quantizer
    if dtype == codec.dtype:
        return quantizer
    decode_only = copy.copy(quantizer)
    decode_only._modules = dict(quantizer._modules, pre_module=None, downsample=nn.ModuleList())
    return copy.deepcopy(decode_only).to(dtype)


class FrontState:
    """The front's state for every lane: its transformer's last `keep` keys and values per
    layer in a ring (position p in slot p % keep), and its stateful convs' carried inputs.
    `quantizer`: the codec's (`Codec.quantizer`), or a copy of it in another dtype
    (`front_in`); it runs every front."""

    def __init__(self, quantizer: nn.Module, n_rows: int):
        self.quantizer = quantizer
        post = quantizer.post_module
        if post is not None and post.window is None:
            raise FishSMError("the codec's transformer attends over whole utterances: it cannot be streamed in lanes")
        self.post = post
        self.keep = 0 if post is None else post.window - 1
        weight = self.like = next(quantizer.parameters())  # (dtype and device of its state)
        self.dtype = weight.dtype
        # The layout: one piece through the front with a rows state, from which each conv's context shape is read.
        state: dict = {}
        if post is not None:
            attention = post.layers[0].attention
            self.heads, self.head_dim = attention.n_head, attention.head_dim
            state[post] = (torch.zeros(1, dtype=torch.long, device=weight.device), self._caches(1))
        with torch.inference_mode():
            quantizer.decode(torch.zeros(1, n_rows, 1, dtype=torch.long, device=weight.device), state)
        self.convs = [m for m in state if m is not post]
        self.contexts = ContextPool([tuple(state[m].shape[1:]) for m in self.convs], [state[m].dtype for m in self.convs],
                                    weight.device)
        self.layers = 0 if post is None else len(post.layers)
        self.rings: list[tuple[Tensor, Tensor]] = []  # per layer: keys, values [lanes * keep, heads, head_dim]

    def _caches(self, rows: int) -> list[KVCache]:
        caches = []
        for _ in range(len(self.post.layers)):
            cache = KVCache(self.keep)
            cache.k, cache.v = (self.like.new_zeros(rows, self.heads, self.keep, self.head_dim)
                                for _ in range(2))
            caches.append(cache)
        return caches

    def row_bytes(self) -> int:
        if self.post is None:
            return self.contexts.row_bytes()
        ring = 2 * self.layers * self.keep * self.heads * self.head_dim
        return self.contexts.row_bytes() + ring * torch.finfo(self.dtype).bits // 8

    def allocate(self, rows: int) -> None:
        self.contexts.allocate(rows)
        if self.post is not None:
            p = self.like
            self.rings = [tuple(p.new_zeros(rows * self.keep, self.heads, self.head_dim) for _ in range(2))
                          for _ in range(self.layers)]
            self.offsets = torch.arange(-self.keep, 0, device=p.device)

    def gather(self, lanes: Tensor, starts: Tensor) -> State:
        """The state of these lanes at these positions (each lane's cache in order, oldest first)."""
        state = dict(zip(self.convs, self.contexts.gather(lanes, starts == 0)))
        if self.post is not None:
            slots = (lanes[:, None] * self.keep + (starts[:, None] + self.offsets) % self.keep).flatten()
            caches = []
            for k, v in self.rings:
                cache = KVCache(self.keep)
                cache.k, cache.v = (t[slots].view(len(lanes), self.keep, self.heads, self.head_dim).transpose(1, 2)
                                    for t in (k, v))
                caches.append(cache)
            state[self.post] = (starts, caches)
        return state

    def outputs(self, state: State, frames: int) -> list[Tensor]:
        """What a piece of `frames` frames changed: each conv's new context, then each layer's
        newest keys and values (as many as the ring keeps)."""
        out = [state[m] for m in self.convs]
        if self.post is not None:
            newest = min(frames, self.keep)
            for cache in state[self.post][1]:
                out += [cache.k[:, :, -newest:], cache.v[:, :, -newest:]]
        return out

    def commit(self, lanes: Tensor, starts: Tensor, frames: int, values: list[Tensor]) -> None:
        n = len(self.convs)
        self.contexts.commit(lanes, values[:n])
        if self.post is None:
            return
        newest = min(frames, self.keep)
        at = starts[:, None] + (frames - newest) + torch.arange(newest, device=starts.device)
        slots = (lanes[:, None] * self.keep + at % self.keep).flatten()
        for (k, v), new_k, new_v in zip(self.rings, values[n::2], values[n + 1 :: 2]):
            k.index_copy_(0, slots, new_k.transpose(1, 2).reshape(-1, self.heads, self.head_dim))
            v.index_copy_(0, slots, new_v.transpose(1, 2).reshape(-1, self.heads, self.head_dim))


class ConvBack(nn.Module):
    """The conv decoder as a pure function of (latents, carried context): what lets pieces
    of different requests share one batch, and lets inductor compile it once for any batch
    and piece length. A zero context is exactly the zero padding of a stream's start.

    On CUDA it runs over channels-last [B, C, 1, T] tensors (`conv_2d`), which cuDNN reads as
    they are, and its (rows, length) pairs are captured as graphs by `StreamingCodec`."""

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
        self.contexts = ContextPool(self.shapes, self.dtypes, codec.device, channels_last)
        self.compiled = torch.compile(self._step) if compiled else None
        self.warmed = False  # after start-up, a shape the compiled code has not seen runs eagerly

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

    def run(self, latents: Tensor, contexts: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """latents [B, latent_dim, T], contexts [B, ...] each -> audio [B, samples], new contexts:
        compiled where it is (one compiled graph for every batch size and piece length)."""
        if self.compiled is None:
            return self._step(latents, contexts)
        rows_dynamic(latents, *contexts)
        torch._dynamo.maybe_mark_dynamic(latents, 2)  # (a few range guards)
        if not self.warmed:
            return self.compiled(latents, contexts)
        with torch.compiler.set_stance("eager_on_recompile"):  # never a compile while serving
            return self.compiled(latents, contexts)

    def lanes(self, lanes: Tensor, starts: Tensor, latents: Tensor) -> tuple[Tensor, list[Tensor]]:
        """`run` over these lanes' contexts (zeros where a stream starts)."""
        return self.run(latents, self.contexts.gather(lanes, starts == 0))


class PartlyRun(RuntimeError):
    """A push failed after some of its batches ran: `pieces` holds their audio (their lanes
    have moved on); the other lanes are as they were."""

    def __init__(self, pieces: "Pieces"):
        super().__init__(f"a codec push failed after {len(pieces.parts)} of its batches ran")
        self.pieces = pieces


@dataclass
class _Ran:
    """A batch of one half that ran without a graph: its lanes and positions, and the new state
    to commit."""

    lanes: Tensor
    starts: Tensor
    frames: int
    state: list[Tensor]


class Pieces:
    """A batch's audio: each back batch's [rows, samples] on the device, with the rows of
    the batch it holds and each row's length in samples, and its copy to the host if started."""

    def __init__(self, count: int):
        self.count = count
        self.parts: list[tuple[np.ndarray, Tensor, np.ndarray]] = []
        self._copies: list[HostCopy | None] = []

    def add(self, rows: np.ndarray, audio: Tensor, lengths: np.ndarray, home: bool = False) -> None:
        """A back batch's audio; `home`: its copy to the host starts now (asynchronous, into
        pinned memory), behind only the work queued so far."""
        self.parts.append((rows, audio, lengths))
        self._copies.append(HostCopy(audio) if home else None)

    def tensors(self) -> list[Tensor]:
        """Each piece's audio [1, samples], in order (views on the device; of a push with `home`,
        views on its graphs' outputs, valid until they replay again: read those with `home`)."""
        out: list[Optional[Tensor]] = [None] * self.count
        for rows, audio, lengths in self.parts:
            for i, (row, n) in enumerate(zip(rows, lengths)):
                out[row] = audio[i : i + 1, :n]
        return out

    def home(self, waits: WaitClock | None = None) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
        """Each back batch's rows and their audio as float32 samples, in the order they ran, each
        as soon as its copy is home (one copy a back batch); `waits` counts the waits for them."""
        for (rows, audio, lengths), copy_ in zip(self.parts, self._copies):
            block = (copy_ or HostCopy(audio)).get(waits).numpy()
            yield rows, [block[i, :n].copy() for i, n in enumerate(lengths)]  # (the pinned block back at once)

    def host(self) -> list[np.ndarray]:
        """Each piece's audio as float32 samples, in order."""
        out: list[Optional[np.ndarray]] = [None] * self.count
        for rows, audio in self.home():
            for row, samples in zip(rows, audio):
                out[row] = samples
        return out


class StreamingCodec:
    """Decodes streams piece by piece, each stream in a lane (a row of the state tensors,
    `allocate`). `push` takes one piece each of several lanes, batched by the length they run
    over, at most `max_batch_frames` frames a batch (bounded so that a request's first piece
    never waits long behind one batch). On CUDA both halves replay graphs captured by `capture`."""

    def __init__(self, codec: Codec, first: int = 4, largest: int = 64, max_batch_frames: int = 512,
                 back_dtype: torch.dtype | None = None, front_dtype: torch.dtype | None = None,
                 front_tf32: bool = True, lanes: int = 0, repeats: int = 1):
        self.codec = codec
        self.schedule = PieceSchedule(first, largest, repeats)
        self.max_batch_frames = max_batch_frames
        self.use_graphs = codec.device.type == "cuda"
        self.front_tf32 = front_tf32  # (on CUDA: the CPU captures no graphs)
        # On CUDA with a float32 codec (a dtype None), both halves in float16: 10-bit mantissas,
        # as TF32 rounds its inputs, on tensor cores twice as fast. (A bfloat16 front, 7 bits,
        # gave 31 dB SNR against float32 on S1-mini's shapes; float16, 47 dB.)
        half = self.use_graphs and codec.dtype == torch.float32
        back_dtype = back_dtype or (torch.float16 if half else codec.dtype)
        front_dtype = front_dtype or (torch.float16 if half else codec.dtype)
        # Its own stream and pool (`Captures`); TF32 for a float32 front's matmuls: faster, at
        # ~51 dB SNR against float32.
        tf32 = front_tf32 if front_dtype == torch.float32 else None
        self.captures = Captures(codec.device, tf32=tf32) if self.use_graphs else None
        self.back = ConvBack(codec, compiled=self.use_graphs, channels_last=self.use_graphs, dtype=back_dtype)
        codec.front_rope(POSITIONS)  # sized once, before any graph reads it (and before a copy is made)
        self.front = FrontState(front_in(codec, front_dtype), codec.n_rows)
        self.fronts: dict[tuple[int, int], Replay] = {}  # (frames, rows) -> graph
        self.backs: dict[tuple[int, int], Replay] = {}
        self.pending_captures: list[tuple[int, int]] = []  # (frames, rows) left by `capture` for `capture_next`
        self._fitting: dict[tuple, int] = {}  # `_rows`' answers
        # Frames the back has run (each batch's graph rows times its length, padding included),
        # and of them the pieces' own: what padding costs, for benchmarks.
        self.frames_run = self.frames_given = 0
        self.lanes = 0
        if lanes:
            self.allocate(lanes)

    # -- the schedule -------------------------------------------------------------------

    def rows_for(self, frames: int) -> int:
        """Pieces of `frames` frames that go through either half in one batch."""
        return max(1, self.max_batch_frames // frames)

    def next_frames(self, pieces: int) -> int:
        """Frames in a stream's next piece, after `pieces` of them."""
        return self.schedule.frames(pieces)

    def back_frames(self, frames):
        """The shortest scheduled piece length that holds `frames` frames (a last piece's back);
        for an array of counts, an array."""
        scheduled = self.schedule.scheduled
        return scheduled[np.minimum(np.searchsorted(scheduled, frames), len(scheduled) - 1)]

    def lengths(self) -> list[int]:
        """Every scheduled piece length."""
        return self.schedule.lengths()

    # -- lanes ---------------------------------------------------------------------------

    def lane_bytes(self) -> int:
        """Device memory a lane's state takes."""
        return self.front.row_bytes() + self.back.contexts.row_bytes()

    def allocate(self, lanes: int) -> None:
        """State for `lanes` streams at once (lanes 0..lanes-1), and a scratch lane."""
        self.lanes = lanes
        self.front.allocate(lanes + 1)
        self.back.contexts.allocate(lanes + 1)

    # -- decoding ------------------------------------------------------------------------

    @torch.inference_mode()
    def push(self, lanes: np.ndarray, pieces: np.ndarray, codes: Tensor, frames: np.ndarray,
             home: bool = False) -> Pieces:
        """One piece each of different lanes -> their audio (`Pieces`). `pieces`: each lane's
        piece index (pieces it has had since its stream began: 0 starts afresh); `codes`
        [rows, 1 + C, n] on the codec's device, row i's first `frames[i]` frames the piece (fewer
        than scheduled for a stream's last piece). The pieces run by length, the shortest (a
        stream's first pieces, whose listeners have the least audio) first, each batch's front
        then its back; `home`: each back batch's audio starts home as soon as it is queued
        (`Pieces.home`). Each lane's state moves on by one piece as its batch runs: if this
        raises before any batch ran, every lane is as it was; after, it raises `PartlyRun` with
        the audio of the batches that ran (only their lanes moved on)."""
        lanes, pieces, frames = (np.asarray(a, np.int64) for a in (lanes, pieces, frames))
        if lanes.size and (lanes.min() < 0 or lanes.max() >= self.lanes):
            raise ValueError(f"lanes must be in [0, {self.lanes}), got {lanes.tolist()}")
        scheduled, starts = self.schedule.frames(pieces), self.schedule.start(pieces)
        if (frames > scheduled).any():
            raise ValueError(f"a piece holds at most its scheduled frames: {frames.tolist()} for {scheduled.tolist()}")
        if (starts + scheduled > POSITIONS).any():
            raise FishSMError(f"a stream's audio is longer than the codec streams ({POSITIONS} frames)")
        codes = codes.long()
        # A piece shorter than scheduled is its stream's last (the state it leaves is never
        # read): both halves run over the shortest scheduled length that holds it.
        lengths = self.back_frames(frames)
        if codes.shape[-1] < lengths.max(initial=0):
            codes = F.pad(codes, (0, int(lengths.max()) - codes.shape[-1]))
        # Grouped by length, so that each batch's codes are a slice (indexing a device tensor by
        # a host array would copy the index from pageable memory).
        by_length = np.argsort(lengths, kind="stable")
        if (by_length != np.arange(len(by_length))).any():
            codes = codes.index_select(0, to_device(torch.from_numpy(by_length), codes.device))
        out = Pieces(len(lanes))
        steps, frame_length = self.back.steps, self.codec.frame_length
        runs, firsts = np.unique(lengths[by_length], return_index=True)
        ends = np.append(firsts[1:], len(by_length))
        try:
            for n, first, end in zip(runs.tolist(), firsts.tolist(), ends.tolist()):
                for at in range(first, end, self.rows_for(n)):
                    upto = min(at + self.rows_for(n), end)
                    rows, b = by_length[at:upto], upto - at
                    # One copy of the lanes and positions for both halves, padded for the larger graph.
                    padded = max(self._rows(n, b, self.fronts), self._rows(n, b, self.backs))
                    lanes_t, starts_t = self._inputs(lanes[rows], starts[rows], padded)
                    z, front = self._half(self.fronts, self._front, n, b, lanes_t, starts_t, codes[at:upto, :, :n])
                    audio, back = self._half(self.backs, self.back.lanes, n, b, lanes_t, starts_t, z[..., : n * steps])
                    for commit, ran in ((self.front.commit, front), (self._commit_back, back)):
                        if ran is not None:  # (a graph wrote its lanes' new state itself)
                            commit(ran.lanes, ran.starts, ran.frames, ran.state)
                    if back is None and not home:  # the graph's own output: its next replay overwrites it
                        audio = audio.clone()
                    self.frames_run += n * (b if back is not None else self._rows(n, b, self.backs))
                    self.frames_given += int(frames[rows].sum())
                    out.add(rows, audio, frames[rows] * frame_length, home)
        except Exception as exc:
            if out.parts:
                raise PartlyRun(out) from exc
            raise
        return out

    def _commit_back(self, lanes: Tensor, starts: Tensor, frames: int, values: list[Tensor]) -> None:
        self.back.contexts.commit(lanes, values)

    def _inputs(self, lanes: np.ndarray, starts: np.ndarray, rows: int) -> tuple[Tensor, Tensor]:
        """Lanes and positions on the device, padded to `rows` with the scratch lane."""
        spare = rows - len(lanes)
        both = np.stack([np.concatenate([lanes, np.full(spare, self.lanes)]), np.concatenate([starts, np.zeros(spare, np.int64)])])
        both = to_device(torch.from_numpy(both), self.codec.device)
        return both[0], both[1]

    def _rows(self, n: int, b: int, graphs: dict) -> int:
        """The graph's rows for `b` pieces of `n` frames: the smallest captured that holds them (else b)."""
        key = (graphs is self.fronts, n, b, len(graphs))  # (graphs are only ever added)
        rows = self._fitting.get(key)
        if rows is None:
            fits = [rows for frames, rows in list(graphs) if frames == n and rows >= b]  # (a thread may be adding one)
            rows = self._fitting[key] = min(fits) if fits else b
        return rows

    def _graphed(self, n: int, b: int) -> bool:
        """Both halves of `b` pieces of `n` frames have graphs (while the capturing thread adds
        a shape's, a batch runs without them: one half's graph would move its lanes' state on
        before the other half ran)."""
        return (n, self._rows(n, b, self.fronts)) in self.fronts and (n, self._rows(n, b, self.backs)) in self.backs

    def _half(self, graphs: dict, run: Callable, n: int, b: int, lanes_t: Tensor, starts_t: Tensor,
              x: Tensor) -> tuple[Tensor, _Ran | None]:
        """One batch of `b` pieces through either half (`run`: `_front` or the back's `lanes`)
        over `x` (codes or latents): its captured graph for (n, rows) where both halves have
        one, else `run` itself. `lanes_t`, `starts_t`: on the device, padded to at least the
        graph's rows (`_inputs`). Its output (a graph's: valid until its next replay) and, run
        without a graph, its new state to commit (a graph commits its own)."""
        if not self._graphed(n, b):
            out, state = run(lanes_t[:b], starts_t[:b], x)
            return out, _Ran(lanes_t[:b], starts_t[:b], n, state)
        rows = self._rows(n, b, graphs)
        return graphs[(n, rows)](lanes_t[:rows], starts_t[:rows], x)[:b], None

    def _front(self, lanes: Tensor, starts: Tensor, codes: Tensor) -> tuple[Tensor, list[Tensor]]:
        state = self.front.gather(lanes, starts)
        z = self.front.quantizer.decode(codes, state).to(self.back.dtype)  # (the latents the back's graphs take)
        return z, self.front.outputs(state, codes.shape[-1])

    def _front_committed(self, lanes: Tensor, starts: Tensor, codes: Tensor) -> Tensor:
        """`_front` with its new state written to the lanes (what a front's graph runs; padding
        rows write the scratch lane's)."""
        z, state = self._front(lanes, starts, codes)
        self.front.commit(lanes, starts, codes.shape[-1], state)
        return z

    def _back_committed(self, lanes: Tensor, starts: Tensor, latents: Tensor) -> Tensor:
        audio, state = self.back.lanes(lanes, starts, latents)
        self.back.contexts.commit(lanes, state)
        return audio

    # -- start-up ------------------------------------------------------------------------

    @torch.inference_mode()
    def working_bytes(self) -> int:
        """GPU memory the back's largest batches take while they run (what the KV cache must
        leave room for), measured as they will run: compiled, which compiles it now."""
        device = self.codec.device
        if device.type != "cuda":
            return 0
        most = 0
        for frames in (self.schedule.largest, self.schedule.first):  # few rows of long pieces, many of short ones
            rows = self.rows_for(frames)
            latents, contexts = self.back.silence(rows, frames), self.back.initial(rows)
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.back.run(latents, contexts)
            torch.cuda.synchronize(device)
            most = max(most, torch.cuda.max_memory_allocated(device) - before)
        return most

    def capture_shapes(self) -> list[tuple[int, int]]:
        """Every (frames, rows) captured: each scheduled length at 1, 2, ..., 8, 10, 12, 14, 16,
        20, ... rows (four sizes an octave) up to a batch (or the lanes, each a batch's row at
        most once). A batch runs the smallest that holds it, and the codec's work is per row,
        padding included: with powers of two alone a loaded codec ran a quarter of its rows as
        padding. In the order a server captures them once serving: the powers of two (and the
        largest) first, the fewest rows first, so that every batch has a graph soon; then the
        sizes between them."""
        shapes, between = [], []
        for n in self.lengths():
            most = self._most_rows(n)
            doubling = batch_sizes(most)
            for rows in batch_sizes(most, CODEC_SIZES_PER_OCTAVE):
                (shapes if rows in doubling else between).append((n, rows))
        return sorted(shapes, key=lambda s: (s[1], s[0])) + sorted(between, key=lambda s: (s[1], s[0]))

    def _most_rows(self, n: int) -> int:
        """The most pieces of `n` frames in one batch: a batch's, or the lanes' (one piece a lane)."""
        return min(self.rows_for(n), max(1, self.lanes))

    @torch.inference_mode()
    def capture(self, rows: int | None = None) -> None:
        """Start-up work (CUDA, after `allocate`): the graphs of batches of at most `rows`
        pieces (None: every batch) of every scheduled length; the others are left to
        `capture_next`, a batch that finds none meanwhile running the compiled back and the
        eager front. A back's first run compiles it."""
        if not self.use_graphs:
            return
        if self.captures.flips_flag:  # a float32 front's capture sets a process-wide flag: never beside serving
            rows = None
        shapes = self.capture_shapes()
        self.pending_captures = [s for s in shapes if rows is not None and s[1] > rows]
        for n, r in shapes:
            if rows is None or r <= rows:
                self._capture(n, r)
        self.back.warmed = True

    @property
    def capturing(self) -> bool:
        """Graphs are still to be captured (`capture_next`)."""
        return bool(self.pending_captures)

    @torch.inference_mode()
    def capture_next(self) -> None:
        """Capture the next graphs left by `capture`, those of one (frames, rows) shape."""
        self._capture(*self.pending_captures.pop(0))

    def _capture(self, n: int, rows: int) -> None:
        """The front's and the back's graphs for `rows` pieces of `n` frames (scratch lanes).

        cuDNN picks each back conv's kernel by timing its candidates (benchmark mode) in the
        run before the capture: its heuristics' picks for these channels-last shapes were
        slower. A single piece's back replays the two-row graph: at one row the compiled back
        would be specialised, and compiled, a second time."""
        device, scratch = self.codec.device, self.lanes
        lanes = torch.full((rows,), scratch, dtype=torch.long, device=device)
        starts = torch.zeros(rows, dtype=torch.long, device=device)
        codes = torch.zeros(rows, self.codec.n_rows, n, dtype=torch.long, device=device)
        self.fronts[(n, rows)] = Replay(self._front_committed, [lanes, starts, codes], self.captures,
                                        self.captures.matmuls)
        if rows > 1 or self._most_rows(n) == 1:
            self.backs[(n, rows)] = Replay(self._back_committed, [lanes.clone(), starts.clone(), self.back.silence(rows, n)],
                                           self.captures, cudnn_benchmark)

    @property
    def graphs(self) -> int:
        return len(self.fronts) + len(self.backs)


def decode_in_pieces(codec: StreamingCodec, codes: Tensor, lane: int = 0) -> Tensor:
    """codes [1, rows, n] decoded piece by piece in `lane`, as a stream would be (graphs where captured)."""
    out, at, pieces = [], 0, 0
    while at < codes.shape[-1]:
        n = min(codec.next_frames(pieces), codes.shape[-1] - at)
        out += codec.push([lane], [pieces], codes[..., at : at + n].to(codec.codec.device), [n]).tensors()
        at, pieces = at + n, pieces + 1
    return torch.cat(out, dim=-1)

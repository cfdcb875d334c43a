"""A frame's decoding on the model's static KV cache, and its CUDA graphs.

One frame = one slow step (the head picks a semantic code or <|im_end|>) followed by
`num_codebooks - 1` fast steps (the residual codes). The repetition-penalty window is
upstream's: the 16 frames before the current one, counted from the first frame after
the prefill, zero-filled while fewer exist; the slow head sees only the window's first
frame (see `sampling.head_penalty_indices`).

`decode_frame` is a pure tensor function of fixed shapes — the random draws come in as
a tensor of Exp(1) noise — so a whole frame can be captured as a CUDA graph (`GraphedStep`)
or compiled with torch.compile.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import time
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import numpy as np
import torch
from torch import Tensor

from fish_sm import kernels
from fish_sm.engine.sampling import PENALTY_WINDOW, head_penalty_indices, logits_to_probs
from fish_sm.errors import InputError
from fish_sm.model.config import RESIDUAL_CODEBOOK_SIZE
from fish_sm.model.dual_ar import DualARTransformer


def noise_size(model: DualARTransformer) -> int:
    """Exp(1) draws one frame needs: one per head row, then one per residual code of each fast step."""
    c = model.config
    return c.semantic_vocab + 1 + (c.num_codebooks - 1) * RESIDUAL_CODEBOOK_SIZE


def pick(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
         previous: Tensor | None, sort_free: bool = False) -> Tensor:
    """One sampled index per row: argmax of probs / Exp(1) noise (see `sampling.sample`)."""
    probs = logits_to_probs(logits, temperature, top_p, penalty, previous, sort_free)
    return torch.argmax(probs / noise, dim=-1)


def pick_residual(model: DualARTransformer, hidden: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor,
                  penalty: Tensor, previous: Tensor | None, sort_free: bool = False) -> Tensor:
    """A residual code per row from the fast transformer's hidden state: its head, then `pick`."""
    return pick(model.fast_logits(hidden), noise, temperature, top_p, penalty, previous, sort_free)


class Pickers(NamedTuple):
    """The functions `sample_frame` picks codes with: these, eager, or their compiled
    versions (the graphs': head, nucleus, softmax and draw in a few fused kernels).
    `head_with_input`, `residual_with_input`: instead of `head` and `residual`, pickers that
    also return the code's embedding as `model.fast_embeddings` gives it (its adapters'
    part included), the head's with its token and code (`kernels.pick_head_kernels`,
    `kernels.pick_residual_kernels`)."""
    head: Callable[..., Tensor] = pick
    residual: Callable[..., Tensor] = pick_residual
    head_with_input: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
    residual_with_input: Callable[..., tuple[Tensor, Tensor | None]] | None = None


def sample_frame(model: DualARTransformer, logits: Tensor, hidden: Tensor, window: Tensor | None, noise: Tensor,
                 temperature: Tensor, top_p: Tensor, penalty: Tensor, pickers: Pickers = Pickers()) -> Tensor:
    """The slow head's choice and the fast transformer's codes for one frame of each of B rows.

    logits [B, semantic_vocab + 1], hidden [B, fast_dim], window [B, 1 + C, 16] (None for
    the frame after a prefill, which upstream samples without penalty), noise [B, noise_size],
    temperature/top_p/penalty [B, 1]. Returns [B, 1 + C]: (token id, code 0, ..., code C-1).
    """
    c = model.config
    n_head = c.semantic_vocab + 1
    if pickers.head_with_input is not None:
        token, code, x = pickers.head_with_input(model, logits, noise[:, :n_head], temperature, top_p, penalty, window)
    else:
        head_prev = None if window is None else head_penalty_indices(window[:, :, 0], model.semantic_begin_id,
                                                                      c.semantic_vocab, model.im_end_id)
        row = pickers.head(logits, noise[:, :n_head], temperature, top_p, penalty, head_prev)
        is_end = row == c.semantic_vocab
        token = torch.where(is_end, model.im_end_id, row + model.semantic_begin_id)
        code = torch.where(is_end, 0, row)
        x = model.fast_embeddings(code)
    codes = [code]
    # Several rows: the fast transformer's positions 0 and 1 in one pass (h is position 1's
    # output); one row keeps two, as on the row-product kernels the first is three products short.
    pair = hidden.shape[0] > 1
    if pair:
        h = model.forward_fast_pair(hidden, x)
    else:
        model.prime_fast(hidden)
    for i in range(1, c.num_codebooks):
        if i > 1 or not pair:
            h = model.forward_fast(x, i)
        start = n_head + (i - 1) * RESIDUAL_CODEBOOK_SIZE
        args = (model, h, noise[:, start : start + RESIDUAL_CODEBOOK_SIZE], temperature, top_p, penalty,
                None if window is None else window[:, i + 1])
        last = i == c.num_codebooks - 1
        if pickers.residual_with_input is not None:
            code, x = pickers.residual_with_input(*args, next_input=not last)
        else:
            code = pickers.residual(*args)
            x = None if last else model.fast_embeddings(code)
        codes.append(code)
    return torch.stack([token, *codes], dim=1)


def decode_frame(model: DualARTransformer, frame: Tensor, input_pos: Tensor, window: Tensor, noise: Tensor,
                 temperature: Tensor, top_p: Tensor, penalty: Tensor, live: int = 0,
                 key_pos: Tensor | None = None, pickers: Pickers = Pickers(), rows: Tensor | None = None) -> Tensor:
    """Feed each row's previous frame (frame [B, 1 + C], at input_pos [B], in cache rows 0..B-1,
    or in the cache rows `rows` [B] names) and sample the next ones; sampling parameters are
    [B, 1], one per row.

    Eager: attention reads exactly `live` cache slots. Compiled or batched: `key_pos` (an
    arange of the longest row's length rounded up by `attention_bucket`) sets how many,
    masking each row's slots after its query, so a graph serves every position in its bucket.
    """
    # One row: its position as the batch's shared one (a plain slice write into the cache);
    # several: one position per row (an indexed write).
    positions = input_pos if frame.shape[0] == 1 else input_pos[:, None]
    logits, hidden = model.forward_slow(frame[:, :, None], positions, live, key_pos, 0 if rows is None else rows)
    return sample_frame(model, logits, hidden, window, noise, temperature, top_p, penalty, pickers)


class SlotState(NamedTuple):
    """What a decode step over slots reads and writes besides the KV cache: each slot's last
    frame `current` [slots + 1, 1 + C] and its codes so far `history` [slots + 1, 1 + C,
    frames + window] (the penalty window's source); a step's Exp(1) `noise` rows; with
    `keyed`, drawn in the step from each row's key (`kernels.exponential_noise`), else filled
    before it; `adapters`: sets the rows' LoRA adapter slots (None: no adapters)."""
    current: Tensor
    history: Tensor
    noise: Tensor
    keyed: bool
    adapters: Callable[[Tensor], None] | None = None


STEP_INTS = 5  # a step's integers per row: noise key, cache row, position, frame index, adapter slot
FIRST_INTS = 2  # a first frame's (after a prefill): noise key, cache row
STEP_FLOATS = 3  # and floats, both: temperature, top_p, repetition penalty


def step_layout(batch: int, ints: int = STEP_INTS) -> tuple[int, int]:
    """Where a step of `batch` rows finds its floats in its input buffer (its integers come
    first, [ints, batch] int64), and the buffer's bytes."""
    floats = -(-ints * batch * 8 // 16) * 16
    return floats, floats + STEP_FLOATS * batch * 4


def step_inputs(buffer: Tensor, batch: int, ints: int = STEP_INTS) -> tuple[Tensor, Tensor]:
    """A step's integers [ints, batch] and floats [STEP_FLOATS, batch, 1], views of a byte buffer."""
    at, end = step_layout(batch, ints)
    return (buffer[: ints * batch * 8].view(torch.int64).view(ints, batch),
            buffer[at:end].view(torch.float32).view(STEP_FLOATS, batch, 1))


def decode_slots(model: DualARTransformer, state: SlotState, ints: Tensor, floats: Tensor, key_pos: Tensor,
                 pickers: Pickers = Pickers()) -> Tensor:
    """One frame for each row of a step over slots, everything it reads gathered by the rows'
    cache rows and everything it writes scattered back, so that a captured step is one replay
    and one copy of its inputs: ints [STEP_INTS, B], floats [STEP_FLOATS, B, 1] (`step_inputs`).
    Returns the frames [B, 1 + C]."""
    keys, rows, input_pos, index, adapter_slots = ints
    batch, codebooks = rows.shape[0], state.current.shape[1]
    if state.adapters is not None:
        state.adapters(adapter_slots)
    noise = state.noise[:batch]
    if state.keyed:
        kernels.exponential_noise(keys, noise)
    codebook_rows = torch.arange(codebooks, device=rows.device)
    columns = (index - PENALTY_WINDOW).clamp(min=0)[:, None] + torch.arange(PENALTY_WINDOW, device=rows.device)
    window = state.history[rows[:, None, None], codebook_rows[None, :, None], columns[:, None, :]]
    out = decode_frame(model, state.current[rows], input_pos, window, noise, floats[0], floats[1], floats[2],
                       key_pos=key_pos, pickers=pickers, rows=rows)
    state.history[rows[:, None], codebook_rows[None, :], index[:, None]] = out
    state.current.index_copy_(0, rows, out)
    return out


def first_slots(model: DualARTransformer, state: SlotState, ints: Tensor, floats: Tensor, logits: Tensor,
                hidden: Tensor, pickers: Pickers = Pickers()) -> Tensor:
    """The first frame of each row after its prefill (no penalty window, as upstream samples it),
    from the prefill's `logits` and `hidden` [B, ...]: its slot's history is reset and the frame
    written back as the slot's last, so that a captured one is one replay and one copy of its
    inputs: ints [FIRST_INTS, B] (noise key, cache row), floats [STEP_FLOATS, B, 1]. Returns the
    frames [B, 1 + C]."""
    keys, rows = ints
    noise = state.noise[: rows.shape[0]]
    if state.keyed:
        kernels.exponential_noise(keys, noise)
    state.history.index_fill_(0, rows, 0)  # (not `history[rows] = 0`, which waits for the GPU)
    out = sample_frame(model, logits, hidden, None, noise, floats[0], floats[1], floats[2], pickers)
    state.current.index_copy_(0, rows, out)
    return out


LIVE_BUCKET = 256  # cache slots; the compiled step reads at most this many more than it needs up to 2,048


def attention_bucket(max_seq_len: int, live: int, bucket: int = LIVE_BUCKET) -> int:
    """The cache slots the compiled step attends over for `live` used ones: the next multiple
    of `bucket` up to 2,048 (where the batching engine runs), of twice that up to 4,096, then
    of four times. Fewer, longer buckets: each graph costs start-up time (a cuDNN plan, a
    capture), while slots read in vain cost a frame little (~17 µs at worst on an H100)."""
    step = bucket if live <= 2048 else 2 * bucket if live <= 4096 else 4 * bucket
    return min(max_seq_len, -(-live // step) * step)


def length_buckets(max_seq_len: int, bucket: int = LIVE_BUCKET) -> list[int]:
    return sorted({attention_bucket(max_seq_len, live, bucket) for live in range(1, max_seq_len + 1)})


def batch_sizes(most: int, per_octave: int = 1) -> list[int]:
    """The batch sizes captured as graphs: powers of two up to `most`, and `most`; with
    `per_octave` 2 or 4, also the sizes that split each octave in that many steps (3 * 2^k; 5, 6,
    7 * 2^k), for work that costs every padded row in full, as the codec's does: padding then adds
    less than a half or a quarter of a batch's rows, where powers of two can nearly double them."""
    sizes = {(1 << k) * (per_octave + j) // per_octave for k in range(most.bit_length()) for j in range(per_octave)}
    return sorted({b for b in sizes if b <= most} | {most})


ADMISSION_MIN_WIDTH = 32
ADMISSION_MAX_WIDTH = 512  # longer prompts' prefills are compute, not launches: not captured


def admission_shape(batch: int, width: int, max_batch: int, max_seq_len: int, min_width: int = ADMISSION_MIN_WIDTH,
                    max_width: int = ADMISSION_MAX_WIDTH) -> tuple[int, int]:
    """The captured admission that `batch` prompts padded to `width` positions run in: the
    next captured batch size, and the next power of two (at least `min_width`); unchanged
    beyond `max_width`."""
    if width > min(max_width, max_seq_len):
        return batch, width
    rows = next((b for b in batch_sizes(max_batch) if b >= batch), batch)
    return rows, min(max_seq_len, max(min_width, 1 << (width - 1).bit_length()))


def admission_shapes(max_batch: int, max_seq_len: int, max_tokens: int, min_width: int = ADMISSION_MIN_WIDTH,
                     max_width: int = ADMISSION_MAX_WIDTH) -> list[tuple[int, int]]:
    """Every captured admission shape: of at most `max_tokens` padded positions."""
    widths = {admission_shape(1, w, max_batch, max_seq_len, min_width, max_width)[1]
              for w in range(1, min(max_width, max_seq_len) + 1)}
    return [(b, w) for w in sorted(widths) for b in batch_sizes(max_batch) if b * w <= max_tokens]


@functools.cache
def kernels_load_in_captures() -> bool:
    """Whether this CUDA driver loads a kernel's module inside a stream capture (12.3 and later)."""
    try:
        version = ctypes.c_int(0)
        return ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value >= 12030
    except (OSError, AttributeError):
        return False


class GraphedStep:
    """The batching engine's decode steps replayed from CUDA graphs, one per (batch size,
    attention bucket): a step over slots (`decode_slots`: its gathers, noise, frame and
    scatters) is one copy of its inputs into a static buffer and a single launch of all its
    kernels, with no Python or launch overhead between them; likewise the first frame after a
    prefill and the admissions' prefills. Each step names the cache rows of its sequences (an
    input like the others: one graph serves any rows), and captures write into the scratch
    row `scratch_row`, so graphs can be captured while other rows hold live requests.
    Outputs are reused by the next replay (callers clone them). `compile_options`: keyword
    arguments of every `kernels.compile_decode` call (inductor's options for the layers and
    pickers). A model carrying LoRA adapter slots (`adapters`) gets each decode step twice: with
    the adapters' products, and without them (`AdapterSlots.without`) for steps none of whose
    rows has an adapter, which then cost what they cost on a model without adapters."""

    def __init__(self, model: DualARTransformer, state: SlotState, scratch_row: int, max_batch: int = 1,
                 compile_options: Mapping = MappingProxyType({}), adapters: kernels.AdapterSlots | None = None):
        dev = model.device
        self.model, self.state, self.adapters = model, state, adapters
        # Inductor fuses the layers' pointwise work and INT8 dequantization into few kernels
        # (or, one row, our kernels); the graphs then replay those kernels.
        mode = kernels.BATCHING if max_batch > 1 else kernels.SEQUENTIAL
        fast = kernels.install(model, mode, compile_options=compile_options)
        # One row: the residual codebooks' nucleus without a sort (see sampling.PAIRWISE_MAX_VOCAB),
        # untuned (torch retuned them at every warm start, for nothing); on the row-product
        # kernels the heads read no torchao tensors: dependent launch as in bf16.
        int8 = kernels.quantized(model) and not fast.rows
        self.pickers_one = Pickers(*(kernels.compile_decode(functools.partial(f, sort_free=True), one_row=True,
                                                            tune=False, int8=int8, **compile_options)
                                     for f in (pick, pick_residual)))
        # On the row-product kernels, each pick and the next fast step's lookup as kernels of
        # our own: two a pick, instead of six a residual code and about twenty for the slow head.
        if fast.rows and fast.picks:
            self.pickers_one = self.pickers_one._replace(head_with_input=kernels.pick_head_kernels,
                                                         residual_with_input=kernels.pick_residual_kernels)
        self.pickers_many = Pickers(*(kernels.compile_decode(f, one_row=False, rows_first=True, **compile_options)
                                      for f in (pick, pick_residual)))
        # Several rows: each pick as one kernel a row instead of a sort and ~ten more kernels;
        # the fast head's norm and product still compiled (the product cuBLAS's).
        if fast.picks:
            fast_logits = kernels.compile_decode(DualARTransformer.fast_logits, one_row=False, rows_first=True,
                                                 **compile_options)
            self.pickers_many = self.pickers_many._replace(
                head_with_input=kernels.pick_head_kernels,
                residual_with_input=functools.partial(kernels.pick_residual_kernels, fast_logits=fast_logits))
        # Inference tensors, like everything a replay computes: a compiled function sees one
        # kind of tensor from every caller (a buffer made outside inference mode would make
        # dynamo compile each layer half and sampler a second time for it).
        with torch.inference_mode():
            self.step_buffer = torch.zeros(step_layout(max_batch)[1], dtype=torch.uint8, device=dev)
            self.first_buffer = torch.zeros(step_layout(max_batch, FIRST_INTS)[1], dtype=torch.uint8, device=dev)
            c = model.config
            self.first_outputs = {  # a prefill's, which the first frame after it reads
                "logits": torch.zeros(max_batch, c.semantic_vocab + 1, dtype=model.dtype, device=dev),
                "hidden": torch.zeros(max_batch, c.fast_dim, dtype=model.dtype, device=dev),
            }
        self.pool = torch.cuda.graph_pool_handle()
        # (batch, bucket): decode steps; ("first", batch): first frames
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.without_adapters: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # (batch, bucket), as `adapters` says
        self.admissions: dict[tuple[int, int], tuple] = {}  # (batch, width) -> graph, inputs, outputs
        self.continuations: dict[tuple[int, int, int], tuple] = {}  # (batch, width, live): after a prefix
        self.timings: dict[str, float] = {}  # capture seconds by kind (capture_all)
        self.scratch_row = scratch_row
        # "thread_local" once other threads use the GPU (captures beside serving): their calls
        # then cannot invalidate this thread's capture.
        self.capture_error_mode = "global"

    def inputs(self, batch: int) -> tuple[Tensor, Tensor]:
        """The (batch) decode graphs' static inputs (`step_inputs`)."""
        return step_inputs(self.step_buffer, batch)

    def first_inputs(self, batch: int) -> tuple[Tensor, Tensor]:
        """The (batch) first-frame graph's static inputs besides the prefill's outputs (`first_slots`)."""
        return step_inputs(self.first_buffer, batch, FIRST_INTS)

    @torch.inference_mode()  # as every replay runs: one grad mode, one set of compiled graphs
    def capture(self, batch: int, bucket: int, warm_up: bool = True) -> None:
        ints, floats = self.inputs(batch)
        ints.zero_()
        ints[1].fill_(self.scratch_row)
        ints[2].fill_(bucket - 1)  # a valid position; what it writes is rewritten when used
        floats.fill_(1.0)
        key_pos, pickers = self.model.positions[:bucket], self.pickers_for(batch)
        step = lambda: decode_slots(self.model, self.state, ints, floats, key_pos, pickers)  # noqa: E731
        self.graphs[(batch, bucket)] = self._capture(step, warm_up)
        if self.adapters is not None:
            with self.adapters.without():
                self.without_adapters[(batch, bucket)] = self._capture(step, warm_up)

    def pickers_for(self, batch: int) -> Pickers:
        return self.pickers_one if batch == 1 else self.pickers_many

    def capture_all(self, batches=(1,)) -> None:
        """Every decode step and first frame of these batch sizes. `timings`: seconds by kind;
        "traced" is the first decode capture, which also traces and compiles (or loads from
        the cache) the layers and pickers.

        Only the first capture of each batch size and kind runs its function once before
        capturing it: what that run is for (compiling, tuning, first launches, workspaces) is
        then done, since the next buckets differ only in lengths that compiled code does not
        see, and kernels a later bucket launches for the first time load inside the capture
        (CUDA 12.3 and later), which makes warm starts shorter. A driver before CUDA 12.3 fails
        such a capture, and torch does not recover from a failed one, so there every capture
        warms up."""
        for batch in batches:
            for i, bucket in enumerate(length_buckets(self.model.max_seq_len)):
                self._timed("traced" if not self.graphs else "decode", self.capture, batch, bucket, i == 0)
            self._timed("first", self.capture_first, batch)

    def _timed(self, kind: str, capture: Callable, *args) -> None:
        t0 = time.perf_counter()
        capture(*args)
        self.timings[kind] = self.timings.get(kind, 0.0) + time.perf_counter() - t0

    @torch.inference_mode()
    def capture_first(self, batch: int) -> None:
        """The first frame after a prefill (`first_slots`) for `batch` prompts at once: one
        replay instead of ~1,400 kernels launched one by one (each chunk's first frame; the
        batching engine's admissions). Its capture writes into the scratch row."""
        ints, floats = self.first_inputs(batch)
        ints.zero_()
        ints[1].fill_(self.scratch_row)
        floats.fill_(1.0)
        model, x = self.model, {k: v[:batch] for k, v in self.first_outputs.items()}
        self.graphs[("first", batch)] = self._capture(lambda: first_slots(
            model, self.state, ints, floats, x["logits"], x["hidden"], self.pickers_for(batch)))

    def first_sizes(self, rows: int) -> list[int]:
        """The captured first-frame batch sizes that hold `rows` rows."""
        return sorted(b for kind, b in self.graphs if kind == "first" and b >= rows)

    def first_frame(self, batch: int, logits: Tensor, hidden: Tensor) -> Tensor:
        """The captured (batch) first frame on whatever its inputs (`first_inputs`) hold, after
        the prefill's outputs of its first rows: [batch, 1 + C], valid until the next replay."""
        _fill(self.first_outputs, logits=logits, hidden=hidden)
        graph, out = self.graphs[("first", batch)]
        graph.replay()
        return out

    def _prompt_inputs(self, batch: int, width: int) -> dict[str, Tensor]:
        """A captured prefill's static inputs, `batch` prompts padded to `width`: tokens
        [batch, 1 + C, width], positions [batch, width], cache rows and last positions [batch],
        views of one buffer ("buffer", int64; each part 16-byte aligned) that a prefill's
        inputs reach in one staged copy (`admit`)."""
        counts = _prompt_counts(batch, 1 + self.model.config.num_codebooks, width)
        buffer = torch.zeros(sum(_even(n) for n in counts), dtype=torch.long, device=self.model.device)
        tokens, positions, row, last = (part[:n] for part, n in zip(buffer.split([_even(n) for n in counts]), counts))
        x = {"tokens": tokens.view(batch, -1, width), "positions": positions.view(batch, width), "row": row,
             "last": last, "buffer": buffer}
        x["positions"].copy_(torch.arange(width, device=buffer.device).repeat(batch, 1))
        x["row"].fill_(self.scratch_row)
        return x

    @torch.inference_mode()
    def capture_admission(self, batch: int, width: int) -> None:
        """A prefill of `batch` prompts from position 0 (no reused prefix), padded at their
        ends to `width` positions, each into its own cache row, attending causally
        over its own `width` positions: the batching engine's admissions as one
        replay, not ~1,300 kernels launched from Python (measured 40-170 ms under load,
        every stream waiting). Its capture writes into the scratch row."""
        model, x = self.model, self._prompt_inputs(batch, width)
        graph, out = self._capture(lambda: model.forward_slow(x["tokens"], x["positions"], width,
                                                              row=x["row"], last=x["last"]))
        self.admissions[(batch, width)] = graph, x, out

    @torch.inference_mode()
    def capture_continuation(self, batch: int, width: int, live: int) -> None:
        """A prefill of `batch` prompts after a reused prefix, padded at their ends to `width`
        positions, each attending over the first `live` slots of its cache row (those after a
        query masked): one replay for a voice's prompt after its kept prefix. Its capture
        writes into the scratch row."""
        model, x = self.model, self._prompt_inputs(batch, width)
        key_pos = model.positions[:live]
        graph, out = self._capture(lambda: model.forward_slow(x["tokens"], x["positions"], live, key_pos=key_pos,
                                                              row=x["row"], last=x["last"]))
        self.continuations[(batch, width, live)] = graph, x, out

    def admit(self, graphs: dict, key: tuple, staging: "HostStaging", inputs: tuple[np.ndarray, ...]
              ) -> tuple[Tensor, Tensor]:
        """A captured prefill (`graphs`: `admissions` by (batch, width), or `continuations` by
        (batch, width, live)) on host `inputs` (tokens, positions, cache rows, last positions,
        already padded to its shape), copied into its buffer at once: logits and
        fast-transformer inputs, graph outputs valid until the next replay."""
        graph, x, out = graphs[key]
        counts = _prompt_counts(*x["tokens"].shape)
        offsets = np.cumsum([0, *(_even(n) * 8 for n in counts[:-1])])
        staging.write(x["buffer"].view(torch.uint8), [(int(at), np.asarray(a, np.int64)) for at, a in zip(offsets, inputs)])
        graph.replay()
        return out

    def _capture(self, run: Callable[[], Tensor], warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        if warm_up or not kernels_load_in_captures():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()  # outside the graph: compiling, lazy inits, workspace allocations
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            out = run()
        return graph, out

    def replay(self, batch: int, bucket: int, adapters: bool = True) -> Tensor:
        """The (batch, bucket) decode step on whatever its inputs (`inputs`) hold: [batch, 1 + C].
        `adapters`: some row has an adapter (if none has, the graph without their products)."""
        graph, out = (self.graphs if adapters or self.adapters is None else self.without_adapters)[(batch, bucket)]
        graph.replay()
        return out


def _prompt_counts(batch: int, rows: int, width: int) -> list[int]:
    """Elements of a prefill's tokens, positions, cache rows and last positions."""
    return [batch * rows * width, batch * width, batch, batch]


def _even(n: int) -> int:
    """n rounded up to even: int64 parts of one buffer then start 16-byte aligned."""
    return n + n % 2


def _fill(buffers: dict[str, Tensor], **values: Tensor) -> None:
    """Copy a replay's inputs into the first rows of its static buffers."""
    for name, value in values.items():
        buffers[name][: value.shape[0]].copy_(value, non_blocking=True)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without a synchronous copy (CUDA: staged in pinned memory,
    then copied asynchronously on the current stream). A pageable copy waits in the driver
    for the stream's queued work, and while it waits other threads' CUDA calls can block
    too (the codec thread's copies would hold the decode loop's for a whole codec batch)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostStaging:
    """Host arrays to the GPU in one asynchronous copy, through pinned buffers kept for good (a
    ring of `depth`, each reused once the copy that last read it is done): a step's inputs
    without pinning memory per copy (a pinned block of the caching host allocator comes back
    only after its copy ran, so a busy GPU makes it allocate anew). The ring outlasts every copy
    one iteration of the engine queues (two a prefill group, one a step): those wait on the GPU
    behind the step in flight, and reusing one of them would wait for that whole step. On the
    CPU the arrays are used as they are. Arrays that do not fit go through `to_device`."""

    ALIGN = 16  # bytes: each array starts aligned, as Triton's kernels are specialised for

    def __init__(self, device: torch.device, nbytes: int, depth: int = 16):
        self.device, self.nbytes = device, nbytes
        self.cuda = device.type == "cuda"
        self.buffers = ([torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
                        if self.cuda else [])
        self.copied: list[torch.cuda.Event | None] = [None] * depth
        self.turn = 0

    def copy(self, *arrays: np.ndarray) -> list[Tensor]:
        """The arrays on the device (views of one buffer), in order; queued on the current stream."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.cuda:
            return [torch.from_numpy(a) for a in arrays]
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // self.ALIGN) * self.ALIGN
        if end > self.nbytes:
            return [to_device(torch.from_numpy(a), self.device) for a in arrays]
        device = torch.empty(end, dtype=torch.uint8, device=self.device)
        self.write(device, list(zip(offsets, arrays)))
        return [device[at : at + a.nbytes].view(torch.from_numpy(a).dtype).view(a.shape)
                for a, at in zip(arrays, offsets)]

    def write(self, target: Tensor, parts: list[tuple[int, np.ndarray]]) -> None:
        """Arrays into a byte buffer on the GPU (`target`, uint8), each at its byte offset, in
        one asynchronous copy queued on the current stream (CUDA only: `copy` serves the CPU)."""
        end = max(at + a.nbytes for at, a in parts)
        i, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # (a copy queued `depth` calls ago: a step or more since)
        host = self.buffers[i].numpy()
        for at, a in parts:
            host[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        target[:end].copy_(self.buffers[i][:end], non_blocking=True)
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()


class WaitClock:
    """Wall and CPU seconds one thread spent waiting (`with clock:` around a wait: for the GPU,
    or for work): the CPU is the driver or the lock spinning in the wait (a core kept busy), not
    the thread's own work."""

    def __init__(self):
        self.wall_s = self.cpu_s = 0.0
        self._began = (0.0, 0.0)

    def __enter__(self) -> "WaitClock":
        self._began = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s += time.perf_counter() - self._began[0]
        self.cpu_s += time.thread_time() - self._began[1]


class HostCopy:
    """A tensor copied to the host without waiting for it (CUDA, into pinned memory): the
    host reads frame i (the stop check) while frame i+1 is already queued on the GPU; and
    waiting for it (`get`) blocks no other thread's CUDA calls, as a pageable copy can
    (see `to_device`)."""

    def __init__(self, tensor: Tensor):
        if tensor.is_cuda:
            self.value = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.value.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.value, self.event = tensor.clone(), None

    def get(self, waits: WaitClock | None = None) -> Tensor:
        """The copy, once home; `waits` counts the wait for it."""
        if self.event is not None:
            with waits or contextlib.nullcontext():
                self.event.synchronize()
        return self.value


def frame_budget(prompt_length: int, max_seq_len: int, max_new_tokens: int) -> int:
    """How many frames may follow a prompt in a cache of `max_seq_len` slots."""
    if prompt_length + 1 >= max_seq_len:
        raise InputError(f"the prompt is {prompt_length} tokens; this model holds at most {max_seq_len - 2}")
    return min(max_new_tokens, max_seq_len - prompt_length)

"""The adapters' low-rank products for a batch whose rows each name an adapter slot: the
"shrink" v = x·A[slot]ᵀ and the "expand" v·B[slot]ᵀ of Punica and S-LoRA (their BGMV), as one
kernel a product (`lora_delta`), and for an embedding's lookup (`lora_lookup`), whose shrink
is a lookup in A's columns.

On CUDA with Triton they are kernels that read each row's slot's weights where they lie (no
gathered copy of them per row) and do nothing for rows of slot 0 (no adapter) but write
zeros; elsewhere, and as the tests' reference, the same arithmetic in torch. Both are custom
ops, so compiled layers and captured graphs call them as they are. The shrink sums in float32
(a rank's worth of numbers a row) and the expand rounds to the weights' dtype.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fish_sm.kernels import split_products

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

BLOCK_A = 8192  # the most elements of A (or B) a program holds at once (rank x inputs or outputs; here and in `row_products`)
LOOKUP_BLOCK = 256  # a lookup's outputs per program (its A is R numbers a row: nothing repeated)


def _kernels(x: Tensor) -> bool:
    return triton is not None and x.is_cuda


def shrink_reference(x: Tensor, a: Tensor, ids: Tensor, per_id: int) -> Tensor:
    """x [N, in], a [slots, R, in] -> v [N, R] float32: row n's x · a[ids[n // per_id]]ᵀ."""
    return torch.einsum("ni,nri->nr", x.float(), a[ids.repeat_interleave(per_id)].float())


def expand_reference(v: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int) -> Tensor:
    """v [N, parts·R] float32, b [slots, out, R] -> [N, out] in b's dtype: row n's v · b[slot]ᵀ,
    half k of the outputs from v's k-th R numbers."""
    n, (_, out, rank) = v.shape[0], b.shape
    w = b[ids.repeat_interleave(per_id)].float().view(n, parts, out // parts, rank)
    return torch.einsum("nkr,nkor->nko", v.view(n, parts, rank), w).reshape(n, out).to(b.dtype)


@torch.library.custom_op("fish_sm::lora_delta", mutates_args=())
def lora_delta(x: Tensor, a: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int) -> Tensor:
    """x [N, in], a [slots, parts·R, in], b [slots, out, R], ids [N / per_id] (row n uses slot
    ids[n // per_id]) -> [N, out] in b's dtype: row n's (x·a[slot]ᵀ)·b[slot]ᵀ, zeros for slot 0.
    With `parts` > 1 the outputs are that many stacked halves (w13: w1's, then w3's), half k
    from the k-th R rows of a."""
    if _kernels(x):
        return launch_delta(x, a, b, ids, per_id, parts)
    return expand_reference(shrink_reference(x, a, ids, per_id), b, ids, per_id, parts)


@lora_delta.register_fake
def _(x, a, b, ids, per_id, parts):
    return x.new_empty(x.shape[0], b.shape[1], dtype=b.dtype)


@torch.library.custom_op("fish_sm::lora_lookup", mutates_args=())
def lora_lookup(index: Tensor, a_t: Tensor, b: Tensor, ids: Tensor, per_id: int) -> Tensor:
    """index [N] (rows of an embedding), a_t [slots, num, R] (A transposed), b [slots, out, R],
    ids as `lora_delta`'s -> [N, out] in b's dtype: row n's b[slot] · a_t[slot, index[n]], zeros
    for slot 0 (the adapter's part of an embedding's lookup)."""
    if _kernels(index):
        return launch_lookup(index, a_t, b, ids, per_id)
    v = a_t[ids.repeat_interleave(per_id), index].float()
    return expand_reference(v, b, ids, per_id, 1)


@lora_lookup.register_fake
def _(index, a_t, b, ids, per_id):
    return b.new_empty(index.shape[0], b.shape[1])


def delta_config(per_part: int, rank: int) -> tuple[int, int]:
    """Outputs per program and warps for `_delta`: as many outputs of a half as BLOCK_A elements
    of B allow (each program repeats its row's shrink, all of the row's A from L2, so fewer,
    larger programs read less), 8 warps. Beside the product it is added to, fewer programs also
    leave the SMs to the product: at 32 rows, programs of 256 outputs made the delta alone up
    to 27% faster but cost the step 18% of its frames a second (benchmarks/lora_products.py,
    benchmarks/adapters.py)."""
    block_r = triton.next_power_of_2(rank)
    return min(triton.next_power_of_2(per_part), max(64, BLOCK_A // block_r)), 8


def launch_delta(x: Tensor, a: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int,
                 config: tuple[int, int] | None = None, out: Tensor | None = None) -> Tensor:
    """`lora_delta` as a kernel: a program a row, half and block of outputs (`config`:
    outputs per program and warps, else `delta_config`'s), into `out` if given."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, width = x.shape
    slots, outputs, rank = b.shape
    per_part = outputs // parts
    y = torch.empty(n, outputs, dtype=b.dtype, device=x.device) if out is None else out
    if n:
        block_r = triton.next_power_of_2(rank)
        block_i = min(triton.next_power_of_2(width), max(32, BLOCK_A // block_r))
        block_o, warps = config or delta_config(per_part, rank)
        grid = (n, parts, triton.cdiv(per_part, block_o))
        _delta[grid](x, x.stride(0), a.contiguous(), b.contiguous(), ids, y, per_id, outputs, per_part, rank, IN=width,
                     BLOCK_R=block_r, BLOCK_I=block_i, BLOCK_O=block_o, num_warps=warps)
    return y


def launch_lookup(index: Tensor, a_t: Tensor, b: Tensor, ids: Tensor, per_id: int) -> Tensor:
    """`lora_lookup` as a kernel: a program a row and block of outputs."""
    n = index.shape[0]
    slots, out, rank = b.shape
    y = torch.empty(n, out, dtype=b.dtype, device=index.device)
    if n:
        grid = (n, triton.cdiv(out, LOOKUP_BLOCK))
        _lookup[grid](index.contiguous(), a_t.contiguous(), b.contiguous(), ids, y, per_id, a_t.shape[1], out, rank,
                      BLOCK_O=LOOKUP_BLOCK, BLOCK_R=triton.next_power_of_2(rank))
    return y


def beside_usable(x: Tensor, w: Tensor) -> bool:
    """`product_and_delta` runs its two parts side by side on this input and weight: CUDA with
    Triton, a plain weight (torchao's INT8 weights keep their own product)."""
    return _kernels(x) and type(w) in (torch.nn.Parameter, Tensor)


_streams = threading.local()  # each thread's side stream by device: a thread's graphs fork onto its own


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:  # high priority, as the decode loop's own stream (the codec's kernels yield to both)
        streams[index] = torch.cuda.Stream(device, priority=-1)
    return streams[index]


@torch.library.custom_op("fish_sm::product_and_delta", mutates_args=())
def product_and_delta(x: Tensor, w: Tensor, a: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int,
                      res: Optional[Tensor] = None, counts: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """A product of x [B, ..., in] by w [out, in]ᵀ and the adapters' part of it, ([B, ..., out],
    [B, ..., out]): the product as the model makes it (`res` + the product through
    `split_products.split_product` when `res` is given, its tile counters `counts`), the part
    as `lora_delta` makes it, for row b by adapter slot ids[b], per_id rows of x a slot. On
    CUDA the part's kernel runs on a side stream beside the product (both read only x; a few
    rows' product leaves most of the GPU idle), joined before either is returned; inside a
    captured graph that is a branch of it. Elsewhere one after the other."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    side = _side_stream(x.device) if beside_usable(x, w) else None
    if side is None:
        delta = lora_delta(rows, a, b, ids, per_id, parts)
    else:  # every tensor the side stream touches is made on this one, before it forks
        delta = torch.empty(rows.shape[0], b.shape[1], dtype=b.dtype, device=x.device)
        a, b = a.contiguous(), b.contiguous()
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            launch_delta(rows, a, b, ids, per_id, parts, out=delta)
    y = F.linear(x, w) if res is None else split_products.split_product(x, w, res, counts)
    if side is not None:
        main.wait_stream(side)
    return y, delta.view(*x.shape[:-1], b.shape[1])


@product_and_delta.register_fake
def _(x, w, a, b, ids, per_id, parts, res=None, counts=None):
    shape = (*x.shape[:-1], w.shape[0])
    return x.new_empty(shape), x.new_empty(shape, dtype=b.dtype)


if triton is not None:

    @triton.jit
    def _delta(x_ptr, x_stride, a_ptr, b_ptr, ids_ptr, y_ptr, PER_ID, OUT, PER_PART, R, IN: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr):
        """BLOCK_O outputs of half k of row n: the row's R numbers of that half (its slot's R
        rows of A against x, BLOCK_I inputs at a time, the loads unrolled so that they overlap),
        then each output's R weights of B (loaded first) against them."""
        n = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1)
        o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        slot = tl.load(ids_ptr + n // PER_ID).to(tl.int64)
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        if slot != 0:
            r = tl.arange(0, BLOCK_R)
            v = tl.zeros([BLOCK_R], dtype=tl.float32)
            a_rows = a_ptr + (slot * tl.num_programs(1) * R + k * R + r[:, None]) * IN
            outs = k * PER_PART + o
            live = (o < PER_PART)[:, None] & (r < R)[None, :]
            w_b = tl.load(b_ptr + (slot * OUT + outs[:, None]) * R + r[None, :], mask=live, other=0.0)
            for i0 in tl.static_range(0, IN, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                xi = tl.load(x_ptr + n * x_stride + i, mask=i < IN, other=0.0).to(tl.float32)
                w = tl.load(a_rows + i[None, :], mask=(r < R)[:, None] & (i < IN)[None, :], other=0.0).to(tl.float32)
                v += tl.sum(w * xi[None, :], axis=1)
            acc = tl.sum(w_b.to(tl.float32) * v[None, :], axis=1)
        tl.store(y_ptr + n * OUT + k * PER_PART + o, acc.to(y_ptr.dtype.element_ty), mask=o < PER_PART)

    @triton.jit
    def _lookup(index_ptr, a_ptr, b_ptr, ids_ptr, y_ptr, PER_ID, NUM, OUT, R, BLOCK_O: tl.constexpr,
                BLOCK_R: tl.constexpr):
        """BLOCK_O outputs of row n: each output's R weights of its slot against the R numbers
        of A's column for the row's index."""
        n = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        slot = tl.load(ids_ptr + n // PER_ID).to(tl.int64)
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        if slot != 0:
            acc = lookup_part(a_ptr, b_ptr, slot, tl.load(index_ptr + n).to(tl.int64), NUM, OUT, R, o, BLOCK_R)
        tl.store(y_ptr + n * OUT + o, acc.to(y_ptr.dtype.element_ty), mask=o < OUT)

    @triton.jit
    def lookup_part(a_ptr, b_ptr, slot, index, NUM, OUT, R, o, BLOCK_R: tl.constexpr):
        """Outputs `o` of the adapter in `slot`'s part of an embedding's row `index`, in float32:
        each output's R weights of B against the R numbers of A's column for the index (also the
        sampling kernels', which add it to the row they look up)."""
        r = tl.arange(0, BLOCK_R)
        v = tl.load(a_ptr + (slot * NUM + index) * R + r, mask=r < R, other=0.0).to(tl.float32)
        live = (o < OUT)[:, None] & (r < R)[None, :]
        w = tl.load(b_ptr + (slot * OUT + o[:, None]) * R + r[None, :], mask=live, other=0.0).to(tl.float32)
        return tl.sum(w * v[None, :], axis=1)

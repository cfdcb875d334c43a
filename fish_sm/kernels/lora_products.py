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

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

BLOCK_A = 8192  # the most elements of A a program loads at once (rank x inputs; here and in `row_products`)
BLOCK_OUT = 256  # the expand's outputs per program (each program repeats its row's shrink)


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


def launch_delta(x: Tensor, a: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int) -> Tensor:
    """`lora_delta` as a kernel: a program a row, half and block of outputs."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, width = x.shape
    slots, out, rank = b.shape
    per_part = out // parts
    y = torch.empty(n, out, dtype=b.dtype, device=x.device)
    if n:
        block_r = triton.next_power_of_2(rank)
        block_i = min(triton.next_power_of_2(width), max(32, BLOCK_A // block_r))
        grid = (n, parts, triton.cdiv(per_part, BLOCK_OUT))
        _delta[grid](x, x.stride(0), a.contiguous(), b.contiguous(), ids, y, per_id, out, per_part, rank, IN=width,
                     BLOCK_R=block_r, BLOCK_I=block_i, BLOCK_O=BLOCK_OUT)
    return y


def launch_lookup(index: Tensor, a_t: Tensor, b: Tensor, ids: Tensor, per_id: int) -> Tensor:
    """`lora_lookup` as a kernel: a program a row and block of outputs."""
    n = index.shape[0]
    slots, out, rank = b.shape
    y = torch.empty(n, out, dtype=b.dtype, device=index.device)
    if n:
        grid = (n, triton.cdiv(out, BLOCK_OUT))
        _lookup[grid](index.contiguous(), a_t.contiguous(), b.contiguous(), ids, y, per_id, a_t.shape[1], out, rank,
                      BLOCK_O=BLOCK_OUT, BLOCK_R=triton.next_power_of_2(rank))
    return y


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
            r = tl.arange(0, BLOCK_R)
            index = tl.load(index_ptr + n).to(tl.int64)
            v = tl.load(a_ptr + (slot * NUM + index) * R + r, mask=r < R, other=0.0).to(tl.float32)
            live = (o < OUT)[:, None] & (r < R)[None, :]
            w = tl.load(b_ptr + (slot * OUT + o[:, None]) * R + r[None, :], mask=live, other=0.0).to(tl.float32)
            acc = tl.sum(w * v[None, :], axis=1)
        tl.store(y_ptr + n * OUT + o, acc.to(y_ptr.dtype.element_ty), mask=o < OUT)

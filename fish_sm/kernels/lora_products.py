"""The adapters' low-rank products for a batch whose rows each name an adapter slot: the
"shrink" v = x·A[slot]ᵀ and the "expand" v·B[slot]ᵀ of Punica and S-LoRA (their BGMV).

On CUDA with Triton they are kernels that read each row's slot's weights where they lie (no
gathered copy of them per row) and do nothing for rows of slot 0 (no adapter) but write
zeros; elsewhere, and as the tests' reference, the same arithmetic in torch. Both are custom
ops, so compiled layers and captured graphs call them as they are. The shrink keeps float32
(its sums are a rank's worth of numbers a row); the expand rounds to the weights' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

BLOCK_IN = 128  # the shrink's inputs per load
BLOCK_OUT = 128  # the expand's outputs per program


def _kernels(x: Tensor) -> bool:
    return triton is not None and x.is_cuda


@torch.library.custom_op("fish_sm::lora_shrink", mutates_args=())
def lora_shrink(x: Tensor, a: Tensor, ids: Tensor, per_id: int) -> Tensor:
    """x [N, in], a [slots, R, in], ids [N / per_id] (row n uses slot ids[n // per_id]) ->
    v [N, R] float32: row n's x · a[slot]ᵀ, zeros for slot 0."""
    if _kernels(x):
        return launch_shrink(x, a, ids, per_id)
    return torch.einsum("ni,nri->nr", x.float(), a[ids.repeat_interleave(per_id)].float())


@lora_shrink.register_fake
def _(x, a, ids, per_id):
    return x.new_empty(x.shape[0], a.shape[1], dtype=torch.float32)


@torch.library.custom_op("fish_sm::lora_expand", mutates_args=())
def lora_expand(v: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int) -> Tensor:
    """v [N, parts·R] (float32), b [slots, out, R], ids as `lora_shrink`'s -> [N, out] in b's
    dtype: row n's v · b[slot]ᵀ, zeros for slot 0. With `parts` > 1 the outputs are that many
    stacked halves (w13: w1's, then w3's), half k taking v's k-th R numbers."""
    if _kernels(v):
        return launch_expand(v, b, ids, per_id, parts)
    n, (slots, out, rank) = v.shape[0], b.shape
    w = b[ids.repeat_interleave(per_id)].float().view(n, parts, out // parts, rank)
    return torch.einsum("nkr,nkor->nko", v.view(n, parts, rank), w).reshape(n, out).to(b.dtype)


@lora_expand.register_fake
def _(v, b, ids, per_id, parts):
    return v.new_empty(v.shape[0], b.shape[1], dtype=b.dtype)


def launch_shrink(x: Tensor, a: Tensor, ids: Tensor, per_id: int) -> Tensor:
    """`lora_shrink` as a kernel: a program a row."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, width = x.shape
    rank = a.shape[1]
    v = torch.empty(n, rank, dtype=torch.float32, device=x.device)
    if n:
        _shrink[(n,)](x, x.stride(0), a.contiguous(), ids, v, per_id, width, rank,
                      BLOCK_R=triton.next_power_of_2(rank), BLOCK_I=BLOCK_IN)
    return v


def launch_expand(v: Tensor, b: Tensor, ids: Tensor, per_id: int, parts: int) -> Tensor:
    """`lora_expand` as a kernel: a program a row and block of outputs."""
    n = v.shape[0]
    slots, out, rank = b.shape
    y = torch.empty(n, out, dtype=b.dtype, device=v.device)
    if n:
        grid = (n, triton.cdiv(out, BLOCK_OUT))
        _expand[grid](v.contiguous(), b.contiguous(), ids, y, per_id, out, out // parts, rank, parts * rank,
                      BLOCK_O=BLOCK_OUT, BLOCK_R=triton.next_power_of_2(rank))
    return y


if triton is not None:

    @triton.jit
    def _shrink(x_ptr, x_stride, a_ptr, ids_ptr, v_ptr, PER_ID, IN, R, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
        """Row n of v: its slot's R rows of A against the row's x, BLOCK_I inputs at a time."""
        n = tl.program_id(0).to(tl.int64)
        slot = tl.load(ids_ptr + n // PER_ID).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        if slot != 0:
            for i0 in range(0, IN, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                xi = tl.load(x_ptr + n * x_stride + i, mask=i < IN, other=0.0).to(tl.float32)
                w = tl.load(a_ptr + slot * R * IN + r[:, None] * IN + i[None, :],
                            mask=(r < R)[:, None] & (i < IN)[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * xi[None, :], axis=1)
        tl.store(v_ptr + n * R + r, acc, mask=r < R)

    @triton.jit
    def _expand(v_ptr, b_ptr, ids_ptr, y_ptr, PER_ID, OUT, PER_PART, R, VR, BLOCK_O: tl.constexpr,
                BLOCK_R: tl.constexpr):
        """BLOCK_O outputs of row n: each output's R weights of its slot against the R numbers
        of v its half reads."""
        n = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        slot = tl.load(ids_ptr + n // PER_ID).to(tl.int64)
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        if slot != 0:
            r = tl.arange(0, BLOCK_R)
            live = (o < OUT)[:, None] & (r < R)[None, :]
            w = tl.load(b_ptr + slot * OUT * R + o[:, None] * R + r[None, :], mask=live, other=0.0).to(tl.float32)
            vr = tl.load(v_ptr + n * VR + (o // PER_PART)[:, None] * R + r[None, :], mask=live, other=0.0)
            acc = tl.sum(w * vr, axis=1)
        tl.store(y_ptr + n * OUT + o, acc.to(y_ptr.dtype.element_ty), mask=o < OUT)

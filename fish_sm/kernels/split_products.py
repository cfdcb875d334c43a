"""The narrow products of a decode step of several rows (wo and w2: 1,024 outputs from
1,024-3,072 inputs) with the residual add after them, as one Triton kernel split over K.

With only 1,024 outputs there are few tiles to spread over the GPU: cuBLAS either leaves most
SMs idle or splits over K and reduces in a second kernel. Here the split's partial sums go to
a workspace and the last program of each tile to finish adds them up, rounds the product to
bf16 as the model does, adds the residual and writes the output. An atomic counter per tile
says which program is last; that program sets it back to 0, so the kernel leaves no state
behind (graph replays and later calls find it zeroed).

At many rows there are tiles enough for cuBLAS, whose wider tiles read each row's inputs fewer
times: beyond `MOST_SPLIT_ROWS` rows, as on CPUs, without Triton and for shapes the split does
not divide, `split_product` runs the model's own arithmetic in torch: `res + F.linear(x, w)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

# Output columns per tile, inputs per block, the split over K, pipeline stages and warps: the
# best of a sweep at 32 and 64 rows on an H100 for all three shapes (slow wo 1,024 x 2,048, w2
# 1,024 x 3,072, fast wo 1,024 x 1,024), within 5% of each shape's own best.
BLOCK_N, BLOCK_K, SPLIT, STAGES, WARPS = 32, 64, 4, 5, 4
MOST_ROWS = 128  # rows per tile (more rows: more tiles)
COUNTERS = 256  # tiles a call may have (1,024 outputs / 32 columns = 32 per 128 rows)
# The most rows the kernel takes: from 96 rows cuBLAS's product and an add are faster at all
# three shapes, at 64 the kernel still is at two (benchmarks/step_kernels.py on an H200).
MOST_SPLIT_ROWS = 64


def readable(linear: torch.nn.Linear) -> bool:
    """The kernel can read this projection: a plain weight (bf16 on CUDA), no bias."""
    return linear.bias is None and type(linear.weight) in (torch.nn.Parameter, Tensor)


def _splits(x: Tensor, w: Tensor, split: int = SPLIT, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
            most_rows: int = MOST_ROWS, counters: int = COUNTERS, most_split_rows: int = MOST_SPLIT_ROWS) -> bool:
    n, k = w.shape
    rows = x.numel() // k
    return (triton is not None and x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and k % (split * block_k) == 0
            and rows <= most_split_rows and triton.cdiv(rows, most_rows) * triton.cdiv(n, block_n) <= counters)


# The counters are back at zero when the kernel returns: to the compiler it mutates nothing.
@torch.library.custom_op("fish_sm::split_product", mutates_args=())
def split_product(x: Tensor, w: Tensor, res: Tensor, counts: Tensor) -> Tensor:
    """res + x @ w.T, with x [..., K], w [N, K], res [..., N]; the product rounded to x's
    dtype before the add, as `res + F.linear(x, w)` rounds it."""
    if _splits(x, w):
        return _launch(x, w, res, counts)
    return res + F.linear(x, w)


@split_product.register_fake
def _(x, w, res, counts):
    return res.new_empty(res.shape)


def _launch(x: Tensor, w: Tensor, res: Tensor, counts: Tensor, split: int = SPLIT, block_n: int = BLOCK_N,
            block_k: int = BLOCK_K, stages: int = STAGES, warps: int = WARPS, most_rows: int = MOST_ROWS) -> Tensor:
    n, k = w.shape
    flat, base = x.reshape(-1, k), res.reshape(-1, n)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    base = base if base.stride(-1) == 1 else base.contiguous()
    rows = flat.shape[0]
    block_m = min(most_rows, max(16, triton.next_power_of_2(rows)))
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(rows, block_m))
    _split_product[grid](flat, flat.stride(0), w, base, base.stride(0), out, partial, counts, rows, n, k,
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                         num_stages=stages, num_warps=warps)
    return out.view(res.shape)


if triton is not None:

    @triton.jit
    def _split_product(x_ptr, x_stride, w_ptr, res_ptr, res_stride, out_ptr, part_ptr, count_ptr, M, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        """Tile (rows, columns) of the product over this program's K / SPLIT inputs into the
        workspace; the tile's last program to finish adds the SPLIT partial sums, rounds, adds
        the residual and writes the tile."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        per = K // SPLIT
        start = tl.program_id(1) * per
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(start, start + per, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + m[:, None] * x_stride + ks[None, :], mask=(m < M)[:, None], other=0.0)
            b = tl.load(w_ptr + n[None, :] * K + ks[:, None], mask=(n < N)[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        live = (m < M)[:, None] & (n < N)[None, :]
        spot = m[:, None] * N + n[None, :]
        tl.store(part_ptr + tl.program_id(1) * M * N + spot, acc, mask=live)
        tl.debug_barrier()  # every thread's partial sums written before the count (released by it)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last: the others' sums are visible (acquired by the count)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # from L2, past this SM's L1
                total += tl.load(part_ptr + s * M * N + spot, mask=live, other=0.0, cache_modifier=".cg")
            y = total.to(tl.bfloat16).to(tl.float32)
            r = tl.load(res_ptr + m[:, None] * res_stride + n[None, :], mask=live, other=0.0).to(tl.float32)
            tl.store(out_ptr + spot, (y + r).to(tl.bfloat16), mask=live)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call

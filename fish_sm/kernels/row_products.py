"""The products of a decode step of one row as matrix-vector kernels of our own, one per
product with the work around it fused in: the RMSNorm before wqkv and w13 (each program
recomputes the row's statistics instead of a kernel of its own), the SwiGLU before w2, the
residual add after wo and w2, and a LoRA adapter's low-rank part (each program sums the row's R
numbers of A beside its own products, from the same input blocks, then takes its rows' share of
B against them: A is small and stays in cache); over bf16 weights, or int8 ones with a scale
per output row (torchao's weight-only INT8 data, read as it is, turned into floats through the
mantissa).

Inductor would make a statistics kernel for every norm and read int8 weights no faster than
bf16 ones, where at one row a kernel's fixed costs are as large as its memory time. Each
kernel reads its first block of weights and its constants (scales, norm weights) before
waiting on the kernel before it (programmatic dependent launch), since nothing before it
writes them; it may also stream a later product's weights into L2 (`ahead`).

CUDA with Triton only; elsewhere (and as the tests' reference) `row_product` runs the same
arithmetic in torch, rounding where the kernel rounds, which is where the model rounds.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fish_sm.kernels import lora_products
from fish_sm.kernels.launch import dependent_launch
from fish_sm.model.layers import swiglu

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

PLAIN, NORM, SWIGLU = 0, 1, 2  # what a product does to its input first


def usable(x: Tensor) -> bool:
    """The kernels can run on this activation's device and dtype."""
    return (triton is not None and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


# Launch configs (rows per program, inputs per block, warps) for S1-mini's products, by
# (N, K, int8): the fastest in whole frames on an H100 (benchmarks/row_products.py
# sweeps them). Other shapes take the default, within ~25% of the best at each of these.
LAUNCH_CONFIGS = MappingProxyType({
    (4096, 1024, False): (16, 1024, 4), (1024, 2048, False): (2, 1024, 4), (6144, 1024, False): (4, 512, 4),
    (1024, 3072, False): (8, 2048, 8), (2048, 1024, False): (8, 1024, 2), (1024, 1024, False): (8, 1024, 4),
    (4096, 1024, True): (16, 1024, 4), (1024, 2048, True): (2, 2048, 4), (6144, 1024, True): (4, 1024, 4),
    (1024, 3072, True): (4, 1024, 8), (2048, 1024, True): (16, 1024, 4), (1024, 1024, True): (4, 1024, 4),
})


# With an adapter's part (bf16 weights, by (N, K)): each program repeats the shrink over all of
# A, so larger programs than without one are fastest (rank 8 on an H100,
# `benchmarks/row_products.py --lora 8`); INT8 weights keep LAUNCH_CONFIGS.
ADAPTER_CONFIGS = MappingProxyType({
    (4096, 1024): (16, 1024, 4), (1024, 2048): (8, 1024, 8), (6144, 1024): (16, 512, 4),
    (1024, 3072): (4, 1024, 8), (2048, 1024): (16, 1024, 4), (1024, 1024): (8, 1024, 8),
})


def launch_config(n: int, k: int, int8: bool, lora: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """Rows per program, inputs per block, warps for an [N, K] product; `lora` (rank, halves):
    with an adapter's part (a program's rows in one half, A's block of rows in registers)."""
    if lora is None:
        return LAUNCH_CONFIGS.get((n, k, int8), (4, min(_power_of_2(k), 1024), 4))
    adapted = None if int8 else ADAPTER_CONFIGS.get((n, k))
    return with_adapter(adapted or launch_config(n, k, int8), n, *lora)


def with_adapter(config: tuple[int, int, int], n: int, rank: int, parts: int) -> tuple[int, int, int]:
    """A launch config as the kernel takes it with an adapter's part of `rank` over `parts`
    halves of the N outputs: a program's rows in one half, A's block of rows in registers."""
    block_n, block_k, warps = config
    block_r = _power_of_2(rank)
    return math.gcd(block_n, n // parts), min(block_k, max(32, lora_products.BLOCK_A // block_r)), warps


def _power_of_2(n: int) -> int:
    """The smallest power of 2 at least n (Triton's `next_power_of_2`, which the CPU lacks)."""
    return 1 << max(n - 1, 0).bit_length()


def product_weights(linear: torch.nn.Linear) -> tuple[Tensor, Optional[Tensor]]:
    """A projection's weight as the kernels read it: bf16 [N, K], or (torchao's weight-only
    INT8) its int8 data [N, K] and its scale per row [N] in float32."""
    w = linear.weight
    if type(w) in (torch.nn.Parameter, Tensor):
        return w.detach(), None
    return w.qdata, w.scale.reshape(-1).float().contiguous()


def readable(linear: torch.nn.Linear) -> bool:
    """The kernels can read this projection: no bias; bf16, or torchao's INT8 with a scale per row."""
    w = linear.weight
    if linear.bias is not None:
        return False
    if type(w) in (torch.nn.Parameter, Tensor):
        return True
    data, scale = getattr(w, "qdata", None), getattr(w, "scale", None)
    return (data is not None and scale is not None and data.dtype == torch.int8 and data.shape == w.shape
            and scale.numel() == w.shape[0])


@torch.library.custom_op("fish_sm::row_product", mutates_args=())
def row_product(x: Tensor, w: Tensor, scale: Optional[Tensor], norm: Optional[Tensor], res: Optional[Tensor],
                prologue: int, eps: float, ahead: Optional[Tensor] = None, lora_a: Optional[Tensor] = None,
                lora_b: Optional[Tensor] = None, lora_ids: Optional[Tensor] = None, parts: int = 1) -> Tensor:
    """x [..., K] (one row; [..., 2K] for SwiGLU: gate then up) times w [N, K]ᵀ, times `scale`
    [N] if int8: [..., N]. `prologue` NORM: RMSNorm(x) * `norm` first; SWIGLU: silu(gate) * up
    first. Plus `res` [..., N] if given. `ahead`: weights the kernel streams into L2 for a
    later product (a hint: on Hopper and later, where they can be taken in even shares).
    With `lora_a` [slots, parts·R, K], `lora_b` [slots, N, R] and `lora_ids` (the row's adapter
    slot first), plus the adapter's part of the same input, as `lora_products.lora_delta` gives
    it, added last; nothing for slot 0."""
    if usable(x):
        return _launch(x, w, scale, norm, res, prologue, eps, ahead, lora_a, lora_b, lora_ids, parts)
    return reference(x, w, scale, norm, res, prologue, eps, lora_a, lora_b, lora_ids, parts)


@row_product.register_fake
def _(x, w, scale, norm, res, prologue, eps, ahead=None, lora_a=None, lora_b=None, lora_ids=None, parts=1):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def reference(x: Tensor, w: Tensor, scale: Optional[Tensor], norm: Optional[Tensor], res: Optional[Tensor],
              prologue: int, eps: float, lora_a: Optional[Tensor] = None, lora_b: Optional[Tensor] = None,
              lora_ids: Optional[Tensor] = None, parts: int = 1) -> Tensor:
    """The kernel's arithmetic in torch: the model's for the same weights (RMSNorm's statistics
    in float32, products rounded to the activations' dtype), and the adapters' as theirs."""
    if prologue == NORM:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * norm
    elif prologue == SWIGLU:
        x = swiglu(x)
    if scale is None:
        y = F.linear(x, w)
    else:
        y = (F.linear(x.float(), w.float()) * scale).to(x.dtype)
    y = y if res is None else res + y
    if lora_a is None:
        return y
    rows = x.reshape(-1, x.shape[-1])
    ids = lora_ids[:1]
    v = lora_products.shrink_reference(rows, lora_a, ids, rows.shape[0])
    return y + lora_products.expand_reference(v, lora_b, ids, rows.shape[0], parts).view(y.shape)


def _launch(x, w, scale, norm, res, prologue, eps, ahead=None, lora_a=None, lora_b=None, lora_ids=None, parts=1,
            config: tuple[int, int, int] | None = None):
    """The kernel, with `launch_config`'s config unless `config` is given (benchmarks sweep them)."""
    n, k = w.shape
    flat = x.reshape(-1)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    lora = lora_a is not None
    rank = lora_b.shape[-1] if lora else 1
    block_r = triton.next_power_of_2(rank)
    block_n, block_k, warps = config or launch_config(n, k, scale is not None, lora=(rank, parts) if lora else None)
    programs = triton.cdiv(n, block_n)
    pdl, options = dependent_launch(x.device)
    bulk = ahead is not None and _bulk_prefetchable(ahead, programs)
    _product[(programs,)](
        flat, norm if norm is not None else flat, w, scale if scale is not None else flat,
        res.reshape(-1) if res is not None else flat, out, n, eps,
        ahead if bulk else flat, ahead.nbytes if bulk else 0,
        lora_a.contiguous() if lora else flat, lora_b.contiguous() if lora else flat, lora_ids if lora else flat,
        n // parts, rank, PREFETCH=bulk, K=k, PROLOGUE=prologue, SCALED=scale is not None,
        RESIDUAL=res is not None, LORA=lora, BLOCK_R=block_r,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=warps, **options)
    return out.view(*x.shape[:-1], n)


def _bulk_prefetchable(t: Tensor, programs: int) -> bool:
    """Hopper's bulk prefetch can take `t` in `programs` shares: 16-byte aligned, a multiple
    of 16 bytes, at least 16 a share."""
    return (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9 and t.data_ptr() % 16 == 0
            and t.nbytes % 16 == 0 and t.nbytes >= 16 * programs)


if triton is not None:

    @triton.jit
    def _activation(x_ptr, nw, ks, live, inv, K: tl.constexpr, PROLOGUE: tl.constexpr):
        """A block of the product's input, in float32, rounded as the model rounds it (`nw`: the
        block's RMSNorm weights, for PROLOGUE 1)."""
        if PROLOGUE == 1:  # RMSNorm: normalised, rounded, times the norm's weight, rounded
            a = (tl.load(x_ptr + ks, mask=live, other=0.0).to(tl.float32) * inv).to(tl.bfloat16)
            a = (a.to(tl.float32) * nw.to(tl.float32)).to(tl.bfloat16)
        elif PROLOGUE == 2:  # SwiGLU: silu(gate) rounded, times up, rounded
            g = tl.load(x_ptr + ks, mask=live, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16)
            a = (a.to(tl.float32) * tl.load(x_ptr + K + ks, mask=live, other=0.0).to(tl.float32)).to(tl.bfloat16)
        else:
            a = tl.load(x_ptr + ks, mask=live, other=0.0)
        return a.to(tl.float32)

    @triton.jit
    def _as_float(w, INT8: tl.constexpr):
        """Weights in float32; int8 ones four at a time as 2^23 + 128 + w (w's byte plus 128 as
        the low bits of 2^23's mantissa: a xor, a byte permute) less 2^23 + 128 (a float add),
        exact for every int8: Hopper issues the int-to-float conversion at 1/16 of the FMA rate."""
        if INT8:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; xor.b32 t, $4, 0x80808080; "
                "prmt.b32 $0, t, 0x4B000000, 0x7650; prmt.b32 $1, t, 0x4B000000, 0x7651; "
                "prmt.b32 $2, t, 0x4B000000, 0x7652; prmt.b32 $3, t, 0x4B000000, 0x7653; "
                "sub.f32 $0, $0, 0f4B000080; sub.f32 $1, $1, 0f4B000080; "
                "sub.f32 $2, $2, 0f4B000080; sub.f32 $3, $3, 0f4B000080; }",
                "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)
        return w.to(tl.float32)

    @triton.jit
    def _prefetch_share(base, nbytes):
        """This program's share of the `nbytes` at `base` (16-byte aligned) into L2: one bulk
        prefetch (Hopper's copy engine) from one thread."""
        pid, programs = tl.program_id(0), tl.num_programs(0)
        share = nbytes // programs // 16 * 16
        start = pid * share
        size = tl.where(pid == programs - 1, nbytes - start, share)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base.to(tl.pointer_type(tl.int8)).to(tl.int64) + start, size.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _product(x_ptr, norm_ptr, w_ptr, scale_ptr, res_ptr, out_ptr, N, eps, ahead_ptr, ahead_bytes,
                 la_ptr, lb_ptr, ids_ptr, PER_PART, R, PREFETCH: tl.constexpr, K: tl.constexpr,
                 PROLOGUE: tl.constexpr, SCALED: tl.constexpr, RESIDUAL: tl.constexpr, LORA: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """BLOCK_N output rows: out[n] = sum_k a[k] w[n, k] (* scale[n]) (+ res[n]) (+ the
        adapter's sum_r B[n, r] sum_k A[r, k] a[k], of the slot ids[0], over the R rows of A
        of n's half). With PREFETCH, first a share of the `ahead_bytes` at `ahead_ptr` (the next
        product's weights) into L2."""
        if PREFETCH:
            _prefetch_share(ahead_ptr, ahead_bytes)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_live = rows < N
        first = tl.arange(0, BLOCK_K)
        # Weights and constants first: nothing before this kernel writes them, so they load while it drains.
        w = tl.load(w_ptr + rows[:, None] * K + first[None, :], mask=rows_live[:, None] & (first < K)[None, :],
                    other=0)
        scale, nw = 1.0, 0.0  # the rows' int8 scales; the first block's RMSNorm weights
        if SCALED:
            scale = tl.load(scale_ptr + rows, mask=rows_live, other=0.0)
        if PROLOGUE == 1:
            nw = tl.load(norm_ptr + first, mask=first < K, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()  # the kernel before has finished and its writes are visible
            tl.extra.cuda.gdc_launch_dependents()
        r = tl.arange(0, BLOCK_R)
        lora_v = tl.zeros([BLOCK_R], dtype=tl.float32)
        if LORA:  # the slot, and the rows' share of B, before the products (which A's rows join)
            slot = tl.load(ids_ptr).to(tl.int64)
            r_live = (r < R) & (slot != 0)
            a_rows = la_ptr + (slot * (N // PER_PART) * R + tl.program_id(0) * BLOCK_N // PER_PART * R + r) * K
            lb = tl.load(lb_ptr + (slot * N + rows[:, None]) * R + r[None, :],
                         mask=rows_live[:, None] & r_live[None, :], other=0.0)
        inv = 0.0
        if PROLOGUE == 1:
            sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                ks = k0 + first
                v = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                sq += v * v
            inv = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            ks = k0 + first
            live = ks < K
            if k0 > 0:
                w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=rows_live[:, None] & live[None, :], other=0)
                if PROLOGUE == 1:
                    nw = tl.load(norm_ptr + ks, mask=live, other=0.0)
            if LORA:
                la = tl.load(a_rows[:, None] + ks[None, :], mask=r_live[:, None] & live[None, :], other=0.0)
            a = _activation(x_ptr, nw, ks, live, inv, K, PROLOGUE)
            acc += _as_float(w, SCALED) * a[None, :]
            if LORA:
                lora_v += tl.sum(la.to(tl.float32) * a[None, :], 1)
        y = tl.sum(acc, 1)
        if SCALED:
            y = y * scale
        y = y.to(tl.bfloat16)
        if RESIDUAL:
            y = (y.to(tl.float32) + tl.load(res_ptr + rows, mask=rows_live, other=0.0).to(tl.float32)).to(tl.bfloat16)
        if LORA:  # rounded as `lora_delta` rounds, then added as the model adds it
            delta = tl.sum(lb.to(tl.float32) * lora_v[None, :], 1).to(tl.bfloat16)
            y = (y.to(tl.float32) + delta.to(tl.float32)).to(tl.bfloat16)
        tl.store(out_ptr + rows, y, mask=rows_live)

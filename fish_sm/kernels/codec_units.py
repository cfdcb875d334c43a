"""The codec decoder's residual units (Snake, dilated k=7 conv, Snake, 1x1 conv, plus the
input) as one kernel each over a streamed piece: `FusedUnits` takes the place of a run of
`ResidualUnit`s in the streaming back (`fuse_residual_units`), for the narrow units that
dominate the back's memory traffic (96 and 192 channels at 44.1 and 22 kHz).

Compiled, a unit is four passes over its activations (Snake with the carried context
concatenated, cuDNN's conv, Snake, the 1x1 GEMM with the residual), each reading and writing
the whole piece. The kernel is an implicit GEMM over channels-last time rows: a program takes
`BLOCK_T` rows of one piece, sums the seven taps of the first conv's input (already through
Snake, its carried context in front) on tensor cores, applies bias and the second Snake to
the accumulator, multiplies that by the 1x1 conv's weight in the same program and stores it
plus bias plus the input; and where another unit follows, that sum through the next unit's
Snake too, behind the next unit's carried context: that unit's input as its kernel reads it.
A unit reads its piece twice (conv input, residual) and writes it twice.

The carried context of each unit's conv is its input after Snake, as the layers carry it.
Sums are in float32 and each product's inputs rounded to the weights' dtype, where the
compiled layers round. CUDA with Triton; elsewhere (and as the tests' reference) the op runs
the same arithmetic in torch.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fish_sm.model.codec.layers import ResidualUnit, State

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

TAPS = 7
WIDEST = 256  # the widest unit fused: a program's accumulators (time rows x channels) in registers

# Launch configs (time rows per program, input channels per load, output channels per 1x1
# block, warps, stages) by channels: `benchmarks/codec_units.py` sweeps them.
LAUNCH_CONFIGS = MappingProxyType({96: (128, 32, 32, 8, 3), 192: (64, 64, 64, 8, 3)})


def usable(x: Tensor) -> bool:
    """The kernel can run on this activation's device and dtype."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def fusable(unit: ResidualUnit, widest: int = WIDEST) -> bool:
    """A unit the kernel takes: at most `widest` channels, a multiple of 16 (tensor cores' K)."""
    c = unit.block[1].conv.weight.shape[0]
    return c <= widest and c % 16 == 0


def launch_config(channels: int) -> tuple[int, int, int, int, int]:
    t, k, n, warps, stages = LAUNCH_CONFIGS.get(channels, (64 if channels > 128 else 128, 32, 32, 8, 3))
    return t, _divisor(channels, k), _divisor(channels, n), warps, stages


def _divisor(channels: int, block: int) -> int:
    """The largest power of two up to `block` that divides `channels` (at least 16)."""
    while block > 16 and channels % block:
        block //= 2
    return block


def snake(x: Tensor, alpha: Tensor) -> Tensor:
    """`Snake1d`'s arithmetic, alpha [C] over channel dim 1 of [B, C, ...] (same op order)."""
    alpha = alpha.view(-1, *[1] * (x.dim() - 2))
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def _empty(x: Tensor, length: int) -> Tensor:
    """A tensor of x's rows, channels, dtype and layout over `length` time steps."""
    if x.dim() == 4:
        return x.new_empty(x.shape[0], x.shape[1], 1, length).contiguous(memory_format=torch.channels_last)
    return x.new_empty(x.shape[0], x.shape[1], length)


def unit_reference(s: Tensor, x: Tensor, w7: Tensor, b7: Tensor, alpha2: Tensor, w1: Tensor, b1: Tensor, dilation: int,
                   next_alpha: Optional[Tensor] = None, next_context: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """`residual_unit` in torch, over [B, C, T] or [B, C, 1, T]."""
    c, flat = x.shape[1], x.dim() == 4
    if flat:
        s, x = s[:, :, 0], x[:, :, 0]
    y = F.conv1d(s, w7[:, :, :c].permute(2, 1, 0).to(x.dtype), b7[:c].to(x.dtype), dilation=dilation)
    y = snake(y, alpha2[:c].to(x.dtype))
    h = x + F.conv1d(y, w1[:c, :c].t()[:, :, None].to(x.dtype), b1[:c].to(x.dtype))
    if flat:
        h = h[:, :, None]
    if next_alpha is None:
        return h, h.new_empty(0)
    return h, torch.cat([next_context, snake(h, next_alpha[:c].to(h.dtype))], dim=-1)


@torch.library.custom_op("fish_sm::residual_unit", mutates_args=())
def residual_unit(s: Tensor, x: Tensor, w7: Tensor, b7: Tensor, alpha2: Tensor, w1: Tensor, b1: Tensor, dilation: int,
                  next_alpha: Optional[Tensor] = None, next_context: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """One unit over a piece x [B, C, T] or [B, C, 1, T], from its conv's input s (Snake(x)
    behind the 6·dilation carried inputs, L + T steps) -> (h = x + conv1x1(Snake(conv7(s))),
    the next unit's input: Snake(h) by `next_alpha` behind `next_context`, or empty without
    one), x's layout. Weights as `pack` makes them: w7 [7, C, P] (tap, input, output), w1
    [P, P] (input, output), biases and alphas [P] float32, P the channels rounded up to a power
    of two (zeros beyond C)."""
    if usable(x):
        return launch(s, x, w7, b7, alpha2, w1, b1, dilation, next_alpha, next_context)
    return unit_reference(s, x, w7, b7, alpha2, w1, b1, dilation, next_alpha, next_context)


@residual_unit.register_fake
def _(s, x, w7, b7, alpha2, w1, b1, dilation, next_alpha=None, next_context=None):
    following = x.new_empty(0) if next_alpha is None else _empty(x, next_context.shape[-1] + x.shape[-1])
    return torch.empty_like(x), following


def pack(unit: ResidualUnit, dtype: torch.dtype) -> dict[str, Tensor]:
    """A unit's weights as the kernel reads them (see `residual_unit`), and its first Snake's
    alpha as the unit before it applies it (`alpha1`, [P] float32)."""
    snake1, conv7, snake2, conv1 = unit.block
    c = conv7.conv.weight.shape[0]
    p = max(16, 1 << (c - 1).bit_length())
    w = conv7.conv.weight.detach()
    like = w.new_zeros

    def padded(v: Tensor, fill: float = 0.0) -> Tensor:
        out = like(p, dtype=torch.float32).fill_(fill)
        out[:c] = v.detach().flatten().float()
        return out

    w7 = like(TAPS, c, p, dtype=dtype)
    w7[:, :, :c] = w.permute(2, 1, 0).to(dtype)  # [tap, input, output]
    w1 = like(p, p, dtype=dtype)
    w1[:c, :c] = conv1.conv.weight.detach()[:, :, 0].t().to(dtype)
    # Alphas of 1 beyond C keep the padded channels' Snake at exactly 0.
    return dict(alpha1=padded(snake1.alpha, 1.0), w7=w7, b7=padded(conv7.conv.bias), alpha2=padded(snake2.alpha, 1.0),
                w1=w1, b1=padded(conv1.conv.bias))


class PackedUnit(nn.Module):
    """A unit's packed weights (`pack`) as buffers, beside the unit itself."""

    def __init__(self, unit: ResidualUnit, dtype: torch.dtype):
        super().__init__()
        self.unit = unit
        self.key = unit.block[1]  # its streaming state's key, as the unfused unit's
        self.dilation = self.key.conv.dilation[0]
        self.left = self.key.left
        for name, t in pack(unit, dtype).items():
            self.register_buffer(name, t, persistent=False)

    def context(self, x: Tensor, state: dict) -> Tensor:
        """The carried inputs of this unit's conv (zeros at a stream's start)."""
        context = state.get(self.key)
        return x.new_zeros(*x.shape[:-1], self.left) if context is None else context

    def carry(self, s: Tensor, state: dict) -> None:
        state[self.key] = s[..., -self.left :].clone()  # (a copy: see `_with_context`)


class FusedUnits(nn.Module):
    """A run of `ResidualUnit`s of the streaming back as one `residual_unit` op each, each
    handing the next its input; the same state (each unit's conv's input after Snake, under
    the conv's key) as the units'. Packed copies of the weights in `dtype`; whole-sequence
    calls (no state) run the units as they are."""

    def __init__(self, units: list[ResidualUnit], dtype: torch.dtype):
        super().__init__()
        self.units = nn.ModuleList(PackedUnit(u, dtype) for u in units)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        if state is None:
            for u in self.units:
                x = u.unit(x)
            return x
        first = self.units[0]
        s = torch.cat([first.context(x, state), first.unit.block[0](x)], dim=-1)
        first.carry(s, state)
        for u, following in zip(self.units, list(self.units[1:]) + [None]):
            nxt = {} if following is None else dict(next_alpha=following.alpha1, next_context=following.context(x, state))
            x, s = residual_unit(s, x, u.w7, u.b7, u.alpha2, u.w1, u.b1, u.dilation, **nxt)
            if following is not None:
                following.carry(s, state)
        return x


def fuse_residual_units(module: nn.Module, dtype: torch.dtype, widest: int = WIDEST) -> int:
    """Every run of consecutive `ResidualUnit`s in a `ModuleList` under `module` that the kernel
    takes (`fusable`), replaced in place by one `FusedUnits`; how many units."""
    count = 0
    for parent in list(module.modules()):
        if not isinstance(parent, nn.ModuleList) or isinstance(parent, FusedUnits):
            continue
        layers, run, fused = [], [], 0
        for layer in list(parent) + [None]:
            if isinstance(layer, ResidualUnit) and fusable(layer, widest):
                run.append(layer)
                continue
            if run:
                layers.append(FusedUnits(run, dtype))
                fused += len(run)
                run = []
            if layer is not None:
                layers.append(layer)
        if fused:
            count += fused
            for i in range(len(parent) - 1, -1, -1):
                del parent[i]
            parent.extend(layers)
    return count


def launch(s: Tensor, x: Tensor, w7: Tensor, b7: Tensor, alpha2: Tensor, w1: Tensor, b1: Tensor, dilation: int,
           next_alpha: Optional[Tensor] = None, next_context: Optional[Tensor] = None,
           config: tuple[int, int, int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """`residual_unit` as the kernel: a program per `BLOCK_T` time rows of a piece."""
    c, t = x.shape[1], x.shape[-1]
    h = torch.empty_like(x)
    following = next_alpha is not None
    if following:
        nxt = _empty(x, next_context.shape[-1] + t)
        nxt[..., : next_context.shape[-1]] = next_context
    else:
        nxt = x.new_empty(0)
    if not x.numel():
        return h, nxt
    block_t, block_k, block_n, warps, stages = config or launch_config(c)
    target = nxt if following else h
    grid = (triton.cdiv(t, block_t), x.shape[0])
    _unit[grid](s, x, h, target, w7, b7, alpha2, w1, b1, next_alpha if following else b1, t,
                s.stride(0), s.stride(-1), s.stride(1), x.stride(0), x.stride(-1), x.stride(1),
                h.stride(0), h.stride(-1), h.stride(1), target.stride(0), target.stride(-1), target.stride(1),
                next_context.shape[-1] if following else 0,
                C=c, P=w1.shape[0], DILATION=dilation, TAPS=TAPS, NEXT=following, BLOCK_T=block_t, BLOCK_K=block_k,
                BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return h, nxt


if triton is not None:

    @triton.jit
    def _snake(v, alpha):
        s = tl.sin(alpha * v)
        return v + (1.0 / (alpha + 1e-9)) * (s * s)

    @triton.jit
    def _unit(s_ptr, x_ptr, h_ptr, n_ptr, w7_ptr, b7_ptr, a2_ptr, w1_ptr, b1_ptr, an_ptr, T,
              ssb, sst, ssc, sxb, sxt, sxc, shb, sht, shc, snb, snt, snc, LN,
              C: tl.constexpr, P: tl.constexpr, DILATION: tl.constexpr, TAPS: tl.constexpr, NEXT: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rows t0..t0+BLOCK_T of piece b: the taps' products (`BLOCK_K` input channels a step,
        every output channel at once; tap k of output t reads input row t + k·dilation of s),
        then the 1x1 product `BLOCK_N` outputs at a time, with its epilogues."""
        b = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        p = tl.arange(0, P)
        in_piece = t < T
        s_rows = s_ptr + b * ssb
        acc = tl.zeros([BLOCK_T, P], dtype=tl.float32)
        steps: tl.constexpr = C // BLOCK_K
        for i in range(TAPS * steps):
            k = i // steps
            c = (i % steps) * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(s_rows + (t + k * DILATION)[:, None] * sst + c[None, :] * ssc, mask=in_piece[:, None], other=0.0)
            w = tl.load(w7_ptr + (k * C + c)[:, None] * P + p[None, :])
            acc = tl.dot(a, w, acc)
        y = _snake(acc + tl.load(b7_ptr + p)[None, :], tl.load(a2_ptr + p)[None, :])
        y = y.to(w1_ptr.dtype.element_ty)
        for n0 in tl.static_range(0, C, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            z = tl.dot(y, tl.load(w1_ptr + p[:, None] * P + n[None, :])) + tl.load(b1_ptr + n)[None, :]
            res = tl.load(x_ptr + b * sxb + t[:, None] * sxt + n[None, :] * sxc, mask=in_piece[:, None], other=0.0)
            z += res.to(tl.float32)
            tl.store(h_ptr + b * shb + t[:, None] * sht + n[None, :] * shc, z.to(res.dtype), mask=in_piece[:, None])
            if NEXT:
                # (from the sum as stored, as the next unit's Snake reads it)
                z = _snake(z.to(res.dtype).to(tl.float32), tl.load(an_ptr + n)[None, :])
                tl.store(n_ptr + b * snb + (LN + t)[:, None] * snt + n[None, :] * snc, z.to(res.dtype),
                         mask=in_piece[:, None])

"""Pieces both networks (the DualAR transformer and the codec's transformers) are made of,
with upstream's numerics: RoPE tables rounded to bf16, RMSNorm statistics in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # the statistics in float32, even for a bf16 model
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up, of w13's output [..., 2 * hidden] (w1's half, then w3's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_table(seq_len: int, head_dim: int, base: float) -> Tensor:
    """[seq_len, head_dim/2, 2] cos/sin pairs, computed in float32 and rounded to bf16 as
    upstream stores them (the rounding is part of the trained models' numerics)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([cis.real, cis.imag], dim=-1).to(torch.bfloat16)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """x: [B, S, H, D]; rope: [S, D/2, 2] shared by the batch, or [B, S, D/2, 2] per row.
    Adjacent pairs (x0, x1) rotate together, in float32."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    r = rope.view(-1, xs.size(1), 1, xs.size(3), 2).float()
    out = torch.stack(
        [xs[..., 0] * r[..., 0] - xs[..., 1] * r[..., 1], xs[..., 1] * r[..., 0] + xs[..., 0] * r[..., 1]],
        dim=-1,
    )
    return out.flatten(3).type_as(x)


"""A residual code's sampling at one row in two kernels, and the next fast step's input with it.

`sampling.logits_to_probs` (sort-free nucleus) and the draw, compiled by inductor, take
five kernels a fast step (the penalty's scatter in two, the nucleus, two softmaxes), and the
next step's embedding lookup a sixth: nine fast steps a frame. Here:
- `_nucleus`: many programs, each deciding for 16 codes whether they are in the nucleus
  (penalised logits, every code's probability, the mass ranked before each of its codes:
  the same pairwise rule as `sampling._top_p_drop_pairwise`), writing their tempered logits
  or -inf;
- `_draw`: one program, the softmax of those, the exponential race against the step's
  noise, the code, and the code's row of the fast embedding table (the next step's input).
Same arithmetic as the torch path, in float32; sums run in another order, so a code on the
nucleus' boundary can differ in rare cases (as `sort_free` does against the sort).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

CODES_PER_PROGRAM = 16


def usable(logits: Tensor) -> bool:
    """One row of at most 1,024 logits (a power of two) on CUDA with Triton."""
    v = logits.shape[-1]
    return (triton is not None and logits.is_cuda and logits.dim() == 2 and logits.shape[0] == 1
            and v <= 1024 and v & (v - 1) == 0 and v >= CODES_PER_PROGRAM)


def sample_residual(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
                    previous: Tensor | None, table: Tensor, next_input: bool = True) -> tuple[Tensor, Tensor | None]:
    """logits [1, V] (the fast head's), noise [1, V] of Exp(1) draws, temperature / top_p /
    penalty [1, 1], previous [1, W] codes to penalise (or None), table [codebook_size, dim]:
    the code [1] and, with `next_input`, its row of `table` [1, dim]."""
    v = logits.shape[-1]
    dev = logits.device
    pdl = torch.cuda.get_device_capability(dev)[0] >= 9
    launch = {"launch_pdl": True} if pdl else {}
    tempered = torch.empty(v, dtype=torch.float32, device=dev)
    prev = previous.reshape(-1) if previous is not None else logits
    width = triton.next_power_of_2(prev.numel()) if previous is not None else 1
    _nucleus[(v // CODES_PER_PROGRAM,)](logits, prev, prev.numel() if previous is not None else 0, temperature, top_p,
                                        penalty, tempered, V=v, WIDTH=width, HAS_PREV=previous is not None,
                                        BLOCK_J=CODES_PER_PROGRAM, PDL=pdl, num_warps=4, **launch)
    code = torch.empty(1, dtype=torch.long, device=dev)
    dim = table.shape[-1]
    row = torch.empty(1, dim, dtype=table.dtype, device=dev) if next_input else code
    _draw[(1,)](tempered, noise, code, table, row, V=v, DIM=dim, NEXT=next_input, PDL=pdl, num_warps=4, **launch)
    return code, (row if next_input else None)


if triton is not None:

    @triton.jit
    def _penalised(l, codes, prev_ptr, n_prev, penalty, WIDTH: tl.constexpr, HAS_PREV: tl.constexpr):
        """Logits of `codes` with the repetition penalty of the previous codes applied once."""
        if HAS_PREV:
            w = tl.arange(0, WIDTH)
            prev = tl.load(prev_ptr + w, mask=w < n_prev, other=-1)
            hit = tl.max((codes[:, None] == prev[None, :]).to(tl.int32), 1) > 0
            l = tl.where(hit, tl.where(l < 0, l * penalty, l / penalty), l)
        return l

    @triton.jit
    def _nucleus(logits_ptr, prev_ptr, n_prev, temp_ptr, top_p_ptr, penalty_ptr, out_ptr,
                 V: tl.constexpr, WIDTH: tl.constexpr, HAS_PREV: tl.constexpr, BLOCK_J: tl.constexpr,
                 PDL: tl.constexpr):
        """Codes j of this program: tempered logit if in the nucleus, else -inf. A code is
        dropped when the mass of the codes ranked before it (a larger logit, or an equal one
        at a lower index) plus its own passes top_p, unless none is ranked before it."""
        temperature = tl.maximum(tl.load(temp_ptr), 1e-5)
        top_p = tl.load(top_p_ptr)
        penalty = tl.load(penalty_ptr)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        every = tl.arange(0, V)
        l = _penalised(tl.load(logits_ptr + every).to(tl.float32), every, prev_ptr, n_prev, penalty, WIDTH, HAS_PREV)
        top = tl.max(l, 0)
        e = tl.exp(l - top)
        p = e / tl.sum(e, 0)
        j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
        lj = _penalised(tl.load(logits_ptr + j).to(tl.float32), j, prev_ptr, n_prev, penalty, WIDTH, HAS_PREV)
        pj = tl.exp(lj - top) / tl.sum(e, 0)
        before = (l[None, :] > lj[:, None]) | ((l[None, :] == lj[:, None]) & (every[None, :] < j[:, None]))
        mass = tl.sum(tl.where(before, p[None, :], 0.0), 1)
        drop = (mass + pj > top_p) & (tl.max(before.to(tl.int32), 1) > 0)
        tl.store(out_ptr + j, tl.where(drop, float("-inf"), lj / temperature))

    @triton.jit
    def _draw(tempered_ptr, noise_ptr, code_ptr, table_ptr, row_ptr, V: tl.constexpr, DIM: tl.constexpr,
              NEXT: tl.constexpr, PDL: tl.constexpr):
        """softmax(tempered) / noise, its argmax (the first on a tie), and that code's table row."""
        every = tl.arange(0, V)
        noise = tl.load(noise_ptr + every)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        z = tl.load(tempered_ptr + every)
        e = tl.exp(z - tl.max(z, 0))
        probs = e / tl.sum(e, 0)
        code = tl.argmax(probs / noise, 0, tie_break_left=True)
        tl.store(code_ptr, code.to(tl.int64))
        if NEXT:
            d = tl.arange(0, DIM)
            tl.store(row_ptr + d, tl.load(table_ptr + code.to(tl.int64) * DIM + d))

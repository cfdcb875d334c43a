"""A frame's sampling at one row as kernels of our own: two for each pick, each pick also
returning the next fast step's input (its code's embedding).

Compiled by inductor, `sampling.logits_to_probs` and the draw take five kernels a residual
code (the penalty's scatter in two, the nucleus, two softmaxes) plus the next step's lookup,
and the slow head's pick about fifteen (a radix sort of its 4,097 logits among them) plus the
mapping of its penalty ids and of its row to a token and a code. Here, for either head:
- `_nucleus`: many programs, each deciding for a few logits whether they are in the nucleus
  (penalised logits, every one's probability, the mass ranked before each: the same
  pairwise rule as `sampling._top_p_drop_pairwise`), writing the tempered logit or -inf;
- `_draw`: one program: the softmax of those, the exponential race against the step's noise,
  the pick (for the slow head: its token and code), and the code's fast embedding row.
Same arithmetic as the torch path, in float32; its sums run in another order, so a pick on
the nucleus' boundary can differ in rare cases (as `sort_free` does against the sort).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fish_sm.model.launch import dependent_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

# Logits a `_nucleus` program decides for, and its warps: each program also reads all of them.
RESIDUAL_LAUNCH = (16, 4)
HEAD_LAUNCH = (4, 8)


def usable(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def _tempered(logits: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor, previous: Tensor | None,
              head_ids: tuple[int, int, int] | None) -> Tensor:
    v = logits.shape[-1]
    width = triton.next_power_of_2(v)
    pdl, launch = dependent_launch(logits.device)
    out = torch.empty(width, dtype=torch.float32, device=logits.device)
    n_prev = previous.shape[-1] if previous is not None else 0
    begin, n_semantic, im_end = head_ids if head_ids is not None else (0, 0, 0)
    per_program, warps = HEAD_LAUNCH if head_ids is not None else RESIDUAL_LAUNCH
    _nucleus[(triton.cdiv(v, per_program),)](
        logits, v, previous if previous is not None else logits, previous.stride(-1) if previous is not None else 0,
        n_prev, begin, n_semantic, im_end, temperature, top_p, penalty, out,
        WIDTH=width, HAS_PREV=previous is not None,
        HEAD_IDS=head_ids is not None, BLOCK_J=per_program, PDL=pdl, num_warps=warps, **launch)
    return out


def _pick(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
          previous: Tensor | None, table: Tensor, head_ids: tuple[int, int, int] | None,
          next_input: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """`_nucleus` then `_draw`: (token (the slow head's only), code, the code's row of `table`
    (with `next_input`))."""
    tempered = _tempered(logits, temperature, top_p, penalty, previous, head_ids)
    token, code = (torch.empty(1, dtype=torch.long, device=logits.device) for _ in range(2))
    row = torch.empty(1, table.shape[-1], dtype=table.dtype, device=logits.device) if next_input else code
    begin, _, im_end = head_ids if head_ids is not None else (0, 0, 0)
    pdl, launch = dependent_launch(logits.device)
    _draw[(1,)](tempered, logits.shape[-1], noise, token, code, begin, im_end, table, row, WIDTH=tempered.numel(),
                DIM=table.shape[-1], HEAD=head_ids is not None, NEXT=next_input, PDL=pdl,
                num_warps=8 if head_ids is not None else 4, **launch)
    return token, code, (row if next_input else None)


def sample_residual(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
                    previous: Tensor | None, table: Tensor, next_input: bool = True) -> tuple[Tensor, Tensor | None]:
    """logits [1, V] (the fast head's), noise [1, V] of Exp(1) draws, temperature / top_p /
    penalty [1, 1], previous [1, W] codes to penalise (or None), table [codebook_size, dim]:
    the code [1] and, with `next_input`, its row of `table` [1, dim]."""
    _, code, row = _pick(logits, noise, temperature, top_p, penalty, previous, table, None, next_input)
    return code, row


def sample_head(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
                first_frame: Tensor | None, semantic_begin_id: int, im_end_id: int,
                table: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The slow head's pick: logits [1, semantic_vocab + 1] (row i: semantic code i, the last:
    <|im_end|>), noise [1, same], `first_frame` [1, 1 + C] the ids the penalty counts (the
    window's first frame, read as vocabulary ids as upstream does; None: no penalty).
    Returns the token [1], the code [1] (0 for <|im_end|>) and the code's row of `table`."""
    head_ids = (semantic_begin_id, logits.shape[-1] - 1, im_end_id)
    return _pick(logits, noise, temperature, top_p, penalty, first_frame, table, head_ids, True)


if triton is not None:

    @triton.jit
    def _penalised(l, index, prev_ptr, prev_stride, n_prev, begin, n_semantic, im_end, penalty,
                   HAS_PREV: tl.constexpr, HEAD_IDS: tl.constexpr):
        """Logits at `index` with the repetition penalty of the previous ids applied once; with
        HEAD_IDS the ids are vocabulary ids, mapped to the slow head's rows (semantic ids to
        0.., <|im_end|> to the last row, any other to none)."""
        if HAS_PREV:
            hit = index < 0
            for w in range(0, n_prev):  # one id at a time: no [logits, ids] tensor in registers
                prev = tl.load(prev_ptr + w * prev_stride)
                if HEAD_IDS:
                    semantic = (prev >= begin) & (prev < begin + n_semantic)
                    prev = tl.where(semantic, prev - begin, tl.where(prev == im_end, n_semantic, -1))
                hit = hit | (index == prev)
            l = tl.where(hit, tl.where(l < 0, l * penalty, l / penalty), l)
        return l

    @triton.jit
    def _nucleus(logits_ptr, v, prev_ptr, prev_stride, n_prev, begin, n_semantic, im_end, temp_ptr, top_p_ptr,
                 penalty_ptr, out_ptr, WIDTH: tl.constexpr, HAS_PREV: tl.constexpr,
                 HEAD_IDS: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
        """Logits j of this program: tempered if in the nucleus, else -inf. One is dropped when
        the mass of those ranked before it (a larger logit, or an equal one at a lower index)
        plus its own passes top_p, unless none is ranked before it."""
        temperature = tl.maximum(tl.load(temp_ptr), 1e-5)
        top_p = tl.load(top_p_ptr)
        penalty = tl.load(penalty_ptr)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        every = tl.arange(0, WIDTH)
        real = every < v
        l = tl.load(logits_ptr + every, mask=real, other=float("-inf")).to(tl.float32)
        l = _penalised(l, every, prev_ptr, prev_stride, n_prev, begin, n_semantic, im_end, penalty, HAS_PREV,
                       HEAD_IDS)
        top = tl.max(l, 0)
        e = tl.exp(l - top)
        total = tl.sum(e, 0)
        p = e / total
        j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
        lj = tl.load(logits_ptr + j, mask=j < v, other=float("-inf")).to(tl.float32)
        lj = _penalised(lj, j, prev_ptr, prev_stride, n_prev, begin, n_semantic, im_end, penalty, HAS_PREV,
                        HEAD_IDS)
        pj = tl.exp(lj - top) / total
        before = (l[None, :] > lj[:, None]) | ((l[None, :] == lj[:, None]) & (every[None, :] < j[:, None]))
        before = before & real[None, :]
        mass = tl.sum(tl.where(before, p[None, :], 0.0), 1)
        drop = (mass + pj > top_p) & (tl.max(before.to(tl.int32), 1) > 0)
        tl.store(out_ptr + j, tl.where(drop, float("-inf"), lj / temperature), mask=j < WIDTH)

    @triton.jit
    def _draw(tempered_ptr, v, noise_ptr, token_ptr, code_ptr, begin, im_end, table_ptr, row_ptr, WIDTH: tl.constexpr,
              DIM: tl.constexpr, HEAD: tl.constexpr, NEXT: tl.constexpr, PDL: tl.constexpr):
        """argmax(softmax(tempered) / noise) (the first on a tie); for the slow head its token
        and code; the code's table row."""
        every = tl.arange(0, WIDTH)
        real = every < v
        noise = tl.load(noise_ptr + every, mask=real, other=1.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        z = tl.load(tempered_ptr + every, mask=real, other=float("-inf"))
        e = tl.exp(z - tl.max(z, 0))
        probs = e / tl.sum(e, 0)
        pick = tl.argmax(tl.where(real, probs / noise, -1.0), 0, tie_break_left=True).to(tl.int64)
        code = pick
        if HEAD:  # the last row is <|im_end|>: token im_end, code 0
            is_end = pick == v - 1
            tl.store(token_ptr, tl.where(is_end, im_end, pick + begin).to(tl.int64))
            code = tl.where(is_end, 0, pick).to(tl.int64)
        tl.store(code_ptr, code)
        if NEXT:
            d = tl.arange(0, DIM)
            tl.store(row_ptr + d, tl.load(table_ptr + code * DIM + d))

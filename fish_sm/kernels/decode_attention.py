"""Attention of one new token per sequence over its KV cache, as a decode step needs it:
split over the key slots (flash-decoding), each sequence reading only the slots up to its own
position, GQA without repeating keys.

The decode step's graphs attend over a bucketed number of slots with a mask (see
`DualARTransformer.forward_slow`); SDPA's kernels would read every slot of the bucket for every
sequence, in two kernels. Here one kernel reads each sequence's live slots in parallel pieces
and a second combines the pieces' softmax sums. For one sequence on the row-product kernels,
`attend_new_token` also does what comes before attention (QK-norm, RoPE, the cache write)
from the projection. CUDA with Triton only; elsewhere SDPA does the same sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fish_sm.kernels.launch import dependent_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

# About two programs per SM: with 32 slots a block and two warps, best or within 12% of best at
# every shape swept on an H100 (one row over 1,280 and 4,096 slots, 8 and 32 rows, the fast layers' 10).
TARGET_PROGRAMS = 256


def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """This kernel can run for these (CUDA and Triton, 16-bit, a GPU with bf16 tensor cores,
    head_dim a power of two and contiguous)."""
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(q.device)[0] >= 8 and q.shape[-1] >= 16
            and q.shape[-1] & (q.shape[-1] - 1) == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)


def attend_new_token(qkv: Tensor, n_head: int, n_kv: int, q_norm: Tensor | None, k_norm: Tensor | None,
                     eps: float, rope: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor,
                     slots: int, target: int = TARGET_PROGRAMS, row: Tensor | None = None) -> Tensor:
    """A decode step's attention for one sequence (cache row 0), from its projection `qkv`
    [1, 1, (heads + 2 kv_heads) * head_dim]: QK-norm (if the weights are given) and RoPE
    (`rope` [1, head_dim/2, 2], its position's) of q and the new k, the new k and v written
    into the cache at `input_pos` [1], and attention over slots 0..input_pos (`slots` bounds
    them: the step's bucket), in cache row 0 or the row that the tensor `row` [1] names (read on
    the GPU, so one graph serves any row). Returns [1, 1, heads * head_dim]. Where the model's torch runs
    three kernels before attention (the norms and RoPE of q, of k with the cache write, v's
    write), this runs none: each program of the attention derives its own heads' q and new
    k/v (at most two query heads and one kv head of 128 values), and the program whose
    piece of slots holds the new position writes them. `target`: programs in all (`launch_config`)."""
    head_dim = k_cache.shape[-1]
    group = n_head // n_kv
    block_s, splits, warps = launch_config(1, n_kv, slots, target)
    chunk = triton.cdiv(triton.cdiv(slots, splits), block_s) * block_s
    out = torch.empty(1, 1, n_head * head_dim, dtype=qkv.dtype, device=qkv.device)
    pieces = out, out, out
    if splits > 1:
        m = torch.empty(1, n_head, splits, dtype=torch.float32, device=qkv.device)
        pieces = m, torch.empty_like(m), torch.empty(1, n_head, splits, head_dim, dtype=torch.float32, device=qkv.device)
    pdl, launch = dependent_launch(qkv.device)
    norms = (q_norm, k_norm) if q_norm is not None else (rope, rope)
    _attend_new_token[(n_kv, splits)](qkv, *norms, rope, k_cache, v_cache, input_pos, input_pos if row is None else row,
                                      out, *pieces, chunk, head_dim ** -0.5, eps, *k_cache.stride()[:3],
                                      *v_cache.stride()[:3], n_head,
                                      n_kv, HEAD_DIM=head_dim, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                                      BLOCK_S=block_s, SPLITS=splits, QK_NORM=q_norm is not None, ROW=row is not None,
                                      PDL=pdl,
                                      num_warps=warps, **launch)
    if splits > 1:
        _combine[(n_head,)](*pieces, out, HEAD_DIM=head_dim, SPLITS=splits, PDL=pdl, **launch)
    return out


def launch_config(bsz: int, n_kv: int, slots: int, target: int = TARGET_PROGRAMS, block: int = 32,
                  warps: int = 2) -> tuple[int, int, int]:
    """Slots per block, pieces per (sequence, kv head) (a power of two, at most one per block
    of slots), warps per program; about `target` programs in all."""
    block_s = block if slots >= block else max(16, triton.next_power_of_2(slots))
    splits = max(1, target // (bsz * n_kv))
    splits = min(triton.next_power_of_2(splits), triton.next_power_of_2(triton.cdiv(slots, block_s)))
    return block_s, splits, warps


def decode_attention(q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, target: int = TARGET_PROGRAMS,
                     rows: Tensor | None = None) -> Tensor:
    """q [B, heads, 1, head_dim]; k, v [B, kv_heads, slots, head_dim] (views of a cache), or with
    `rows` [B] the whole cache [rows, kv_heads, slots, head_dim] of which sequence b reads row
    rows[b]; sequence b sees slots 0..input_pos[b] (input_pos [1] shared, or [B, 1]).
    Returns [B, 1, heads * head_dim], softmax(q k^T / sqrt(head_dim)) v per head."""
    bsz, n_head, _, head_dim = q.shape
    n_kv, slots = k.shape[1], k.shape[2]
    block_s, splits, warps = launch_config(bsz, n_kv, slots, target)
    chunk = triton.cdiv(triton.cdiv(slots, splits), block_s) * block_s
    out = torch.empty(bsz, 1, n_head * head_dim, dtype=q.dtype, device=q.device)
    pos = input_pos.reshape(-1)
    group = n_head // n_kv
    pdl, launch = dependent_launch(q.device) if bsz == 1 else (False, {})  # one row, as compile.ONE_ROW_OPTIONS
    common = dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_S=block_s,
                  SPLITS=splits, PDL=pdl, num_warps=warps, **launch)
    pieces = out, out, out  # one piece: the program writes the output itself
    if splits > 1:
        m = torch.empty(bsz, n_head, splits, dtype=torch.float32, device=q.device)
        pieces = m, torch.empty_like(m), torch.empty(bsz, n_head, splits, head_dim, dtype=torch.float32, device=q.device)
    _attend_piece[(bsz * n_kv, splits)](q, k, v, pos, 1 if pos.numel() > 1 else 0, pos if rows is None else rows, out,
                                        *pieces, chunk, head_dim ** -0.5, *q.stride()[:2], *k.stride()[:3],
                                        *v.stride()[:3], n_kv, ROWS=rows is not None, **common)
    if splits > 1:
        _combine[(bsz * n_head,)](*pieces, out, HEAD_DIM=head_dim, SPLITS=splits, PDL=pdl, **launch)
    return out


if triton is not None:

    @triton.jit
    def _attend_piece(q_ptr, k_ptr, v_ptr, pos_ptr, pos_stride, rows_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, chunk, scale,
                      q_stride_b, q_stride_h, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
                      n_kv,
                      HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                      SPLITS: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
        """One (sequence, kv head, piece of slots): the GROUP query heads of that kv head over
        the piece's live slots, online softmax; the piece's max, sum and weighted values
        (or, as the only piece, the output)."""
        if PDL:  # everything read here may come from the kernel before (q, the new k/v, the position)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0) // n_kv
        kv = tl.program_id(0) % n_kv
        piece = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        heads = kv * GROUP + g
        real = g < GROUP
        q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=real[:, None], other=0.0)
        length = tl.load(pos_ptr + b * pos_stride) + 1
        start = piece * chunk
        end = tl.minimum(start + chunk, length)
        row = b
        if ROWS:
            row = tl.load(rows_ptr + b).to(tl.int64)  # the cache row holding this sequence
        k_base = k_ptr + row * k_stride_b + kv * k_stride_h
        v_base = v_ptr + row * v_stride_b + kv * v_stride_h
        m, total, acc = _no_slots(BLOCK_G, HEAD_DIM)
        m, total, acc = _over_slots(q, k_base, v_base, k_stride_s, v_stride_s, start, end, scale, m, total, acc,
                                    HEAD_DIM, BLOCK_S)
        _write_piece(out_ptr, m_ptr, l_ptr, acc_ptr, b * (GROUP * n_kv) + heads, real, piece, m, total, acc, HEAD_DIM,
                     SPLITS)

    @triton.jit
    def _no_slots(BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
        """The online softmax's state before any slot: running max, sum and weighted values."""
        return (tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
                tl.zeros([BLOCK_G, HEAD_DIM], tl.float32))

    @triton.jit
    def _with_slots(q, k, v, live, m, total, acc, scale):
        """The state after a block of slots k, v [BLOCK_S, HEAD_DIM] (at least one `live`)."""
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, total, acc

    @triton.jit
    def _over_slots(q, k_base, v_base, k_stride_s, v_stride_s, start, end, scale, m, total, acc,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
        """Online softmax of q's rows [BLOCK_G, HEAD_DIM] over cache slots start..end-1, from
        the state (m, total, acc) of the slots before."""
        d = tl.arange(0, HEAD_DIM)
        for s0 in range(start, end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            live = s < end
            k = tl.load(k_base + s[:, None] * k_stride_s + d[None, :], mask=live[:, None], other=0.0)
            v = tl.load(v_base + s[:, None] * v_stride_s + d[None, :], mask=live[:, None], other=0.0)
            m, total, acc = _with_slots(q, k, v, live, m, total, acc, scale)
        return m, total, acc

    @triton.jit
    def _write_piece(out_ptr, m_ptr, l_ptr, acc_ptr, rows, real, piece, m, total, acc, HEAD_DIM: tl.constexpr,
                     SPLITS: tl.constexpr):
        """A piece's result for query heads `rows` (sequence * heads + head): the output if it is
        the only piece, else its max, sum and weighted values for `_combine`."""
        d = tl.arange(0, HEAD_DIM)
        if SPLITS == 1:
            tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
                     mask=real[:, None])
        else:
            row = rows * SPLITS + piece
            tl.store(m_ptr + row, m, mask=real)
            tl.store(l_ptr + row, total, mask=real)
            tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])

    @triton.jit
    def _rotated(a, b, cos, sin, w_a, w_b, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, DTYPE: tl.constexpr):
        """Heads [rows, HEAD_DIM] given as their even (a) and odd (b) elements: RMSNorm'd if
        QK_NORM (rounded to the activations' DTYPE before its weight and after, as the model),
        then rotated by RoPE in float32; interleaved back and rounded."""
        if QK_NORM:
            inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
            a = ((a * inv).to(DTYPE).to(tl.float32) * w_a).to(DTYPE).to(tl.float32)
            b = ((b * inv).to(DTYPE).to(tl.float32) * w_b).to(DTYPE).to(tl.float32)
        return tl.interleave(a * cos - b * sin, b * cos + a * sin).to(DTYPE)

    @triton.jit
    def _attend_new_token(qkv_ptr, qn_ptr, kn_ptr, rope_ptr, k_ptr, v_ptr, pos_ptr, row_ptr, out_ptr, m_ptr, l_ptr,
                          acc_ptr, chunk, scale, eps, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h,
                          v_stride_s, n_head, n_kv,
                          HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                          SPLITS: tl.constexpr, QK_NORM: tl.constexpr, ROW: tl.constexpr, PDL: tl.constexpr):
        """`_attend_piece` for one sequence whose new token is still in its projection: the
        GROUP query heads of kv head `kv` and the new k/v are derived here; the cache's slots
        before the new position are read from it, the new one's k/v come from registers."""
        kv = tl.program_id(0)
        piece = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        i = tl.arange(0, HEAD_DIM // 2)
        d = tl.arange(0, HEAD_DIM)
        heads = kv * GROUP + g
        real = g < GROUP
        # What the kernel before does not write loads before waiting for it: RoPE's row, the norms'
        # weights, the position (written before the step) and the piece's first block of cached
        # slots (written by earlier steps).
        cos = tl.load(rope_ptr + 2 * i).to(tl.float32)[None, :]
        sin = tl.load(rope_ptr + 2 * i + 1).to(tl.float32)[None, :]
        qw_a, qw_b, kw_a, kw_b = cos, cos, cos, cos  # (no QK-norm: unused)
        if QK_NORM:
            qw_a = tl.load(qn_ptr + 2 * i).to(tl.float32)[None, :]
            qw_b = tl.load(qn_ptr + 2 * i + 1).to(tl.float32)[None, :]
            kw_a = tl.load(kn_ptr + 2 * i).to(tl.float32)[None, :]
            kw_b = tl.load(kn_ptr + 2 * i + 1).to(tl.float32)[None, :]
        pos = tl.load(pos_ptr)
        start = piece * chunk
        end = tl.minimum(start + chunk, pos + 1)
        cached = tl.minimum(end, pos)  # the cache's slots up to the new position, whose k/v are not in it yet
        k_base = k_ptr + kv * k_stride_h
        v_base = v_ptr + kv * v_stride_h
        if ROW:  # written before the step, like the position
            row = tl.load(row_ptr).to(tl.int64)
            k_base += row * k_stride_b
            v_base += row * v_stride_b
        s = start + tl.arange(0, BLOCK_S)
        first_live = s < cached
        first_at = s[:, None] * k_stride_s + d[None, :]
        k_first = tl.load(k_base + first_at, mask=first_live[:, None], other=0.0)
        v_first = tl.load(v_base + s[:, None] * v_stride_s + d[None, :], mask=first_live[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        q_at = qkv_ptr + heads[:, None] * HEAD_DIM + 2 * i[None, :]
        q = _rotated(tl.load(q_at, mask=real[:, None], other=0.0).to(tl.float32),
                     tl.load(q_at + 1, mask=real[:, None], other=0.0).to(tl.float32), cos, sin, qw_a, qw_b, eps,
                     HEAD_DIM, QK_NORM, out_ptr.dtype.element_ty)
        k_at = qkv_ptr + (n_head + kv) * HEAD_DIM + 2 * i[None, :]
        k_new = _rotated(tl.load(k_at).to(tl.float32), tl.load(k_at + 1).to(tl.float32), cos, sin, kw_a, kw_b, eps,
                         HEAD_DIM, QK_NORM, out_ptr.dtype.element_ty)  # [1, HEAD_DIM]
        v_new = tl.load(qkv_ptr + (n_head + n_kv + kv) * HEAD_DIM + d)[None, :]
        m, total, acc = _no_slots(BLOCK_G, HEAD_DIM)
        if start < cached:
            m, total, acc = _with_slots(q, k_first, v_first, first_live, m, total, acc, scale)
        m, total, acc = _over_slots(q, k_base, v_base, k_stride_s, v_stride_s, start + BLOCK_S, cached, scale, m, total,
                                    acc, HEAD_DIM, BLOCK_S)
        if (start <= pos) & (pos < end):  # this piece holds the new position: its k/v into the cache, and its term
            tl.store(k_base + pos * k_stride_s + d[None, :], k_new)
            tl.store(v_base + pos * v_stride_s + d[None, :], v_new)
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale
            m_new = tl.maximum(m, score)
            p = tl.exp(score - m_new)
            alpha = tl.exp(m - m_new)
            total = total * alpha + p
            acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
            m = m_new
        _write_piece(out_ptr, m_ptr, l_ptr, acc_ptr, heads, real, piece, m, total, acc, HEAD_DIM, SPLITS)

    @triton.jit
    def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        """One (sequence, head): the pieces' sums rescaled to their common max (a piece past
        the sequence's position has max -inf and weighs nothing)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        pieces = tl.arange(0, SPLITS)
        d = tl.arange(0, HEAD_DIM)
        m = tl.load(m_ptr + bh * SPLITS + pieces)
        weight = tl.exp(m - tl.max(m, 0))
        total = tl.sum(tl.load(l_ptr + bh * SPLITS + pieces) * weight, 0)
        acc = tl.load(acc_ptr + (bh * SPLITS + pieces)[:, None] * HEAD_DIM + d[None, :])
        y = tl.sum(acc * weight[:, None], 0) / total
        tl.store(out_ptr + bh * HEAD_DIM + d, y.to(out_ptr.dtype.element_ty))

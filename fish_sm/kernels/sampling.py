"""A frame's picks as Triton kernels of our own, each also returning the next fast step's input
(its code's embedding), and the batching engine's noise as one kernel keyed by request.

A residual code's pick at one row is two kernels, where inductor's sampling takes five plus
the next step's lookup:
- `_nucleus`: many programs, each deciding for a few logits whether they are in the nucleus
  (penalised logits, every one's probability, the mass ranked before each: the same pairwise
  rule as `sampling._top_p_drop_pairwise`), writing the tempered logit or -inf;
- `_draw`: one program: the softmax of those, the exponential race against the step's noise,
  the pick, and the code's fast embedding row.
The slow head's pick, and every pick of several rows, is `_nucleus_rows`: one program a row
doing both, finding the nucleus by bisection instead of comparing every pair (which grows
with V² and rows) or sorting: every logit above the largest value whose logits at or above
it hold more than top_p of the mass, plus those at that value which stable sorting puts
first within it; for the slow head, its token and code too.

Same arithmetic as the torch path, in float32; its sums run in another order, so a pick on
the nucleus' boundary can differ in rare cases (as `sort_free` does against the sort).

A model carrying LoRA adapters (`kernels.lora`) adds each row's adapter to the embedding row in
the same kernel (`EmbeddingAdapters`: `lora_lookup`'s arithmetic and rounding, then the sum the
wrapper's `y + delta` makes), where it took two more kernels a code.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import numpy as np
import torch
from torch import Tensor

from fish_sm.kernels.launch import dependent_launch
from fish_sm.kernels.lora import LoraEmbedding
from fish_sm.model.dual_ar import DualARTransformer

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

# Logits a `_nucleus` program decides for (each also reads all of them) and its warps, for a
# residual code's 1,024 logits: 128 programs of 8 were fastest in whole frames on an H100.
RESIDUAL_LAUNCH = (8, 4)
# Warps of a `_nucleus_rows` program, by whether it picks for the slow head (4,097 logits) or a
# residual code (1,024).
ROWS_WARPS = MappingProxyType({True: 16, False: 4})
NOISE_BLOCK = 2048  # draws an `_exponential` program writes


def usable(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


_BITS64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _BITS64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _BITS64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _BITS64
    return x ^ (x >> 31)


def noise_key(seed: int, draw: int) -> int:
    """The Philox key of a request's `draw`-th frame of noise: its seed and the draw's number
    mixed (63 bits, an int64 tensor's), so each frame's draws depend on nothing but them."""
    return _splitmix64((seed & _BITS64) ^ _splitmix64(draw)) >> 1


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)  # uint64 arithmetic wraps, as the scalar version's masks do
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def noise_keys(seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """`noise_key` of every (seed, draw) pair at once (uint64 seeds, int draws): int64 keys."""
    with np.errstate(over="ignore"):
        mixed = _splitmix64_array(np.asarray(seeds, np.uint64) ^ _splitmix64_array(np.asarray(draws).astype(np.uint64)))
    return (mixed >> np.uint64(1)).astype(np.int64)


def exponential_noise(keys: Tensor, out: Tensor, block: int = NOISE_BLOCK) -> Tensor:
    """Exp(1) draws into each row of `out` [B, n] (float32, CUDA), row b's from Philox keyed by
    keys[b] (int64, `noise_key`) at counters 0..n-1: a batch's noise in one kernel, where a
    generator per request took one `exponential_` each and their launches held the decode loop."""
    rows, n = out.shape
    _exponential[(rows, triton.cdiv(n, block))](keys, out, n, out.stride(0), BLOCK=block)
    return out


def _tempered(logits: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor, previous: Tensor | None,
              launch: tuple[int, int] = RESIDUAL_LAUNCH) -> Tensor:
    v = logits.shape[-1]
    width = triton.next_power_of_2(v)
    pdl, options = dependent_launch(logits.device)
    out = torch.empty(width, dtype=torch.float32, device=logits.device)
    n_prev = previous.shape[-1] if previous is not None else 0
    per_program, warps = launch
    _nucleus[(triton.cdiv(v, per_program),)](
        logits, v, previous if previous is not None else logits, previous.stride(-1) if previous is not None else 0,
        n_prev, temperature, top_p, penalty, out, WIDTH=width, HAS_PREV=previous is not None, BLOCK_J=per_program,
        PDL=pdl, num_warps=warps, **options)
    return out


class EmbeddingAdapters(NamedTuple):
    """The adapters on an embedding table as the pick kernels add them to the row they look up:
    a_t [slots, num, R] (A transposed), b [slots, dim, R] (scaled), ids [rows] each row's slot
    (0: none), as `lora_lookup` takes them."""

    a_t: Tensor
    b: Tensor
    ids: Tensor

    @classmethod
    def of(cls, embedding: torch.nn.Module, rows: int) -> "EmbeddingAdapters | None":
        """Those of `embedding` for a pick of `rows` rows, if it carries adapters that are added."""
        if isinstance(embedding, LoraEmbedding) and embedding.adds:
            return cls(embedding.lora_a_t, embedding.lora_b, embedding.ids[:rows])
        return None

    def kernel_args(self) -> dict:
        return dict(lora_a_ptr=self.a_t, lora_b_ptr=self.b, ids_ptr=self.ids, NUM=self.a_t.shape[1], R=self.b.shape[-1],
                    LORA=True, BLOCK_R=triton.next_power_of_2(self.b.shape[-1]))


def _no_adapters(table: Tensor) -> dict:
    """The pick kernels' adapter arguments when none are added (never read)."""
    return dict(lora_a_ptr=table, lora_b_ptr=table, ids_ptr=table, NUM=0, R=0, LORA=False, BLOCK_R=1)


def _adapter_args(adapters: EmbeddingAdapters | None, table: Tensor, next_input: bool) -> dict:
    return adapters.kernel_args() if adapters is not None and next_input else _no_adapters(table)


def _pick_one(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
              previous: Tensor | None, table: Tensor, next_input: bool,
              adapters: EmbeddingAdapters | None = None) -> tuple[Tensor, Tensor | None]:
    """A residual code's pick at one row: `_nucleus` then `_draw`; (code [1], its row of
    `table` (with `next_input`), plus its adapter's part (`adapters`))."""
    tempered = _tempered(logits, temperature, top_p, penalty, previous)
    code = torch.empty(1, dtype=torch.long, device=logits.device)
    row = torch.empty(1, table.shape[-1], dtype=table.dtype, device=logits.device) if next_input else code
    pdl, options = dependent_launch(logits.device)
    _draw[(1,)](tempered, logits.shape[-1], noise, code, table, row, WIDTH=tempered.numel(), DIM=table.shape[-1],
                NEXT=next_input, PDL=pdl, num_warps=4, **_adapter_args(adapters, table, next_input), **options)
    return code, (row if next_input else None)


def _pick_rows(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
               previous: Tensor | None, table: Tensor, head_ids: tuple[int, int, int] | None,
               next_input: bool, warps: Mapping[bool, int] = ROWS_WARPS, adapters: EmbeddingAdapters | None = None
               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Each row's pick with its own parameters, noise and penalty ids: (token (the slow head's
    only), code, the code's row of `table` (with `next_input`), plus its adapter's part
    (`adapters`)), one per row."""
    rows, v = logits.shape
    logits, noise = (t if t.stride(-1) == 1 else t.contiguous() for t in (logits, noise))
    dev = logits.device
    token, code = (torch.empty(rows, dtype=torch.long, device=dev) for _ in range(2))
    row = torch.empty(rows, table.shape[-1], dtype=table.dtype, device=dev) if next_input else code
    begin, n_semantic, im_end = head_ids if head_ids is not None else (0, 0, 0)
    has_prev = previous is not None
    _nucleus_rows[(rows,)](
        logits, logits.stride(0), v, noise, noise.stride(0),
        previous if has_prev else logits, previous.stride(0) if has_prev else 0, previous.stride(-1) if has_prev else 0,
        previous.shape[-1] if has_prev else 0, begin, n_semantic, im_end,
        temperature, temperature.stride(0), top_p, top_p.stride(0), penalty, penalty.stride(0),
        token, code, table, row, WIDTH=triton.next_power_of_2(v), DIM=table.shape[-1], HAS_PREV=has_prev,
        HEAD=head_ids is not None, NEXT=next_input, num_warps=warps[head_ids is not None],
        **_adapter_args(adapters, table, next_input))
    return token, code, (row if next_input else None)


def sample_residual(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
                    previous: Tensor | None, table: Tensor, next_input: bool = True,
                    adapters: EmbeddingAdapters | None = None) -> tuple[Tensor, Tensor | None]:
    """logits [B, V] (the fast head's), noise [B, V] of Exp(1) draws, temperature / top_p /
    penalty [B, 1], previous [B, W] codes to penalise (or None), table [codebook_size, dim]:
    the code [B] and, with `next_input`, its row of `table` [B, dim] plus its adapter's part
    (`adapters`)."""
    if logits.shape[0] == 1:
        return _pick_one(logits, noise, temperature, top_p, penalty, previous, table, next_input, adapters)
    _, code, row = _pick_rows(logits, noise, temperature, top_p, penalty, previous, table, None, next_input,
                              adapters=adapters)
    return code, row


def sample_head(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, penalty: Tensor,
                first_frame: Tensor | None, semantic_begin_id: int, im_end_id: int,
                table: Tensor, adapters: EmbeddingAdapters | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The slow head's pick: logits [B, semantic_vocab + 1] (row i: semantic code i, the last:
    <|im_end|>), noise [B, same], `first_frame` [B, 1 + C] the ids the penalty counts (the
    window's first frame, read as vocabulary ids as upstream does; None: no penalty).
    Returns the token [B], the code [B] (0 for <|im_end|>) and the code's row of `table` plus
    its adapter's part (`adapters`)."""
    head_ids = (semantic_begin_id, logits.shape[-1] - 1, im_end_id)
    return _pick_rows(logits, noise, temperature, top_p, penalty, first_frame, table, head_ids, True,
                      adapters=adapters)


def pick_head_kernels(model: DualARTransformer, logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor,
                      penalty: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The slow head's pick (`sample_head`) for `generate.sample_frame`: its token, its code
    and the code's embedding as the model's fast embedding gives it, adapters included (the
    fast transformer's first input)."""
    return sample_head(logits, noise, temperature, top_p, penalty, None if window is None else window[:, :, 0],
                       model.semantic_begin_id, model.im_end_id, model.fast_embeddings.weight,
                       EmbeddingAdapters.of(model.fast_embeddings, logits.shape[0]))


def pick_residual_kernels(model: DualARTransformer, hidden: Tensor, noise: Tensor, temperature: Tensor,
                          top_p: Tensor, penalty: Tensor, previous: Tensor | None, next_input: bool,
                          fast_logits: Callable[[DualARTransformer, Tensor], Tensor] | None = None
                          ) -> tuple[Tensor, Tensor | None]:
    """A residual code from the fast transformer's hidden state (its head, then
    `sample_residual`) for `generate.sample_frame`, with the next fast step's input (the
    code's embedding as the model's fast embedding gives it, adapters included). `fast_logits`:
    the fast head as compiled for several rows."""
    logits = model.fast_logits(hidden) if fast_logits is None else fast_logits(model, hidden)
    return sample_residual(logits, noise, temperature, top_p, penalty, previous, model.fast_embeddings.weight,
                           next_input, EmbeddingAdapters.of(model.fast_embeddings, logits.shape[0]))


if triton is not None:
    from fish_sm.kernels.lora_products import lookup_part

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
    def _nucleus(logits_ptr, v, prev_ptr, prev_stride, n_prev, temp_ptr, top_p_ptr, penalty_ptr, out_ptr,
                 WIDTH: tl.constexpr, HAS_PREV: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
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
        l = _penalised(l, every, prev_ptr, prev_stride, n_prev, 0, 0, 0, penalty, HAS_PREV, False)
        top = tl.max(l, 0)
        e = tl.exp(l - top)
        total = tl.sum(e, 0)
        p = e / total
        j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
        lj = tl.load(logits_ptr + j, mask=j < v, other=float("-inf")).to(tl.float32)
        lj = _penalised(lj, j, prev_ptr, prev_stride, n_prev, 0, 0, 0, penalty, HAS_PREV, False)
        pj = tl.exp(lj - top) / total
        before = (l[None, :] > lj[:, None]) | ((l[None, :] == lj[:, None]) & (every[None, :] < j[:, None]))
        before = before & real[None, :]
        mass = tl.sum(tl.where(before, p[None, :], 0.0), 1)
        drop = (mass + pj > top_p) & (tl.max(before.to(tl.int32), 1) > 0)
        tl.store(out_ptr + j, tl.where(drop, float("-inf"), lj / temperature), mask=j < WIDTH)

    @triton.jit
    def _embedding_row(table_ptr, code, slot, lora_a_ptr, lora_b_ptr, NUM, R, DIM: tl.constexpr, LORA: tl.constexpr,
                       BLOCK_R: tl.constexpr):
        """Row `code` of the table, plus (LORA) the adapter in `slot`'s part of it, as
        `lora_lookup` computes and rounds it (nothing for slot 0) and as `y + delta` adds it."""
        d = tl.arange(0, DIM)
        e = tl.load(table_ptr + code * DIM + d)
        if LORA:
            if slot != 0:
                part = lookup_part(lora_a_ptr, lora_b_ptr, slot, code, NUM, DIM, R, d, BLOCK_R)
                delta = part.to(lora_b_ptr.dtype.element_ty)
                e = (e.to(tl.float32) + delta.to(tl.float32)).to(table_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        return e

    @triton.jit
    def _draw(tempered_ptr, v, noise_ptr, code_ptr, table_ptr, row_ptr, lora_a_ptr, lora_b_ptr, ids_ptr, NUM, R,
              WIDTH: tl.constexpr, DIM: tl.constexpr, NEXT: tl.constexpr, PDL: tl.constexpr, LORA: tl.constexpr,
              BLOCK_R: tl.constexpr):
        """argmax(softmax(tempered) / noise) (the first on a tie), and its table row (with its
        adapter's part: LORA)."""
        every = tl.arange(0, WIDTH)
        real = every < v
        noise = tl.load(noise_ptr + every, mask=real, other=1.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        z = tl.load(tempered_ptr + every, mask=real, other=float("-inf"))
        e = tl.exp(z - tl.max(z, 0))
        probs = e / tl.sum(e, 0)
        code = tl.argmax(tl.where(real, probs / noise, -1.0), 0, tie_break_left=True).to(tl.int64)
        tl.store(code_ptr, code)
        if NEXT:
            slot = tl.load(ids_ptr).to(tl.int64) if LORA else 0
            e = _embedding_row(table_ptr, code, slot, lora_a_ptr, lora_b_ptr, NUM, R, DIM, LORA, BLOCK_R)
            tl.store(row_ptr + tl.arange(0, DIM), e)

    @triton.jit
    def _nucleus_rows(logits_ptr, logits_stride, v, noise_ptr, noise_stride, prev_ptr, prev_row_stride, prev_stride,
                      n_prev, begin, n_semantic, im_end, temp_ptr, temp_stride, top_p_ptr, top_p_stride, penalty_ptr,
                      penalty_stride, token_ptr, code_ptr, table_ptr, row_ptr, lora_a_ptr, lora_b_ptr, ids_ptr, NUM, R,
                      WIDTH: tl.constexpr, DIM: tl.constexpr, HAS_PREV: tl.constexpr, HEAD: tl.constexpr,
                      NEXT: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr):
        """Row `program_id`'s pick, as `_nucleus` and `_draw` make it for one row."""
        r = tl.program_id(0).to(tl.int64)
        temperature = tl.maximum(tl.load(temp_ptr + r * temp_stride), 1e-5)
        top_p = tl.load(top_p_ptr + r * top_p_stride)
        penalty = tl.load(penalty_ptr + r * penalty_stride)
        every = tl.arange(0, WIDTH)
        real = every < v
        l = tl.load(logits_ptr + r * logits_stride + every, mask=real, other=float("-inf")).to(tl.float32)
        l = _penalised(l, every, prev_ptr + r * prev_row_stride, prev_stride, n_prev, begin, n_semantic, im_end,
                       penalty, HAS_PREV, HEAD)
        l = tl.where(l == 0.0, 0.0, l)  # -0.0 as +0.0: equal logits get equal keys
        e = tl.exp(l - tl.max(l, 0))
        p = e / tl.sum(e, 0)
        # Integers in the logits' order (a float's bits, the negative ones' magnitude reversed).
        bits = l.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        lowest = tl.min(tl.where(real, key, 2147483647), 0)
        # Bisection for the largest key whose logits at or above it hold more than top_p.
        lo = lowest.to(tl.int64)
        hi = tl.max(tl.where(real, key, -2147483647), 0).to(tl.int64) + 1
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            above = tl.sum(tl.where(key >= mid.to(tl.int32), p, 0.0), 0) > top_p
            lo = tl.where(above, mid, lo)
            hi = tl.where(above, hi, mid)
        everything = tl.sum(p, 0) <= top_p  # nothing is dropped
        threshold = tl.where(everything, lowest.to(tl.int64) - 1, lo).to(tl.int32)
        kept = key > threshold
        at = (key == threshold) & real  # kept in index order while the running mass stays within top_p
        mass = tl.sum(tl.where(kept, p, 0.0), 0) + tl.cumsum(tl.where(at, p, 0.0), 0)
        first = tl.argmax(l, 0, tie_break_left=True)  # the most likely token always stays
        kept = (kept | (at & (mass <= top_p)) | (every == first)) & real
        z = tl.where(kept, l / temperature, float("-inf"))
        z = tl.exp(z - tl.max(z, 0))
        probs = z / tl.sum(z, 0)
        noise = tl.load(noise_ptr + r * noise_stride + every, mask=real, other=1.0)
        pick = tl.argmax(tl.where(real, probs / noise, -1.0), 0, tie_break_left=True).to(tl.int64)
        code = pick
        if HEAD:  # the last row is <|im_end|>: token im_end, code 0
            is_end = pick == v - 1
            tl.store(token_ptr + r, tl.where(is_end, im_end, pick + begin).to(tl.int64))
            code = tl.where(is_end, 0, pick).to(tl.int64)
        tl.store(code_ptr + r, code)
        if NEXT:
            slot = tl.load(ids_ptr + r).to(tl.int64) if LORA else 0
            e = _embedding_row(table_ptr, code, slot, lora_a_ptr, lora_b_ptr, NUM, R, DIM, LORA, BLOCK_R)
            tl.store(row_ptr + r * DIM + tl.arange(0, DIM), e)

    @triton.jit
    def _exponential(keys, out, n, stride, BLOCK: tl.constexpr):
        # 24 random bits per draw as U in (0, 1], exactly, and -log U; a draw of 0 (U = 1,
        # one in 2**24) becomes the smallest value the 24 bits can otherwise give, so that
        # `probs / noise` never divides by zero.
        row = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        bits = tl.randint(tl.load(keys + row), i).to(tl.uint32, bitcast=True) >> 8
        u = (bits.to(tl.float32) + 1.0) * 5.9604644775390625e-08  # 2**-24
        e = tl.maximum(-tl.log(u), 5.9604644775390625e-08)
        tl.store(out + row * stride + i, e, mask=i < n)

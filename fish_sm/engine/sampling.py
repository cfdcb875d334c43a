"""Sampling exactly as upstream fish-speech defines it.

Order of operations: windowed repetition penalty on the raw logits, then top-p on the
penalised logits, then temperature, then softmax; a token is drawn with the
exponential-race trick (argmax of probs / Exp(1) noise), which needs no host sync.
Upstream carries temperature, top-p and the penalty as bfloat16 tensors, so their
values are rounded to bf16 before use; `SamplingParams` does the same, so a request
for top_p=0.8 samples with 0.80078125 here as there.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fish_sm.contract import SamplingParams

# Upstream's repetition-penalty window, in frames.
PENALTY_WINDOW = 16


def round_bf16(values) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32: what
    `torch.tensor(x, dtype=torch.bfloat16)` holds (NaN and infinities pass through)."""
    values = np.asarray(values, np.float32)
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return np.where(np.isfinite(values), rounded.view(np.float32), values).astype(np.float32)


def _bf16(x: float) -> float:
    return float(round_bf16(x))


def sampling_tensors(params: SamplingParams, device) -> tuple[Tensor, Tensor, Tensor]:
    """(temperature, top_p, repetition_penalty) as float32 scalars holding bf16-rounded values."""
    return tuple(
        torch.tensor(_bf16(v), dtype=torch.float32, device=device)
        for v in (params.temperature, params.top_p, params.repetition_penalty)
    )


def apply_repetition_penalty(logits: Tensor, previous: Tensor, penalty: Tensor) -> Tensor:
    """Penalise each distinct index in `previous` once: positive logits are divided by the
    penalty, negative ones multiplied. Indices outside [0, V) are ignored, which lets
    callers pass ids from another vocabulary (see `head_penalty_indices`)."""
    v = logits.shape[-1]
    idx = torch.where((previous >= 0) & (previous < v), previous, v).long()
    hit = torch.zeros(*logits.shape[:-1], v + 1, dtype=torch.bool, device=logits.device)
    hit.scatter_(-1, idx, True)
    hit = hit[..., :v]
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(hit, penalised, logits)


# Top-p by comparing every pair of logits costs V² work per row but no sort: faster than the
# sort for one row of the residual codebooks' 1,024 logits, slower for the head's 4,097.
PAIRWISE_MAX_VOCAB = 1024


def logits_to_probs(logits: Tensor, temperature: Tensor, top_p: Tensor, repetition_penalty: Tensor,
                    previous: Tensor | None = None, sort_free: bool = False,
                    pairwise_max_vocab: int = PAIRWISE_MAX_VOCAB) -> Tensor:
    """logits [..., V] (float32) -> probabilities [..., V]. `sort_free`: find the nucleus of
    rows of at most `pairwise_max_vocab` logits without a sort (the same tokens up to rounding
    at the top_p boundary; one-row steps, where it is faster)."""
    logits = logits.float()
    if previous is not None:
        logits = apply_repetition_penalty(logits, previous, repetition_penalty)
    pairwise = sort_free and logits.shape[-1] <= pairwise_max_vocab
    drop = _top_p_drop_pairwise(logits, top_p) if pairwise else _top_p_drop_sorted(logits, top_p)
    logits = logits.masked_fill(drop, float("-inf")) / torch.clamp(temperature, min=1e-5)
    return torch.softmax(logits, dim=-1)


def _top_p_drop_sorted(logits: Tensor, top_p: Tensor) -> Tensor:
    """Upstream's nucleus: sort descending, drop where the running probability passes top_p
    (the most likely token always stays)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    drop_sorted = cum > top_p
    drop_sorted[..., 0].fill_(False)  # (fill_: no host tensor, graph-safe)
    return torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)


def _top_p_drop_pairwise(logits: Tensor, top_p: Tensor) -> Tensor:
    """The same set without a sort: a token's running probability is the mass of the tokens
    ranked before it (a larger logit, or an equal one at a lower index: the stable sort's
    order) plus its own."""
    p = torch.softmax(logits, dim=-1)
    index = torch.arange(logits.shape[-1], device=logits.device)
    mine, theirs = logits[..., :, None], logits[..., None, :]
    before = (theirs > mine) | ((theirs == mine) & (index[None, :] < index[:, None]))
    mass = (before * p[..., None, :]).sum(-1)
    return (mass + p > top_p) & before.any(-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one index per row: argmax(p / q), q ~ Exp(1), is a sample from p."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / q, dim=-1)


def head_penalty_indices(window_first_frame: Tensor, semantic_begin_id: int, num_semantic: int, im_end_id: int) -> Tensor:
    """The slow head's penalty indices, as upstream computes them, mapped to our head's rows.

    Upstream penalises the vocabulary ids found in the *first frame* of the 16-frame
    window (its slow token and its ten codebook ids, read as vocabulary ids). Semantic
    ids map to rows 0..num_semantic-1, <|im_end|> to the last row; any other id is a
    row the head does not have, so it is dropped (-1).
    """
    t = window_first_frame
    rows = torch.full_like(t, -1)
    semantic = (t >= semantic_begin_id) & (t < semantic_begin_id + num_semantic)
    rows = torch.where(semantic, t - semantic_begin_id, rows)
    return torch.where(t == im_end_id, num_semantic, rows)


def request_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The random stream of one request: seeded, or from the OS when no seed is given."""
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator

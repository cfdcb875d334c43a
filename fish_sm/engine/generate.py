"""Prefill, then frame-by-frame decoding on the model's static KV cache.

One frame = one slow step (the head picks a semantic code or <|im_end|>) followed by
`num_codebooks` fast steps (the residual codes). The repetition-penalty window is
upstream's: the 16 frames before the current one, counted from the first frame after
the prefill, zero-filled while fewer exist; the slow head sees only the window's first
frame (see `sampling.head_penalty_indices`).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from fish_sm.errors import InputError
from fish_sm.model.config import RESIDUAL_CODEBOOK_SIZE
from fish_sm.model.dual_ar import DualARTransformer
from fish_sm.engine.sampling import PENALTY_WINDOW, SamplingParams, head_penalty_indices, logits_to_probs, sample


class FrameDecoder:
    """Samples whole frames: `[1 + num_codebooks]` = (token id, code 0, ..., code C-1)."""

    def __init__(self, model: DualARTransformer, params: SamplingParams, generator: torch.Generator | None):
        self.model = model
        self.temperature, self.top_p, self.penalty = params.tensors(model.embeddings.weight.device)
        self.generator = generator

    def _sample(self, logits: Tensor, previous: Tensor | None) -> Tensor:
        probs = logits_to_probs(logits, self.temperature, self.top_p, self.penalty, previous)
        return sample(probs, self.generator)

    def __call__(self, logits: Tensor, hidden: Tensor, window: Tensor | None) -> Tensor:
        """logits [1, semantic_vocab + 1], hidden [1, fast_dim]; window [1 + C, 16] or None (first frame)."""
        m, c = self.model, self.model.config
        head_prev = None
        if window is not None:
            head_prev = head_penalty_indices(window[:, 0], m.semantic_begin_id, c.semantic_vocab, m.im_end_id)
        row = self._sample(logits[0], head_prev)
        is_end = row == c.semantic_vocab
        token = torch.where(is_end, m.im_end_id, row + m.semantic_begin_id)
        code = torch.where(is_end, 0, row)
        codes = [code]
        m.forward_fast(hidden, 0)  # fills position 0 of the fast cache; its logits are unused
        for i in range(1, c.num_codebooks):
            h = m.forward_fast(m.fast_embeddings(code)[None], i)
            logits_i = m.fast_logits(h)[0, :RESIDUAL_CODEBOOK_SIZE]
            code = self._sample(logits_i, None if window is None else window[i + 1])
            codes.append(code)
        return torch.stack([token, *codes]).view(-1)


@torch.inference_mode()
def generate_frames(model: DualARTransformer, prompt: Tensor, params: SamplingParams,
                    generator: torch.Generator | None = None) -> Iterator[Tensor]:
    """Yield frames [1 + C] (long, on the model's device) until <|im_end|> or `max_new_tokens`.

    The <|im_end|> frame itself is not yielded.
    """
    device = model.embeddings.weight.device
    n_rows, length = prompt.shape
    if length + 1 >= model.max_seq_len:
        raise InputError(f"the prompt is {length} tokens; this model holds at most {model.max_seq_len - 2}")
    max_new = min(params.max_new_tokens, model.max_seq_len - length)
    decode = FrameDecoder(model, params, generator)
    prompt = prompt.to(device)
    logits, hidden = model.forward_slow(prompt[None], torch.arange(length, device=device))
    frame = decode(logits, hidden, None)
    history = torch.zeros(n_rows, max(max_new, PENALTY_WINDOW), dtype=torch.long, device=device)
    for i in range(max_new):
        if int(frame[0]) == model.im_end_id:
            return
        yield frame
        if i == max_new - 1:
            return
        logits, hidden = model.forward_slow(frame.view(1, n_rows, 1), torch.tensor([length + i], device=device))
        start = max(0, i - PENALTY_WINDOW)
        window = history[:, start : start + PENALTY_WINDOW]
        frame = decode(logits, hidden, window)
        history[:, i] = frame

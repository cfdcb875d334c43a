"""Decoding codes a few frames at a time with the same result as one whole-sequence decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from fish_sm.model.codec.model import Codec


class StreamingDecoder:
    """Decode codes a few frames at a time with the same result as one whole-sequence `decode`.

    Each causal conv keeps its last (kernel-1)*dilation inputs, each transposed conv its last
    taps-1, and the post-quantizer transformer a KV cache of its last window-1 positions; so
    a push costs the same whatever came before.
    """

    def __init__(self, codec: Codec, batch_size: int = 1):
        self.codec = codec
        self.batch_size = batch_size
        self.frames = 0
        self._state: dict = {}

    @torch.no_grad()
    def push(self, codes: Tensor) -> Tensor:
        """codes [B, 1 + n_codebooks, n] -> the next n * frame_length samples [B, n * frame_length]."""
        self.codec.check_codes(codes)
        if codes.shape[0] != self.batch_size:
            raise ValueError(f"streaming decoder was made for batch {self.batch_size}, got {codes.shape[0]}")
        self.frames += codes.shape[-1]
        return self.codec.decode(codes, self._state)

    def reset(self) -> None:
        """Start a new utterance."""
        self.frames = 0
        self._state = {}

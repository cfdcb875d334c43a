"""What a synthesis takes besides its text and gives back: a reference voice, and the result."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import Tensor


@dataclass(frozen=True)
class Reference:
    """A voice to imitate: its transcript and its codes [num_codebooks, frames] (on the CPU)."""

    text: str
    codes: Tensor


@dataclass
class Synthesis:
    audio: np.ndarray  # float32, mono
    sample_rate: int
    frames: int
    seconds: float
    rtf: float  # wall time / audio duration: below 1 is faster than real time
    timings: dict[str, float] = field(default_factory=dict)
    codes: Tensor | None = None  # [num_codebooks, frames]

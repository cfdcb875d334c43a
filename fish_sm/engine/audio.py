"""Reading reference audio: any container libsndfile reads, any rate, mono or stereo.

Resampling is a windowed-sinc polyphase filter (Hann window, six zero crossings,
cut-off at 99% of the lower Nyquist frequency), written here in torch so that no
audio library beyond soundfile is needed.
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from fish_sm.errors import InputError

AudioInput = bytes | str | Path | tuple[np.ndarray, int]


def read_audio(source: AudioInput) -> tuple[np.ndarray, int]:
    """Decode to float32 mono samples and their rate. Raises InputError if it cannot."""
    if isinstance(source, tuple):
        samples, rate = source
        samples = np.asarray(samples, dtype=np.float32)
    else:
        handle = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
        if not isinstance(handle, io.BytesIO) and not Path(handle).is_file():
            raise InputError(f"reference audio file not found: {handle}")
        try:
            samples, rate = sf.read(handle, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
            raise InputError(f"cannot decode the reference audio ({exc})") from None
    if samples.ndim == 2:
        # soundfile gives [frames, channels]; arrays from callers may be [channels, frames].
        if samples.shape[0] <= 8 < samples.shape[1]:
            samples = samples.T
        samples = samples.mean(axis=1)
    if samples.ndim != 1 or samples.size == 0:
        raise InputError("the reference audio is empty")
    if not np.isfinite(samples).all():
        raise InputError("the reference audio holds NaN or infinite samples")
    if not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise InputError(f"invalid sample rate {rate!r}")
    return np.ascontiguousarray(samples, dtype=np.float32), int(rate)


@lru_cache(maxsize=16)
def _kernels(orig: int, new: int, zero_crossings: int = 6, rolloff: float = 0.99) -> tuple[torch.Tensor, int]:
    """`new` filters, one per output phase, each over the input samples around it."""
    cutoff = min(orig, new) * rolloff  # in units of the reduced rates
    width = math.ceil(zero_crossings * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    t = (taps[None, :] - torch.arange(new, dtype=torch.float64)[:, None] / new) * cutoff
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return (sinc * window * cutoff / orig).float()[:, None, :], width


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Band-limited resampling; output length ceil(len * new / orig)."""
    if orig_rate == new_rate:
        return samples
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernels, width = _kernels(orig, new)
    x = torch.from_numpy(samples)[None, None]
    x = torch.nn.functional.pad(x, (width, width + orig))
    y = torch.nn.functional.conv1d(x, kernels, stride=orig)  # [1, new, blocks]
    y = y.transpose(1, 2).reshape(-1)
    return y[: math.ceil(new * len(samples) / orig)].numpy()


def load_reference_audio(source: AudioInput, sample_rate: int) -> np.ndarray:
    samples, rate = read_audio(source)
    return resample(samples, rate, sample_rate)

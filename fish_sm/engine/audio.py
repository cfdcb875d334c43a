"""Reading reference audio: any container libsndfile reads, any rate, mono or stereo.

Resampling is a windowed-sinc filter (Hann window, six zero crossings, cut-off at 99% of
the lower Nyquist frequency), written here in torch so that no audio library beyond
soundfile is needed. Between rates of a small common ratio (44.1 kHz and 48 kHz: 147/160)
it runs as a polyphase filter bank, one filter per output phase; between rates whose ratio
reduces to large numbers (44,101 Hz to 44,100 Hz) that bank would take gigabytes, so each
output sample is computed from its own taps instead, at a cost bounded by the audio's length.
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
MIN_RATE, MAX_RATE = 1_000, 384_000  # what recorders write; beyond, resampling costs grow with the ratio


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
    if not isinstance(rate, (int, np.integer)) or not MIN_RATE <= rate <= MAX_RATE:
        raise InputError(f"sample rate {rate!r} Hz is not supported: use {MIN_RATE:,} to {MAX_RATE:,} Hz")
    return np.ascontiguousarray(samples, dtype=np.float32), int(rate)


ZERO_CROSSINGS = 6
ROLLOFF = 0.99
FILTER_BANK_LIMIT = 1 << 20  # elements (4 MB) of the largest polyphase bank built and cached
CHUNK_ELEMENTS = 1 << 22  # taps computed at once by the per-sample path


def _filter(t: torch.Tensor, scale: float) -> torch.Tensor:
    """The windowed sinc at `t` (in zero crossings), times the gain `scale`."""
    t = t.clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return sinc * window * scale


@lru_cache(maxsize=16)
def _kernels(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """`new` filters, one per output phase, each over the input samples around it."""
    cutoff = min(orig, new) * ROLLOFF  # in units of the reduced rates
    width = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    t = (taps[None, :] - torch.arange(new, dtype=torch.float64)[:, None] / new) * cutoff
    return _filter(t, cutoff / orig).float()[:, None, :], width


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Band-limited resampling; output length ceil(len * new / orig)."""
    if orig_rate == new_rate:
        return samples
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    width = math.ceil(ZERO_CROSSINGS * orig / (min(orig, new) * ROLLOFF))
    if new * (2 * width + orig) > FILTER_BANK_LIMIT:
        return _resample_per_sample(samples, orig_rate, new_rate)
    kernels, width = _kernels(orig, new)
    x = torch.from_numpy(samples)[None, None]
    x = torch.nn.functional.pad(x, (width, width + orig))
    y = torch.nn.functional.conv1d(x, kernels, stride=orig)  # [1, new, blocks]
    y = y.transpose(1, 2).reshape(-1)
    return y[: math.ceil(new * len(samples) / orig)].numpy()


def _resample_per_sample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """The same filter as the polyphase bank, evaluated at each output sample's own position:
    2 * reach taps an output sample, so the cost grows with the audio, not the rates' ratio."""
    scale = min(1.0, new_rate / orig_rate) * ROLLOFF  # the cut-off, in cycles per input sample x 2
    reach = math.ceil(ZERO_CROSSINGS / scale)  # input samples either side of an output sample
    n_out = math.ceil(new_rate * len(samples) / orig_rate)
    x = torch.nn.functional.pad(torch.from_numpy(samples), (reach, reach + 1))
    offsets = torch.arange(-reach + 1, reach + 1)
    out = torch.empty(n_out, dtype=torch.float32)
    step = max(1, CHUNK_ELEMENTS // len(offsets))
    for start in range(0, n_out, step):
        position = torch.arange(start, min(n_out, start + step), dtype=torch.float64) * (orig_rate / new_rate)
        first = position.floor()
        fraction = (position - first).float()  # float64 only where indices are large
        taps = (first.long()[:, None] + offsets).clamp_(-reach, len(samples) + reach) + reach
        weights = _filter((offsets.float()[None, :] - fraction[:, None]) * scale, scale)
        out[start : start + len(position)] = (x[taps] * weights).sum(1)
    return out.numpy()


def load_reference_audio(source: AudioInput, sample_rate: int) -> np.ndarray:
    samples, rate = read_audio(source)
    return resample(samples, rate, sample_rate)

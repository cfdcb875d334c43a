"""Reading reference audio: any container libsndfile reads, any rate, mono or stereo.

Resampling is a windowed-sinc filter (Hann window, six zero crossings, cut-off at 99% of
the lower Nyquist frequency), written here in numpy so that no audio library beyond
soundfile is needed, and so that the batching server's front end, which resamples responses,
never loads torch. Between rates of a small common ratio (44.1 kHz and 48 kHz: 147/160)
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


def _filter(t: np.ndarray, scale: float) -> np.ndarray:
    """The windowed sinc at `t` (in zero crossings), times the gain `scale`."""
    t = np.clip(t, -ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = np.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    return np.sinc(t) * window * scale  # np.sinc(t) = sin(pi t) / (pi t), 1 at 0


@lru_cache(maxsize=16)
def _kernels(orig: int, new: int) -> tuple[np.ndarray, int]:
    """`new` filters, one per output phase, each over the input samples around it: [taps, new]."""
    cutoff = min(orig, new) * ROLLOFF  # in units of the reduced rates
    width = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = np.arange(-width, width + orig, dtype=np.float64) / orig
    t = (taps[None, :] - np.arange(new, dtype=np.float64)[:, None] / new) * cutoff
    bank = np.ascontiguousarray(_filter(t, cutoff / orig).astype(np.float32).T)
    bank.flags.writeable = False  # shared by every call through the cache
    return bank, width


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Band-limited resampling; output length ceil(len * new / orig)."""
    if orig_rate == new_rate:
        return samples
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    width = math.ceil(ZERO_CROSSINGS * orig / (min(orig, new) * ROLLOFF))
    if new * (2 * width + orig) > FILTER_BANK_LIMIT:
        return _resample_per_sample(samples, orig_rate, new_rate)
    bank, width = _kernels(orig, new)
    x = np.pad(np.asarray(samples, dtype=np.float32), (width, width + orig))
    # Block b of `orig` input samples gives `new` outputs, each a dot product of the taps around
    # it with one filter of the bank: one matrix product over windows copied out contiguously.
    windows = np.lib.stride_tricks.sliding_window_view(x, bank.shape[0])[::orig]
    y = np.ascontiguousarray(windows) @ bank  # [blocks, new]
    return y.reshape(-1)[: math.ceil(new * len(samples) / orig)]


def _resample_per_sample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """The same filter as the polyphase bank, evaluated at each output sample's own position:
    2 * reach taps an output sample, so the cost grows with the audio, not the rates' ratio."""
    scale = min(1.0, new_rate / orig_rate) * ROLLOFF  # the cut-off, in cycles per input sample x 2
    reach = math.ceil(ZERO_CROSSINGS / scale)  # input samples either side of an output sample
    n_out = math.ceil(new_rate * len(samples) / orig_rate)
    x = np.pad(np.asarray(samples, dtype=np.float32), (reach, reach + 1))
    offsets = np.arange(-reach + 1, reach + 1)
    out = np.empty(n_out, dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // len(offsets))
    for start in range(0, n_out, step):
        position = np.arange(start, min(n_out, start + step), dtype=np.float64) * (orig_rate / new_rate)
        first = np.floor(position)
        fraction = (position - first).astype(np.float32)  # float64 only where indices are large
        taps = np.clip(first.astype(np.int64)[:, None] + offsets, -reach, len(samples) + reach) + reach
        weights = _filter((offsets.astype(np.float32)[None, :] - fraction[:, None]) * scale, scale).astype(np.float32)
        out[start : start + len(position)] = (x[taps] * weights).sum(1)
    return out


def load_reference_audio(source: AudioInput, sample_rate: int) -> np.ndarray:
    samples, rate = read_audio(source)
    return resample(samples, rate, sample_rate)

"""Random weights in the official formats, for tests and the checkpoints `write_checkpoint`
makes: every tensor of `model.pth` under its upstream name, the codec's tensors keyed and
weight-normed as upstream's `state_dict()` saves them, and a small byte-level BPE for the tiny
tokenizer."""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from fish_sm.model.codec import Codec, CodecConfig
from fish_sm.model.config import ModelConfig
from fish_sm.model.dual_ar import expected_shapes


def random_model_state_dict(config: ModelConfig, seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of `model.pth` under its upstream name: normal(0,
    initializer_range) for matrices and embeddings, ones for norms, zeros for biases."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, config.initializer_range, generator=gen)
        out[name] = t.to(dtype)
    return out


def _upstream_style(name: str) -> str:
    """Which weight-norm form upstream's own `state_dict()` uses for a parameter."""
    if name.endswith(("in_proj.weight", "out_proj.weight")):
        return "hook"  # dac's WNConv1d: torch.nn.utils.weight_norm -> weight_g / weight_v
    if name.startswith(("encoder.", "decoder.")) and name.endswith(".conv.weight"):
        return "parametrization"  # torch.nn.utils.parametrizations.weight_norm
    return "plain"


_DECODER_UPSAMPLE = re.compile(r"decoder\.model\.\d+\.block\.1\.conv\.weight$")
_RESIDUAL_CLOSE = re.compile(r"\.block\.\d+\.block\.3\.conv\.weight$")  # 1x1 conv ending a residual unit


def build_codec_state_dict(config: CodecConfig, seed: int, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Random float32 weights keyed and weight-normed exactly as upstream's `DAC(...).state_dict()`
    (minus the freqs_cis / causal_mask buffers). Scales keep activations near unit size, so
    decoded audio is finite and spread out and encoded codes vary. `device="meta"` gives shapes only.
    """
    meta = torch.device(device).type == "meta"
    gen = None if meta else torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device)

    def uniform(shape, lo: float, hi: float) -> Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen, device=device)

    with torch.device("meta"):
        names = {name: tuple(p.shape) for name, p in Codec(config).state_dict().items()}
    out: dict[str, Tensor] = {}
    for name, shape in names.items():
        style = _upstream_style(name)
        leaf = name.rsplit(".", 1)[-1]
        if style != "plain":
            # Direction v at an arbitrary scale, gain g sets the row norm (not ||v||, so folding is tested).
            if _DECODER_UPSAMPLE.match(name):  # ConvTranspose1d [in, out, k]: norm per input channel, stride = k/2
                gain = math.sqrt(shape[1] * (shape[2] // 2) / shape[0])
            elif "in_proj" in name:
                gain = 3.0
            elif _RESIDUAL_CLOSE.search(name):
                gain = 0.3  # the 1x1 conv closing a residual branch: keep the residual sums from growing
            elif name.startswith("decoder.") and shape[0] == 1:
                gain = 0.15  # the last conv: land around unit scale before the tanh, not deep in saturation
            else:
                gain = 1.0
            v = randn(*shape) * uniform((), 0.5, 2.0)
            g = gain * uniform((shape[0], 1, 1), 0.8, 1.2)
            if style == "hook":
                out[name[: -len("weight")] + "weight_g"] = g
                out[name[: -len("weight")] + "weight_v"] = v
            else:
                stem = name[: -len("weight")] + "parametrizations.weight."
                out[stem + "original0"] = g
                out[stem + "original1"] = v
        elif leaf == "alpha":
            out[name] = uniform(shape, 0.5, 1.5)
        elif leaf == "gamma":
            out[name] = uniform(shape, 0.05, 0.3)
        elif name.endswith("codebook.weight"):
            out[name] = randn(*shape)
        elif leaf == "bias":
            out[name] = 0.05 * randn(*shape) if not name.endswith("norm.bias") else 0.1 * randn(*shape)
        elif len(shape) == 1:  # RMSNorm / LayerNorm weights
            out[name] = 1.0 + 0.1 * randn(*shape)
        else:  # plain linear / conv weights
            transposed = name.startswith("quantizer.upsample.")
            fan_in = shape[0] if transposed else math.prod(shape[1:])
            out[name] = randn(*shape) / math.sqrt(fan_in)
    return out


def train_byte_bpe(corpus: str, num_merges: int) -> dict[bytes, int]:
    """A small byte-level BPE, for the generated tiny checkpoint: the 256 bytes, then
    the most frequent adjacent pairs in `corpus`, each rank after its parts so that
    tiktoken can reach every merged token."""
    ranks = {bytes([b]): b for b in range(256)}
    words: dict[tuple[bytes, ...], int] = {}
    for w in re.findall(r" ?\w+|[^\w\s]+|\s+", corpus):
        key = tuple(bytes([b]) for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    for _ in range(num_merges):
        pairs: dict[tuple[bytes, bytes], int] = {}
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merged = best[0] + best[1]
        ranks.setdefault(merged, len(ranks))
        new_words = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + n
        words = new_words
    return ranks

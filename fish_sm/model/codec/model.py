"""The S1-mini audio codec (fish-speech's "modded DAC"), inference only, nothing but torch.

    audio 44.1 kHz --causal conv encoder (hop 512)--> latents
        --2x2 strided conv + ConvNeXt--> --window-limited transformer-->
        1 semantic code (4096 entries) + 9 residual codes (1024 entries) per 2048 samples
    codes --codebook sums--> --window-limited transformer--> --2x2 upsample--> --causal conv decoder--> audio

Every layer is causal, so besides whole-sequence `encode`/`decode` a decode can carry each
layer's left context between calls (a `state` dict) and emit exactly the samples a
whole-sequence `decode` would (`engine/codec_stream.py` decodes streams that way).

Parameter names are upstream's state-dict names (`encoder.block.1.block.0.block.1.conv.weight`)
so a checkpoint loads by name; weight norm, which upstream keeps at run time, is folded
into plain conv weights when loading.

One upstream quirk decides a config field: upstream's yaml asks for 4 transformer layers at
the decoder's start, but upstream's `DecoderBlock` builds that transformer and leaves it out
of its layer list, so it has no weights and never runs. `decoder_transformer_layers` is
therefore all zeros here, the only value a checkpoint can show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fish_sm.errors import CheckpointError
from fish_sm.model.codec.config import CodecConfig, select_generator
from fish_sm.model.codec.layers import (CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, ResidualQuantizer,
                                        ResidualUnit, Snake1d, State, Transformer, run_layers)
from fish_sm.model.weights import read_state_dict, take


class EncoderBlock(nn.Module):
    """Three residual units at dim/2, then a strided conv to dim (and optionally a transformer)."""

    def __init__(self, dim: int, stride: int, n_layers: int, config: CodecConfig):
        super().__init__()
        layers = [ResidualUnit(dim // 2, d) for d in (1, 3, 9)]
        layers += [Snake1d(dim // 2), CausalConv1d(dim // 2, dim, 2 * stride, stride=stride)]
        if n_layers:
            layers.append(Transformer(dim, n_layers, 3 * dim, config.encoder_window, config))
        self.block = nn.ModuleList(layers)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        return run_layers(self.block, x, state)


class Encoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        dim = config.encoder_dim
        layers: list[nn.Module] = [CausalConv1d(1, dim, 7)]
        for stride, n_layers in zip(config.encoder_rates, config.encoder_transformer_layers):
            dim *= 2
            layers.append(EncoderBlock(dim, stride, n_layers, config))
        layers += [Snake1d(dim), CausalConv1d(dim, config.latent_dim, 3)]
        self.block = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        return run_layers(self.block, x, None)


class DecoderBlock(nn.Module):
    """Snake, upsampling transposed conv, then three residual units."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.block = nn.ModuleList(
            [Snake1d(c_in), CausalConvTranspose1d(c_in, c_out, 2 * stride, stride)] + [ResidualUnit(c_out, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        return run_layers(self.block, x, state)


class Decoder(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        dim = config.decoder_dim
        layers: list[nn.Module] = [CausalConv1d(config.latent_dim, dim, 7)]
        for i, stride in enumerate(config.decoder_rates):
            layers.append(DecoderBlock(dim // 2**i, dim // 2 ** (i + 1), stride))
        out = dim // 2 ** len(config.decoder_rates)
        layers += [Snake1d(out), CausalConv1d(out, 1, 7)]
        self.model = nn.ModuleList(layers)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        return torch.tanh(run_layers(self.model, x, state))


class Quantizer(nn.Module):
    """Upstream's DownsampleResidualVectorQuantize: 4x fewer steps, transformer, semantic + residual VQ."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        dim = config.quantizer_dim
        self.semantic_quantizer = ResidualQuantizer(dim, 1, config.semantic_codebook_size, config.codebook_dim)
        self.quantizer = ResidualQuantizer(dim, config.n_codebooks, config.codebook_size, config.codebook_dim)
        factors = config.downsample_factor
        self.downsample = nn.ModuleList(nn.ModuleList([CausalConv1d(dim, dim, f, stride=f), ConvNeXtBlock(dim)]) for f in factors)
        self.upsample = nn.ModuleList(nn.ModuleList([CausalConvTranspose1d(dim, dim, f, f), ConvNeXtBlock(dim)]) for f in reversed(factors))
        n, hidden, window = config.quantizer_transformer_layers, config.quantizer_intermediate_size, config.quantizer_window
        self.pre_module = Transformer(dim, n, hidden, window, config) if n else None
        self.post_module = Transformer(dim, n, hidden, window, config) if n else None

    def encode(self, z: Tensor) -> Tensor:
        for stage in self.downsample:
            z = run_layers(stage, z, None)
        if self.pre_module is not None:
            z = self.pre_module(z)
        semantic, z_semantic = self.semantic_quantizer.encode(z)
        residual, _ = self.quantizer.encode(z - z_semantic)
        return torch.cat([semantic, residual], dim=1)

    def decode(self, codes: Tensor, state: State = None) -> Tensor:
        semantic = codes[:, :1].clamp(0, self.semantic_quantizer.quantizers[0].codebook.num_embeddings - 1)
        residual = codes[:, 1:].clamp(0, self.quantizer.quantizers[0].codebook.num_embeddings - 1)
        z = self.semantic_quantizer.decode(semantic) + self.quantizer.decode(residual)
        if self.post_module is not None:
            z = self.post_module(z, state)
        for stage in self.upsample:
            z = run_layers(stage, z, state)
        return z


# ---------------------------------------------------------------------------------------------
# The codec


class Codec(nn.Module):
    """Audio <-> codes. `encode`/`decode` take whole sequences, or (`decode` with a state) go piece by piece."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.sample_rate = config.sample_rate
        self.frame_length = config.frame_length
        self.n_rows = 1 + config.n_codebooks
        self.encoder = Encoder(config)
        self.quantizer = Quantizer(config)
        self.decoder = Decoder(config)

    @property
    def device(self) -> torch.device:
        return self.decoder.model[0].conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.model[0].conv.weight.dtype

    @torch.no_grad()
    def encode(self, audio: Tensor) -> Tensor:
        """audio [B, T] (or [B, 1, T]) at 44.1 kHz -> codes [B, 1 + n_codebooks, ceil(T / frame_length)].

        The audio is zero-padded on the right to whole frames, as upstream does.
        """
        if audio.dim() == 3 and audio.shape[1] == 1:
            audio = audio[:, 0]
        if audio.dim() != 2:
            raise ValueError(f"codec.encode wants audio [batch, samples], got shape {tuple(audio.shape)}")
        b, t = audio.shape
        frames = -(-t // self.frame_length)
        if frames == 0:
            return torch.zeros(b, self.n_rows, 0, dtype=torch.long, device=audio.device)
        x = F.pad(audio.to(self.device, self.dtype), (0, frames * self.frame_length - t))[:, None]
        return self.quantizer.encode(self.encoder(x))

    @torch.no_grad()
    def decode(self, codes: Tensor, state: State = None) -> Tensor:
        """codes [B, 1 + n_codebooks, n] -> audio [B, n * frame_length]. Out-of-range codes are clamped.
        `state`: a dict carried from one call to the next, each continuing the sequence where
        the last stopped (each causal layer's left context, the transformer's KV cache); None,
        a whole sequence."""
        self.check_codes(codes)
        if codes.shape[-1] == 0:
            return self.decoder.model[0].conv.weight.new_zeros(codes.shape[0], 0)
        z = self.decode_front(codes.to(self.device).long(), state)
        return self.decoder(z, state)[:, 0]

    def decode_front(self, codes: Tensor, state: State = None) -> Tensor:
        """The decode up to the conv decoder (`decoder`): the codebook sums, the window-limited
        transformer and the upsampling. codes [B, 1 + n_codebooks, n] (long, on the codec's
        device) -> latents [B, latent_dim, n * frame_length / hop_length]."""
        return self.quantizer.decode(codes, state)

    def front_state_bounded(self) -> bool:
        """What `decode_front` carries in a state stays bounded: it has no transformer, or one
        that attends over a window."""
        post = self.quantizer.post_module
        return post is None or post.window is not None

    def front_rope(self, positions: int) -> Optional[Tensor]:
        """The front transformer's RoPE table, sized now for `positions` positions (for graphs
        that read it: it regrows only when a later position needs it); None without one."""
        post = self.quantizer.post_module
        if post is None:
            return None
        post.rope(0, positions, self.device)
        return post.table

    def check_codes(self, codes: Tensor) -> None:
        """Raise ValueError unless `codes` is an integer tensor [B, 1 + n_codebooks, n]."""
        if codes.dim() != 3 or codes.shape[1] != self.n_rows:
            raise ValueError(f"codec wants codes [batch, {self.n_rows}, frames], got shape {tuple(codes.shape)}")
        if codes.is_floating_point() or codes.is_complex():
            raise ValueError(f"codec wants integer codes, got {codes.dtype}")


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _weight_norm(v: Tensor, g: Tensor) -> Tensor:
    """g * v / ||v|| with the norm over all dims but 0: the op upstream's weight norm runs."""
    if v.dtype not in (torch.float32, torch.float64):
        v, g = v.float(), g.float()
    if hasattr(torch, "_weight_norm"):  # the exact kernel both torch weight-norm styles call
        return torch._weight_norm(v, g, 0)
    return v * (g / v.flatten(1).norm(dim=1).view(-1, *[1] * (v.dim() - 1)))


def fold_weight_norm(weights: dict[str, Tensor], source: str = "codec state dict") -> dict[str, Tensor]:
    """Replace `X.weight_g`/`X.weight_v` and `X.parametrizations.weight.original0/1` pairs by `X.weight`."""
    styles = ((".weight_g", ".weight_v"), (".parametrizations.weight.original0", ".parametrizations.weight.original1"))
    out = {}
    for name, t in weights.items():
        for g_suffix, v_suffix in styles:
            if name.endswith(v_suffix):
                break  # handled with its g
            if name.endswith(g_suffix):
                stem = name[: -len(g_suffix)]
                v = weights.get(stem + v_suffix)
                if v is None:
                    raise CheckpointError(f"{source}: missing tensor {stem + v_suffix} (weight-norm direction for {name})")
                if tuple(t.shape) != (v.shape[0],) + (1,) * (v.dim() - 1):
                    raise CheckpointError(f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {(v.shape[0],) + (1,) * (v.dim() - 1)}")
                out[stem + ".weight"] = _weight_norm(v, t)
                break
        else:
            out[name] = t
    for name in weights:
        for g_suffix, v_suffix in styles:
            if name.endswith(v_suffix) and name[: -len(v_suffix)] + g_suffix not in weights:
                raise CheckpointError(f"{source}: missing tensor {name[: -len(v_suffix)] + g_suffix} (weight-norm gain for {name})")
    return out


def codec_from_state_dict(
    weights: dict[str, Tensor],
    config: Optional[CodecConfig] = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "codec state dict",
) -> Codec:
    """Build an inference-ready codec from upstream-layout weights (any weight-norm style, or folded).

    The config is inferred from the shapes unless given. Keys upstream would ignore
    (RoPE/mask buffers, discriminator, anything unknown) are ignored here too.
    """
    weights = fold_weight_norm(select_generator(weights), source)
    if config is None:
        config = CodecConfig.from_state_dict(weights)
    with torch.device("meta"):
        codec = Codec(config)
    tensors = {
        name: take(weights, name, tuple(p.shape), source).to(device=device, dtype=dtype)
        for name, p in codec.state_dict().items()
    }
    codec.load_state_dict(tensors, assign=True)
    return codec.eval().requires_grad_(False)


def load_codec(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Codec:
    """Load `codec.pth` (or `.safetensors`) as shipped with S1-mini; the config comes from the shapes."""
    return codec_from_state_dict(read_state_dict(path), device=device, dtype=dtype, source=str(path))

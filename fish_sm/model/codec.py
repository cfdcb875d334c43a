"""The S1-mini audio codec (fish-speech's "modded DAC"), inference only, nothing but torch.

    audio 44.1 kHz --causal conv encoder (hop 512)--> latents
        --2x2 strided conv + ConvNeXt--> --window-limited transformer-->
        1 semantic code (4096 entries) + 9 residual codes (1024 entries) per 2048 samples
    codes --codebook sums--> --window-limited transformer--> --2x2 upsample--> --causal conv decoder--> audio

Every layer is causal (convs pad on the left, transposed convs are trimmed on the right,
attention only looks back), so besides whole-sequence `encode`/`decode` there is a
`StreamingDecoder` that keeps each layer's left context between calls and emits exactly
the samples a whole-sequence `decode` would.

Parameter names are upstream's state-dict names (`encoder.block.1.block.0.block.1.conv.weight`)
so a checkpoint loads by name; weight norm, which upstream keeps at run time, is folded
into plain conv weights when loading.

One upstream quirk decides a config field: upstream's yaml asks for 4 transformer layers at
the decoder's start, but upstream's `DecoderBlock` builds that transformer and leaves it out
of its layer list, so it has no weights and never runs. `decoder_transformer_layers` is
therefore all zeros here, the only value a checkpoint can show.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fish_sm.errors import CheckpointError, ConfigError
from fish_sm.model.layers import RMSNorm, apply_rope, rope_table
from fish_sm.model.weights import read_state_dict, take

__all__ = [
    "CodecConfig",
    "Codec",
    "StreamingDecoder",
    "load_codec",
    "codec_from_state_dict",
    "build_codec_state_dict",
    "fold_weight_norm",
]

State = Optional[dict]  # streaming state: {module: that module's carried context}; None = whole sequence


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class CodecConfig:
    """Shape of the codec. Defaults are upstream's `modded_dac_vq.yaml` (the real S1-mini codec)."""

    sample_rate: int = 44100
    encoder_dim: int = 64  # channels after the first conv; doubled by each encoder block
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int = 1024  # encoder output = quantizer input = decoder input
    decoder_dim: int = 1536  # channels after the first decoder conv; halved by each block
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)  # transformer after each encoder block
    decoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 0)  # inert upstream, see module docstring
    quantizer_dim: int = 1024
    n_codebooks: int = 9  # residual codebooks
    codebook_size: int = 1024  # entries per residual codebook
    semantic_codebook_size: int = 4096
    codebook_dim: int = 8  # the nearest-neighbour search runs in this small space
    downsample_factor: tuple[int, ...] = (2, 2)
    quantizer_transformer_layers: int = 8  # pre_module and post_module each
    quantizer_intermediate_size: int = 3072
    # Constants upstream fixes in code or yaml; shapes cannot tell them.
    encoder_window: Optional[int] = 512  # attention window of the encoder transformers (latent steps)
    quantizer_window: Optional[int] = 128  # attention window of pre/post modules (code frames)
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("encoder_rates", "decoder_rates", "encoder_transformer_layers", "decoder_transformer_layers", "downsample_factor"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if len(self.encoder_transformer_layers) != len(self.encoder_rates):
            raise ConfigError("codec: encoder_transformer_layers needs one entry per encoder rate")
        if any(self.decoder_transformer_layers):
            raise ConfigError(
                "codec: decoder_transformer_layers must be all zeros: upstream builds that transformer "
                "but never runs it, so no checkpoint has weights for it"
            )
        if self.quantizer_dim != self.latent_dim:
            raise ConfigError(f"codec: quantizer_dim {self.quantizer_dim} must equal latent_dim {self.latent_dim}")
        if math.prod(self.decoder_rates) != math.prod(self.encoder_rates):
            raise ConfigError("codec: the decoder must upsample by as much as the encoder downsamples")
        dims = [self.encoder_dim * 2 ** (i + 1) for i in range(len(self.encoder_rates))]
        for dim, n in zip(dims, self.encoder_transformer_layers):
            if n and dim % self.head_dim:
                raise ConfigError(f"codec: an encoder transformer of width {dim} needs a multiple of head_dim {self.head_dim}")
        if self.quantizer_transformer_layers and self.quantizer_dim % self.head_dim:
            raise ConfigError(f"codec: quantizer_dim {self.quantizer_dim} must be a multiple of head_dim {self.head_dim}")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ConfigError(f"codec: decoder_dim {self.decoder_dim} must halve {len(self.decoder_rates)} times")

    @property
    def hop_length(self) -> int:
        """Audio samples per encoder latent step (512)."""
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        """Audio samples per code frame (2048): the encoder hop times the quantizer's downsampling."""
        return self.hop_length * math.prod(self.downsample_factor)

    @classmethod
    def s1_mini(cls) -> "CodecConfig":
        return cls()

    @classmethod
    def tiny(cls) -> "CodecConfig":
        """Small widths for CPU tests, but the real hop (2048) and token layout (4096 + 9 x 1024)."""
        return cls(
            encoder_dim=8,
            latent_dim=128,
            decoder_dim=128,
            encoder_transformer_layers=(0, 0, 0, 1),
            quantizer_dim=128,
            quantizer_transformer_layers=1,
            quantizer_intermediate_size=384,
        )

    @classmethod
    def from_state_dict(cls, weights: dict[str, Tensor]) -> "CodecConfig":
        """Read every shape-given field from tensor names and shapes (codec.pth ships without a config).

        Accepts upstream's raw layout (either weight-norm style, optional `generator.` prefix)
        as well as folded weights; tensors may live on the `meta` device.
        """
        weights = _select_generator(weights)

        def shape(prefix: str) -> Optional[tuple[int, ...]]:
            for suffix in (".weight", ".parametrizations.weight.original1", ".weight_v"):
                if prefix + suffix in weights:
                    return tuple(weights[prefix + suffix].shape)
            return None

        def count(fmt: str) -> int:
            n = 0
            while any(k.startswith(fmt.format(n)) for k in weights):
                n += 1
            return n

        def need(prefix: str) -> tuple[int, ...]:
            """Shape of `prefix.weight` (in any weight-norm form), which the layout cannot do without."""
            found = shape(prefix)
            if found is None:
                raise CheckpointError(f"codec state dict: missing tensor {prefix}.weight, needed to infer the codec's shape")
            return found

        if shape("encoder.block.0.conv") is None:
            raise CheckpointError(
                "not a codec state dict: it has no encoder.block.0.conv weight "
                f"(it starts with: {', '.join(list(weights)[:3]) or 'nothing'})"
            )
        first = need("encoder.block.0.conv")
        rates, enc_layers = [], []
        while (s := shape(f"encoder.block.{len(rates) + 1}.block.4.conv")) is not None:
            rates.append(s[-1] // 2)
            enc_layers.append(count(f"encoder.block.{len(rates)}.block.5.layers.{{}}."))
        last = need(f"encoder.block.{len(rates) + 2}.conv")
        dec_first = need("decoder.model.0.conv")
        dec_rates = []
        while (s := shape(f"decoder.model.{len(dec_rates) + 1}.block.1.conv")) is not None:
            dec_rates.append(s[-1] // 2)
        factors = []
        while (s := shape(f"quantizer.downsample.{len(factors)}.0.conv")) is not None:
            factors.append(s[-1])
        sem = need("quantizer.semantic_quantizer.quantizers.0.codebook")
        res = need("quantizer.quantizer.quantizers.0.codebook")
        in_proj = need("quantizer.semantic_quantizer.quantizers.0.in_proj")
        q_layers = count("quantizer.pre_module.layers.{}.")
        if count("quantizer.post_module.layers.{}.") != q_layers:
            raise CheckpointError("codec state dict: quantizer pre_module and post_module have different layer counts")
        hidden = need("quantizer.pre_module.layers.0.feed_forward.w1")[0] if q_layers else cls.quantizer_intermediate_size
        try:
            return cls(
                encoder_dim=first[0],
                encoder_rates=tuple(rates),
                latent_dim=last[0],
                decoder_dim=dec_first[0],
                decoder_rates=tuple(dec_rates),
                encoder_transformer_layers=tuple(enc_layers),
                decoder_transformer_layers=(0,) * len(dec_rates),
                quantizer_dim=in_proj[1],
                n_codebooks=count("quantizer.quantizer.quantizers.{}."),
                codebook_size=res[0],
                semantic_codebook_size=sem[0],
                codebook_dim=sem[1],
                downsample_factor=tuple(factors),
                quantizer_transformer_layers=q_layers,
                quantizer_intermediate_size=hidden,
            )
        except (ConfigError, IndexError) as exc:
            raise CheckpointError(f"codec state dict has inconsistent shapes: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Convolutions (all causal; each takes an optional streaming state)


class Snake1d(nn.Module):
    """Periodic activation x + sin(alpha x)^2 / alpha, one alpha per channel (from DAC)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        alpha = self.alpha if x.dim() == 3 else self.alpha[..., None]  # [B, C, 1, T]: see `conv_2d`
        # Same op order as upstream so results round identically.
        return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def conv_2d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, dilation: int = 1, groups: int = 1) -> Tensor:
    """A streaming conv over [B, C, T], or over [B, C, 1, T] as a 2-D conv of height 1: in
    channels-last memory, cuDNN's kernels then read and write it as they are, where 1-D
    convs convert every input and output between layouts (the batching codec's back: 12%
    faster on an H100). `weight`: 1-D, or already 2-D (see `prepare_2d`); a dilated conv's
    2-D weight with its taps along the height runs as `_dilated_as_phases`."""
    if x.dim() == 3:
        return F.conv1d(x, weight, bias, dilation=dilation, groups=groups)
    if weight.dim() == 3:
        weight = weight[:, :, None]
    if dilation > 1 and weight.shape[-1] == 1 and weight.shape[-2] > 1:
        return _dilated_as_phases(x, weight, bias, dilation, groups)
    return F.conv2d(x, weight, bias, dilation=(1, dilation), groups=groups)


def _dilated_as_phases(x: Tensor, weight: Tensor, bias: Optional[Tensor], dilation: int, groups: int) -> Tensor:
    """A conv of dilation d over [B, C, 1, T] as an undilated one over [B, C, T/d, d]: column r
    holds samples r, r + d, r + 2d..., so taps one row apart are d samples apart. In
    channels-last memory both shapes are views of the same [B, T, C] buffer (after padding T
    to a multiple of d; the outputs that read the padding are dropped). cuDNN has no NHWC
    kernel for dilated convs: it ran them through NCHW kernels and layout conversions, 40% of
    the batching codec's conv time on an H100 (docs/benchmarks.md, fourteenth pass).
    `weight` [C_out, C_in / groups, taps, 1]."""
    n = x.shape[-1]
    rows = (n + dilation - 1) // dilation
    x = F.pad(x, (0, rows * dilation - n)).flatten(2).unflatten(-1, (rows, dilation))
    y = F.conv2d(x, weight, bias, groups=groups).flatten(2)[:, :, None]
    return y[..., : n - (weight.shape[-2] - 1) * dilation]


def _with_context(owner: nn.Module, x: Tensor, state: dict, n: int) -> Tensor:
    """A streaming conv's input with the `n` inputs before it in front (zeros at a stream's
    start), its own last `n` kept in `state[owner]` for the next call."""
    if not n:
        return x
    context = state.get(owner)
    if context is None:
        context = x.new_zeros(*x.shape[:-1], n)
    x = torch.cat([context, x], dim=-1)
    # A copy, not a view: a view would keep this call's whole input alive as long as the
    # state (in a captured graph, for good: 13 GiB of a batching server's graph pool).
    state[owner] = x[..., -n:].clone()
    return x


class CausalConv1d(nn.Module):
    """Conv padded only on the left, so output t sees inputs up to t (upstream `CausalConvNet`)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.left = (kernel - 1) * dilation + 1 - stride
        self.weight_2d: Optional[Tensor] = None  # see `prepare_2d`

    def prepare_2d(self) -> None:
        """Keep a channels-last copy of the weight for streaming over [B, C, 1, T] (a dilated
        conv's with its taps along the height: see `conv_2d`)."""
        w = self.conv.weight[:, :, None]
        if self.conv.dilation[0] > 1:
            w = w.transpose(2, 3)
        self.weight_2d = w.contiguous(memory_format=torch.channels_last)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        if state is None:
            # Upstream also pads on the right up to a whole number of strides.
            return self.conv(F.pad(x, (self.left, -x.shape[-1] % self.stride)))
        assert self.stride == 1, "streaming only runs stride-1 convs"
        x = _with_context(self, x, state, self.left)
        weight = self.weight_2d if x.dim() == 4 and self.weight_2d is not None else self.conv.weight
        return conv_2d(x, weight, self.conv.bias, self.conv.dilation[0], self.conv.groups)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv trimmed on the right, so output sample t only needs inputs up to t // stride."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.stride = stride
        self.taps = -(-kernel // stride)  # inputs each output sample sees
        self.phases_2d: Optional[Tensor] = None  # see `prepare_2d`

    def prepare_2d(self) -> None:
        """Keep `phases` as a channels-last 2-D weight for streaming over [B, C, 1, T]."""
        self.phases_2d = self.phases()[:, :, None].contiguous(memory_format=torch.channels_last)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        n = x.shape[-1] * self.stride
        if state is None:
            return self.conv(x)[..., :n]
        # Streaming, as `stride` interleaved ordinary convs of `taps` inputs (the same sums):
        # output t * stride + r is sum_j x[t - j] W[:, :, r + j * stride]. cuDNN runs this as
        # a forward conv, where a transposed conv is its slower backward-data kernel (~6x the
        # time per FLOP in the batching codec's back), and the carried state is the last
        # taps - 1 inputs, like a causal conv's.
        x = _with_context(self, x, state, self.taps - 1)
        y = conv_2d(x, self.phases_2d if x.dim() == 4 and self.phases_2d is not None else self.phases())
        # Phase-major channels: over channels-last [B, C, 1, T] this interleave is a view, so
        # the block after it stays channels-last (cuDNN converts no layouts around its convs).
        y = y.unflatten(1, (self.stride, -1)).movedim(1, -1).flatten(-2)
        return y + self.conv.bias.view(-1, *[1] * (y.dim() - 2))

    def phases(self) -> Tensor:
        """The weight as an ordinary conv's, [stride * c_out, c_in, taps]: row r * c_out + c is
        output channel c's phase r, tap k reads the input taps - 1 - k steps back."""
        w = self.conv.weight  # [c_in, c_out, kernel]
        c_in, c_out, kernel = w.shape
        w = F.pad(w, (0, self.taps * self.stride - kernel)).view(c_in, c_out, self.taps, self.stride)
        return w.permute(3, 1, 0, 2).flip(-1).reshape(self.stride * c_out, c_in, self.taps)


def _run(layers: nn.ModuleList, x: Tensor, state: State) -> Tensor:
    for layer in layers:
        x = layer(x, state)
    return x


class ResidualUnit(nn.Module):
    """Snake, dilated k=7 conv, Snake, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.ModuleList([Snake1d(dim), CausalConv1d(dim, dim, 7, dilation=dilation), Snake1d(dim), CausalConv1d(dim, dim, 1)])

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        return x + _run(self.block, x, state)


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
        return _run(self.block, x, state)


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
        return _run(self.block, x, None)


class DecoderBlock(nn.Module):
    """Snake, upsampling transposed conv, then three residual units."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.block = nn.ModuleList(
            [Snake1d(c_in), CausalConvTranspose1d(c_in, c_out, 2 * stride, stride)] + [ResidualUnit(c_out, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        return _run(self.block, x, state)


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
        return torch.tanh(_run(self.model, x, state))


# ---------------------------------------------------------------------------------------------
# Transformer (gpt-fast style, causal, optionally window-limited)


def window_mask(q_pos: Tensor, k_pos: Tensor, window: Optional[int]) -> Tensor:
    """[1, 1, Tq, Tk] bool (or [B, 1, Tq, Tk] for positions [B, Tq] and [B, Tk], one row each):
    a query sees keys at or before it, and only the last `window` of them."""
    seen = k_pos[..., None, :] <= q_pos[..., :, None]
    if window is not None:
        seen &= k_pos[..., None, :] > q_pos[..., :, None] - window
    return seen.unsqueeze(-3) if seen.dim() == 3 else seen[None, None]


class LayerScale(nn.Module):
    """Per-channel gain on a residual branch (a module only so the name matches `....gamma`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class KVCache:
    """Keys/values of positions already seen; a window-limited layer keeps only the last window-1."""

    def __init__(self, keep: Optional[int]):
        self.keep = keep
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        drop = 0 if self.keep is None else max(0, k.shape[2] - self.keep)
        self.k, self.v = k[:, :, drop:], v[:, :, drop:]
        return k, v


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, cache: Optional[KVCache]) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split(self.n_head * self.head_dim, dim=-1)
        q = apply_rope(q.view(b, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(b, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(k, v)
        # Contiguous k/v, as upstream's (no-op) head repeat leaves them: same kernels, same rounding.
        y = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(b, t, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, config: CodecConfig):
        super().__init__()
        self.attention = Attention(dim, dim // config.head_dim, config.head_dim)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, config.norm_eps)
        self.ffn_norm = RMSNorm(dim, config.norm_eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, cache: Optional[KVCache]) -> Tensor:
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), rope, mask, cache))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    """Causal transformer over [B, C, T] (channels first, like the convs around it).

    With a streaming state it keeps a KV cache per layer and the next position, so a chunk
    attends to the same keys it would in a whole-sequence pass.
    """

    def __init__(self, dim: int, n_layers: int, hidden: int, window: Optional[int], config: CodecConfig):
        super().__init__()
        self.window = window
        self.head_dim, self.rope_base = config.head_dim, config.rope_base
        self.layers = nn.ModuleList(TransformerBlock(dim, hidden, config) for _ in range(n_layers))
        self.norm = RMSNorm(dim, config.norm_eps)
        self._rope: Optional[Tensor] = None  # grown on demand, not a buffer (not in the state dict)

    def rope(self, start: int, length: int, device: torch.device) -> Tensor:
        end = start + length
        if self._rope is None or self._rope.shape[0] < end or self._rope.device != device:
            self._rope = rope_table(max(4096, 1 << (end - 1).bit_length()), self.head_dim, self.rope_base).to(device)
        return self._rope[start:end]

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        x = x.transpose(1, 2)
        t = x.shape[1]
        if state is None:
            start, caches = 0, [None] * len(self.layers)
            k_pos = torch.arange(t, device=x.device)
        else:
            if self not in state:
                keep = None if self.window is None else self.window - 1
                state[self] = (0, [KVCache(keep) for _ in self.layers])
            start, caches = state[self]
            if isinstance(start, Tensor):
                return self._rows(x, start, caches, state)
            past = len(caches[0]) if caches else 0
            k_pos = torch.arange(start - past, start + t, device=x.device)
            state[self] = (start + t, caches)
        mask = window_mask(torch.arange(start, start + t, device=x.device), k_pos, self.window)
        rope = self.rope(start, t, x.device)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, mask, cache)
        return self.norm(x).transpose(1, 2)

    def _rows(self, x: Tensor, start: Tensor, caches: list[KVCache], state: State) -> Tensor:
        """Each row at its own position (`start` [B]), as one graph replays streams at any
        point of their utterances: RoPE rows gathered and the window mask built on the GPU.
        The caches hold `past` keys before each row's start; those before position 0 (a
        cache padded on the left) are masked out. The caller sizes the RoPE table first."""
        t, past = x.shape[1], len(caches[0])
        offsets = torch.arange(-past, t, device=x.device)
        k_pos = start[:, None] + offsets
        q_pos = k_pos[:, past:]
        mask = window_mask(q_pos, k_pos, self.window) & (k_pos >= 0)[:, None, None, :]
        rope = self._rope[q_pos]
        state[self] = (start + t, caches)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, mask, cache)
        return self.norm(x).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Quantizer


class ConvNeXtBlock(nn.Module):
    """Depthwise causal k=7 conv, LayerNorm, 4x MLP with GELU, scaled residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        y = self.dwconv(x, state).permute(0, 2, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 2, 1)


class VectorQuantizer(nn.Module):
    """One codebook: project to codebook_dim, pick the nearest entry by cosine, project back."""

    def __init__(self, dim: int, size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.codebook = nn.Embedding(size, codebook_dim)

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z [B, D, T] -> (codes [B, T], their reconstruction [B, D, T])."""
        z_e = self.in_proj(z)
        b, d, t = z_e.shape
        e = F.normalize(z_e.permute(0, 2, 1).reshape(b * t, d))
        c = F.normalize(self.codebook.weight)
        # Upstream's squared-distance form (not just e @ c.T) so near-ties resolve identically.
        dist = e.pow(2).sum(1, keepdim=True) - 2 * e @ c.t() + c.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(b, t)
        z_q = self.codebook(codes).transpose(1, 2)
        z_q = z_e + (z_q - z_e)  # upstream's straight-through arithmetic; kept for bit-identical residuals
        return codes, self.out_proj(z_q)

    def dequantize(self, codes: Tensor) -> Tensor:
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class ResidualQuantizer(nn.Module):
    """Codebooks applied in turn, each to what the previous ones left unexplained."""

    def __init__(self, dim: int, n_codebooks: int, size: int, codebook_dim: int):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantizer(dim, size, codebook_dim) for _ in range(n_codebooks))

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor]:
        residual, z_q, codes = z, 0, []
        for q in self.quantizers:
            c, z_i = q.quantize(residual)
            z_q = z_q + z_i
            residual = residual - z_i
            codes.append(c)
        return torch.stack(codes, dim=1), z_q

    def decode(self, codes: Tensor) -> Tensor:
        z = 0.0
        for i, q in enumerate(self.quantizers):
            z = z + q.dequantize(codes[:, i])
        return z


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
            z = _run(stage, z, None)
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
            z = _run(stage, z, state)
        return z


# ---------------------------------------------------------------------------------------------
# The codec


class Codec(nn.Module):
    """Audio <-> codes. `encode`/`decode` take whole sequences; `streaming_decoder` goes chunk by chunk."""

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
    def _param(self) -> Tensor:
        return self.decoder.model[0].conv.weight

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
        x = F.pad(audio.to(self._param), (0, frames * self.frame_length - t))[:, None]
        return self.quantizer.encode(self.encoder(x))

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, 1 + n_codebooks, n] -> audio [B, n * frame_length]. Out-of-range codes are clamped."""
        self._check_codes(codes)
        if codes.shape[-1] == 0:
            return self._param.new_zeros(codes.shape[0], 0)
        return self._decode(codes, None)

    def streaming_decoder(self, batch_size: int = 1) -> "StreamingDecoder":
        return StreamingDecoder(self, batch_size)

    def _decode(self, codes: Tensor, state: State) -> Tensor:
        z = self.quantizer.decode(codes.to(self._param.device).long(), state)
        return self.decoder(z, state)[:, 0]

    def _check_codes(self, codes: Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.n_rows:
            raise ValueError(f"codec wants codes [batch, {self.n_rows}, frames], got shape {tuple(codes.shape)}")
        if codes.is_floating_point() or codes.is_complex():
            raise ValueError(f"codec wants integer codes, got {codes.dtype}")


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
        self.codec._check_codes(codes)
        if codes.shape[0] != self.batch_size:
            raise ValueError(f"streaming decoder was made for batch {self.batch_size}, got {codes.shape[0]}")
        if codes.shape[-1] == 0:
            return self.codec._param.new_zeros(self.batch_size, 0)
        self.frames += codes.shape[-1]
        return self.codec._decode(codes, self._state)

    def reset(self) -> None:
        """Start a new utterance."""
        self.frames = 0
        self._state = {}


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _select_generator(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Training checkpoints hold `generator.` and `discriminator.` keys; keep the generator's, unprefixed."""
    if any(k.startswith("generator.") for k in weights):
        return {k[len("generator.") :]: v for k, v in weights.items() if k.startswith("generator.")}
    return weights


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
    weights = fold_weight_norm(_select_generator(weights), source)
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


# ---------------------------------------------------------------------------------------------
# Random weights in upstream's exact layout (tests, tiny checkpoints)


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

"""The codec's shape (`CodecConfig`): upstream's `modded_dac_vq.yaml` by default, or read from a
state dict's tensor names and shapes (codec.pth ships without a config)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from fish_sm.errors import CheckpointError, ConfigError


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
        weights = select_generator(weights)

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


def select_generator(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Training checkpoints hold `generator.` and `discriminator.` keys; keep the generator's, unprefixed."""
    if any(k.startswith("generator.") for k in weights):
        return {k[len("generator.") :]: v for k, v in weights.items() if k.startswith("generator.")}
    return weights

"""Our codec against upstream fish-speech 0.1.0's modded DAC, built for the tiny config as
`modded_dac_vq.yaml` builds the real one, on identical random weights, in float32."""

import functools
import math
import warnings

import pytest
import torch

from fish_speech.models.dac.modded_dac import DAC, ModelArgs, WindowLimitedTransformer, precompute_freqs_cis
from fish_speech.models.dac.rvq import DownsampleResidualVectorQuantize
from fish_sm.model.codec import CodecConfig, codec_from_state_dict
from fish_sm.model.layers import rope_table
from fish_sm.model.random_weights import build_codec_state_dict

TINY = CodecConfig.tiny()
BUFFERS = ("freqs_cis", "causal_mask")


def upstream_dac(c: CodecConfig) -> DAC:
    """What hydra makes of modded_dac_vq.yaml, with the tiny config's sizes.

    block_size (the RoPE/mask buffer length) is cut from the yaml's 16384 to 4096: it only
    caps the sequence length, the values position by position are the same.
    """
    general = functools.partial(
        ModelArgs, block_size=4096, n_local_heads=-1, head_dim=c.head_dim, rope_base=c.rope_base,
        norm_eps=c.norm_eps, dropout_rate=0.1, attn_dropout_rate=0.1, channels_first=True,
    )

    def window_transformer():
        args = general(
            n_layer=c.quantizer_transformer_layers, n_head=c.quantizer_dim // c.head_dim,
            dim=c.quantizer_dim, intermediate_size=c.quantizer_intermediate_size,
        )
        return WindowLimitedTransformer(causal=True, window_size=c.quantizer_window, input_dim=c.quantizer_dim, config=args)

    with warnings.catch_warnings():  # dac's WNConv1d uses torch's deprecated weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        quantizer = DownsampleResidualVectorQuantize(
            input_dim=c.quantizer_dim, n_codebooks=c.n_codebooks, codebook_size=c.codebook_size,
            codebook_dim=c.codebook_dim, quantizer_dropout=0.5, downsample_factor=list(c.downsample_factor),
            pre_module=window_transformer(), post_module=window_transformer(),
            semantic_codebook_size=c.semantic_codebook_size,
        )
    return DAC(
        encoder_dim=c.encoder_dim, encoder_rates=list(c.encoder_rates), latent_dim=None,
        decoder_dim=c.decoder_dim, decoder_rates=list(c.decoder_rates), quantizer=quantizer,
        sample_rate=c.sample_rate, causal=True,
        encoder_transformer_layers=list(c.encoder_transformer_layers),
        decoder_transformer_layers=[1, 0, 0, 0],  # as the yaml asks (scaled down); upstream never wires it in
        transformer_general_config=general,
    )


@pytest.fixture(scope="module")
def pair():
    weights = build_codec_state_dict(TINY, seed=1)
    up = upstream_dac(TINY)
    result = up.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(k.endswith(BUFFERS) for k in result.missing_keys)
    up.eval()
    return codec_from_state_dict(weights), up


def test_state_dict_layout_is_upstreams(pair):
    _, up = pair
    theirs = {k: tuple(v.shape) for k, v in up.state_dict().items() if not k.endswith(BUFFERS)}
    ours = {k: tuple(v.shape) for k, v in build_codec_state_dict(TINY, seed=0, device="meta").items()}
    assert ours == theirs
    assert not any(k.startswith("decoder.") and ".layers." in k for k in theirs)  # the decoder transformer is inert


def test_rope_table_is_upstreams():
    assert torch.equal(rope_table(4096, 64, 10000.0), precompute_freqs_cis(4096, 64, 10000))


def random_codes(frames: int, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, TINY.semantic_codebook_size, (batch, 1, frames), generator=g)
    residual = torch.randint(0, TINY.codebook_size, (batch, TINY.n_codebooks, frames), generator=g)
    return torch.cat([semantic, residual], dim=1)


def test_decode_matches_upstream(pair):
    ours, up = pair
    frames = 140  # past the quantizer transformers' 128-frame window
    codes = random_codes(frames, batch=2, seed=0)
    with torch.no_grad():
        theirs, lengths = up.decode(codes, torch.tensor([frames, frames]))
    mine = ours.decode(codes)
    assert theirs.shape == (2, 1, frames * 2048) and lengths.tolist() == [frames * 2048] * 2
    diff = (mine - theirs[:, 0]).abs().max().item()
    print(f"\ncodec decode vs upstream: max abs diff {diff:.3g} over {mine.numel()} samples (audio std {mine.std():.3f})")
    assert diff < 1e-4

    state: dict = {}  # each causal layer's left context, carried from one piece to the next
    with torch.no_grad():
        streamed = torch.cat([ours.decode(codes[:, :, i : i + 7], state) for i in range(0, frames, 7)], dim=-1)
    diff = (streamed - theirs[:, 0]).abs().max().item()
    print(f"codec streaming decode (7-frame chunks) vs upstream: max abs diff {diff:.3g}")
    assert diff < 1e-4


def two_voices(seconds: float = 7.0, seed: int = 0) -> torch.Tensor:
    """Two deterministic voices: sums of sines (one gliding) plus a little noise, [2, samples]."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 44100) + 123) / 44100
    a = 0.3 * torch.sin(2 * math.pi * 220 * t) + 0.2 * torch.sin(2 * math.pi * 1375 * t * (1 + 0.1 * t)) + 0.05 * torch.randn(t.shape, generator=g)
    b = 0.2 * torch.sin(2 * math.pi * 440 * t) + 0.1 * torch.sin(2 * math.pi * 3000 * t) + 0.1 * torch.randn(t.shape, generator=g)
    return torch.stack([a, b])


def test_encode_matches_upstream(pair):
    ours, up = pair
    audio = two_voices()  # 7 s: past the encoder transformer's 512-step and the quantizer's 128-frame windows
    with torch.no_grad():
        theirs, lengths = up.encode(audio)
    mine = ours.encode(audio)
    frames = math.ceil(audio.shape[-1] / 2048)
    assert mine.shape == theirs.shape == (2, 10, frames) and lengths.tolist() == [frames]
    mismatches = (mine != theirs).sum().item()
    print(f"\ncodec encode vs upstream: {mismatches} of {mine.numel()} codes differ; distinct codes per row {[mine[0, r].unique().numel() for r in range(10)]}")
    assert torch.equal(mine, theirs)

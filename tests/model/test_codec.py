"""The codec on its own (no upstream): shapes, config inference, loading in every form the
official checkpoint may come in, errors that name the tensor, and streaming == whole decode."""

import dataclasses
import math
import re
import subprocess
import sys

import pytest
import torch

from fish_sm.errors import CheckpointError, ConfigError
from fish_sm.model.codec import Codec, CodecConfig, codec_from_state_dict, fold_weight_norm, load_codec
from fish_sm.model.codec.layers import CausalConv1d, ResidualUnit
from fish_sm.model.random_weights import build_codec_state_dict
from fish_sm.model.weights import write_safetensors

TINY = CodecConfig.tiny()


@pytest.fixture(scope="module")
def weights():
    return build_codec_state_dict(TINY, seed=0)


@pytest.fixture(scope="module")
def codec(weights):
    return codec_from_state_dict(weights)


def random_codes(frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, TINY.semantic_codebook_size, (batch, 1, frames), generator=g)
    residual = torch.randint(0, TINY.codebook_size, (batch, TINY.n_codebooks, frames), generator=g)
    return torch.cat([semantic, residual], dim=1)


@pytest.fixture(scope="module")
def codes():
    return random_codes(12, batch=2)


@pytest.fixture(scope="module")
def reference_audio(codec, codes):
    return codec.decode(codes)


def test_frame_length_and_token_layout():
    for config in (TINY, CodecConfig.s1_mini()):
        assert config.hop_length == 512 and config.frame_length == 2048
        assert (config.semantic_codebook_size, config.codebook_size, config.n_codebooks) == (4096, 1024, 9)
    assert CodecConfig.s1_mini() == CodecConfig()


def test_round_trip_shapes(codec):
    g = torch.Generator().manual_seed(0)
    for t in (1, 2048, 5000):
        audio = 0.3 * torch.randn(2, t, generator=g)
        codes = codec.encode(audio)
        frames = math.ceil(t / 2048)
        assert codes.shape == (2, 10, frames) and codes.dtype == torch.long
        assert 0 <= codes[:, 0].min() and codes[:, 0].max() < 4096
        assert 0 <= codes[:, 1:].min() and codes[:, 1:].max() < 1024
        audio_out = codec.decode(codes)
        assert audio_out.shape == (2, frames * 2048) and audio_out.dtype == torch.float32
        assert torch.isfinite(audio_out).all()
    assert codec.sample_rate == 44100 and codec.frame_length == 2048


def test_encode_accepts_channel_dim_and_empty_audio(codec):
    audio = 0.3 * torch.randn(1, 3000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(codec.encode(audio), codec.encode(audio[:, None]))
    assert codec.encode(torch.zeros(2, 0)).shape == (2, 10, 0)
    assert codec.decode(torch.zeros(2, 10, 0, dtype=torch.long)).shape == (2, 0)
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(3000))
    with pytest.raises(ValueError):
        codec.decode(torch.zeros(1, 9, 4, dtype=torch.long))


def test_random_weights_give_usable_audio_and_varied_codes(codec, reference_audio):
    assert 0.05 < reference_audio.std() < 0.9
    assert (reference_audio.abs() > 0.99).float().mean() < 0.05
    t = torch.arange(4 * 44100) / 44100
    tone = 0.3 * torch.sin(2 * math.pi * 220 * t * (1 + 0.2 * t)) + 0.02 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
    codes = codec.encode(tone[None])
    assert all(codes[0, row].unique().numel() > 10 for row in range(10))


def test_decode_clamps_out_of_range_codes(codec, codes):
    wild = codes.clone()
    wild[:, 0, 0] = 5000
    wild[:, 3, 1] = 2000
    clamped = wild.clone()
    clamped[:, 0, 0] = 4095
    clamped[:, 3, 1] = 1023
    assert torch.equal(codec.decode(wild), codec.decode(clamped))


def test_config_from_state_dict():
    assert CodecConfig.from_state_dict(build_codec_state_dict(TINY, seed=0)) == TINY
    s1 = build_codec_state_dict(CodecConfig.s1_mini(), seed=0, device="meta")  # shapes only
    assert CodecConfig.from_state_dict(s1) == CodecConfig.s1_mini()
    # upstream's layout: 391,430,530 values (weight-norm pairs included) in 535 tensors
    assert len(s1) == 535 and sum(t.numel() for t in s1.values()) == 391_430_530


def test_config_rejects_inert_decoder_transformer():
    with pytest.raises(ConfigError):
        dataclasses.replace(TINY, decoder_transformer_layers=(1, 0, 0, 0))


def test_upstream_weight_norm_styles_are_what_upstream_saves(weights):
    assert "encoder.block.0.conv.parametrizations.weight.original0" in weights
    assert "decoder.model.1.block.1.conv.parametrizations.weight.original1" in weights
    assert "quantizer.quantizer.quantizers.0.in_proj.weight_g" in weights
    assert "quantizer.downsample.0.0.conv.weight" in weights
    assert not any(k.endswith((".weight_v", ".original1")) and k.startswith("quantizer.upsample") for k in weights)


def restyle(weights: dict, style: str) -> dict:
    """The same weights with every weight-normed conv in one style: 'hook', 'parametrization' or folded."""
    out = {}
    for name, t in weights.items():
        for a, b in ((".weight_g", "g"), (".weight_v", "v"), (".parametrizations.weight.original0", "g"), (".parametrizations.weight.original1", "v")):
            if name.endswith(a):
                stem = name[: -len(a)]
                if style == "hook":
                    out[f"{stem}.weight_{b}"] = t
                else:
                    out[f"{stem}.parametrizations.weight.original{'0' if b == 'g' else '1'}"] = t
                break
        else:
            out[name] = t
    return fold_weight_norm(out) if style == "folded" else out


def test_weight_norm_styles_and_folded_weights_decode_identically(weights, codes, reference_audio):
    for style in ("hook", "parametrization", "folded"):
        codec = codec_from_state_dict(restyle(weights, style))
        assert torch.equal(codec.decode(codes), reference_audio), style
    # and the runtime model holds plain weights only
    names = codec_from_state_dict(weights).state_dict()
    assert not any("weight_g" in n or "parametrizations" in n for n in names)


def test_load_pth_and_safetensors(tmp_path, weights, codes, reference_audio):
    torch.save(weights, tmp_path / "codec.pth")
    write_safetensors(weights, tmp_path / "codec.safetensors")
    for name in ("codec.pth", "codec.safetensors"):
        codec = load_codec(tmp_path / name)
        assert isinstance(codec, Codec) and codec.config == TINY and not codec.training
        assert torch.equal(codec.decode(codes), reference_audio), name


def test_generator_prefix_wrapper_buffers_and_extra_keys(tmp_path, weights, codes, reference_audio):
    wrapped = {f"generator.{k}": v for k, v in weights.items()}
    wrapped["generator.quantizer.pre_module.freqs_cis"] = torch.zeros(4096, 32, 2, dtype=torch.bfloat16)
    wrapped["generator.quantizer.pre_module.causal_mask"] = torch.ones(8, 8, dtype=torch.bool)
    wrapped["generator.something.upstream.ignores"] = torch.zeros(3)
    wrapped["discriminator.convs.0.weight"] = torch.zeros(3, 3)
    torch.save({"state_dict": wrapped}, tmp_path / "codec.pth")
    codec = load_codec(tmp_path / "codec.pth")
    assert torch.equal(codec.decode(codes), reference_audio)


def test_dtype_and_device(tmp_path, weights, codes):
    torch.save(weights, tmp_path / "codec.pth")
    codec = load_codec(tmp_path / "codec.pth", device="cpu", dtype=torch.bfloat16)
    assert codec.decoder.model[0].conv.weight.dtype == torch.bfloat16
    audio = codec.decode(codes[:, :, :3])
    assert audio.dtype == torch.bfloat16 and torch.isfinite(audio.float()).all()
    assert codec.encode(torch.randn(1, 4096) * 0.1).shape == (1, 10, 2)


@pytest.mark.parametrize(
    "name",
    [
        "quantizer.post_module.layers.0.attention.wo.weight",
        "encoder.block.2.block.1.block.1.conv.parametrizations.weight.original1",
        "quantizer.quantizer.quantizers.4.out_proj.weight_g",
        "decoder.model.3.block.0.alpha",
    ],
)
def test_missing_tensor_is_named(weights, name):
    broken = dict(weights)
    del broken[name]
    with pytest.raises(CheckpointError, match=re.escape(name)):
        codec_from_state_dict(broken)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("quantizer.post_module.layers.0.attention.wqkv.weight", (385, 128)),
        ("quantizer.upsample.1.1.pwconv1.bias", (511,)),
        ("encoder.block.1.block.0.block.1.conv.parametrizations.weight.original0", (8, 1)),
    ],
)
def test_wrong_shape_is_named(weights, name, shape):
    broken = dict(weights)
    broken[name] = torch.zeros(shape)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        codec_from_state_dict(broken)


def test_not_a_codec(tmp_path):
    torch.save({"tok_embeddings.weight": torch.zeros(4, 4)}, tmp_path / "model.pth")
    with pytest.raises(CheckpointError, match="not a codec"):
        load_codec(tmp_path / "model.pth")


def test_truncated_files(tmp_path, weights):
    torch.save(weights, tmp_path / "codec.pth")
    write_safetensors(weights, tmp_path / "codec.safetensors")
    for name in ("codec.pth", "codec.safetensors"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f"cut_{name}").write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError):
            load_codec(tmp_path / f"cut_{name}")
    with pytest.raises(CheckpointError):
        load_codec(tmp_path / "absent.pth")


def push_in_chunks(codec, codes, sizes):
    """Decode in pieces of these sizes, each layer's left context carried in one state dict."""
    state: dict = {}
    out, i, k = [], 0, 0
    while i < codes.shape[-1]:
        n = sizes[k % len(sizes)]
        piece = codec.decode(codes[:, :, i : i + n], state)
        assert piece.shape == (codes.shape[0], min(n, codes.shape[-1] - i) * 2048)
        out.append(piece)
        i, k = i + n, k + 1
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("sizes", [[1], [3], [7], [2, 1, 5]])
def test_streaming_equals_whole_decode(codec, codes, reference_audio, sizes):
    streamed = push_in_chunks(codec, codes, sizes)
    assert (streamed - reference_audio).abs().max() < 1e-4


def test_streaming_past_the_attention_window(weights):
    """With a 4-frame window the KV cache must drop old positions exactly as the mask does."""
    config = dataclasses.replace(TINY, quantizer_window=4)
    codec = codec_from_state_dict(weights, config=config)
    codes = random_codes(15, seed=3)
    whole = codec.decode(codes)
    assert (whole - codec_from_state_dict(weights).decode(codes)).abs().max() > 1e-3  # the window matters
    for sizes in ([1], [3], [7]):
        assert (push_in_chunks(codec, codes, sizes) - whole).abs().max() < 1e-4


def test_a_fresh_state_starts_a_new_utterance_and_an_empty_piece_is_nothing(codec, codes, reference_audio):
    codec.decode(codes[:, :, :4], {})
    state: dict = {}
    assert (codec.decode(codes[:, :, :5], state) - reference_audio[:, : 5 * 2048]).abs().max() < 1e-4
    assert codec.decode(codes[:, :, :0], state).shape == (2, 0)


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_streaming_conv_over_channels_last_2d_tensors_matches_the_1d_conv(dilation):
    """The [B, C, 1, T] path (a dilated conv as an undilated one over its phases) gives the
    1-D conv's outputs, piece after piece, at lengths that are and are not multiples of d."""
    torch.manual_seed(dilation)
    conv = CausalConv1d(6, 5, 7, dilation=dilation)
    x = torch.randn(2, 6, 61)
    plain_state, state_2d = {}, {}
    plain, flat = [], []
    for a, b in ((0, 18), (18, 27), (27, 61)):
        plain.append(conv(x[..., a:b], plain_state))
        if conv.weight_2d is None:
            conv.prepare_2d()
        piece = x[..., a:b][:, :, None].contiguous(memory_format=torch.channels_last)
        flat.append(conv(piece, state_2d)[:, :, 0])
        conv.weight_2d = None  # the 1-D call next time
    assert torch.allclose(torch.cat(flat, -1), torch.cat(plain, -1), atol=1e-5)
    assert torch.allclose(torch.cat(plain, -1), conv(x), atol=1e-5)


def test_dilated_phase_conv_compiles_for_any_length():
    """Compiled with the batch and piece length dynamic, as the batching codec's back is, it
    gives the eager results."""
    torch.manual_seed(0)
    unit = ResidualUnit(4, 9)
    conv = unit.block[1]
    conv.prepare_2d()
    unit.block[3].prepare_2d()

    def step(x, context):
        state = {conv: context}
        return unit(x, state), state[conv]

    compiled = torch.compile(step, fullgraph=True)
    for b, n in ((2, 16), (3, 40), (1, 27)):
        context = torch.randn(b, 4, 1, conv.left).contiguous(memory_format=torch.channels_last)
        x = torch.randn(b, 4, 1, n).contiguous(memory_format=torch.channels_last)
        for t, dims in ((x, (0, 3)), (context, (0,))):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        with torch.inference_mode():  # as served (with autograd, inductor cannot order the view's strides)
            (y, kept), (y_ref, kept_ref) = compiled(x, context), step(x, context)
        assert y.shape == (b, 4, 1, n) and torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(kept, kept_ref, atol=1e-6)


def test_import_pulls_in_no_upstream():
    code = (
        "import sys, fish_sm.model.codec; "
        "bad = [m for m in ('fish_speech', 'dac', 'hydra', 'audiotools', 'omegaconf', 'librosa', 'einops') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

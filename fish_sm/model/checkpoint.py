"""The five files of an S1-mini checkpoint directory: reading them, and writing random
ones in the official formats.

`tiny` is small enough to run the whole pipeline on a CPU in seconds; `s1-mini` has
the real shapes (860 M transformer parameters in bf16, the full codec in float32),
for GPU benchmarks. Both keep the real token layout: 4,096 semantic tokens after
the BPE ranks and the 15 control tokens, ten codebooks, 1,024-entry residual codebooks.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from fish_sm.errors import CheckpointError
from fish_sm.model.codec import CodecConfig
from fish_sm.model.config import ModelConfig
from fish_sm.model.random_weights import build_codec_state_dict, random_model_state_dict, train_byte_bpe
from fish_sm.model.tokenizer import BASE_SPECIAL_TOKENS, write_tokenizer

FILES = ("config.json", "model.pth", "codec.pth", "tokenizer.tiktoken", "special_tokens.json")
PRESETS = ("tiny", "s1-mini")
REAL_BPE_RANKS = 151_643

S1_MINI = ModelConfig(
    model_type="dual_ar", vocab_size=155_776, n_layer=28, n_head=16, n_local_heads=8, head_dim=128, dim=1024,
    intermediate_size=3072, rope_base=1_000_000, norm_eps=1e-6, max_seq_len=8192, dropout=0.0,
    tie_word_embeddings=False, attention_qkv_bias=False, attention_o_bias=False, attention_qk_norm=True,
    codebook_size=4096, num_codebooks=10, scale_codebook_embeddings=True, n_fast_layer=4, fast_dim=1024,
    fast_n_head=16, fast_n_local_heads=8, fast_head_dim=64, fast_intermediate_size=3072,
    fast_attention_qkv_bias=False, fast_attention_qk_norm=False, fast_attention_o_bias=False,
    use_gradient_checkpointing=True, initializer_range=0.03125,
)

# Text the tiny tokenizer's merges are learned from: the languages S1-mini speaks most.
_TINY_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello from fish-sm, a text to speech engine for SageMaker.
She sells sea shells by the sea shore; the shells she sells are surely sea shells. It is 3:45 pm on 12 May 2026.
Speech synthesis turns written text into natural sounding audio, one frame at a time, with a voice of your choice.
你好，欢迎使用语音合成。今天天气很好，我们一起去公园散步吧。这是一个测试句子。
こんにちは、音声合成のテストです。今日はとても良い天気ですね。ありがとうございます。
(excited) Wow, this is amazing! (whispering) Keep it quiet. (laughing) Ha ha ha. (sad) Oh no...
"""


def tiny_config(vocab_size: int) -> ModelConfig:
    return dataclasses.replace(
        S1_MINI, vocab_size=vocab_size, n_layer=2, n_head=4, n_local_heads=2, head_dim=32, dim=64,
        intermediate_size=192, max_seq_len=2048, n_fast_layer=2, fast_dim=64, fast_n_head=4,
        fast_n_local_heads=2, fast_head_dim=16, fast_intermediate_size=192,
    )


def _tokenizer_ranks(preset: str) -> dict[bytes, int]:
    ranks = train_byte_bpe(_TINY_CORPUS, 256)
    if preset == "s1-mini":
        # Same count as the real vocabulary so every special id lands where it really is;
        # the filler tokens are unreachable byte strings.
        i = 0
        while len(ranks) < REAL_BPE_RANKS:
            ranks.setdefault(b"\x00\xff" + i.to_bytes(3, "big"), len(ranks))
            i += 1
    return ranks


def _padded_vocab(num_tokens: int) -> int:
    return math.ceil(num_tokens / 64) * 64


def write_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write config.json, model.pth, codec.pth, tokenizer.tiktoken and special_tokens.json."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranks = _tokenizer_ranks(preset)
    num_semantic = S1_MINI.codebook_size
    write_tokenizer(path, ranks, num_semantic)
    if preset == "s1-mini":
        config, codec_config = S1_MINI, CodecConfig.s1_mini()
    else:
        config = tiny_config(_padded_vocab(len(ranks) + len(BASE_SPECIAL_TOKENS) + num_semantic))
        codec_config = CodecConfig.tiny()
    config.save(path / "config.json")
    torch.save(random_model_state_dict(config, seed), path / "model.pth")
    torch.save(build_codec_state_dict(codec_config, seed), path / "codec.pth")
    return path


def find_model_file(path: Path, stem: str) -> Path:
    """`stem.pth`, else `stem.safetensors`."""
    for suffix in (".pth", ".safetensors"):
        if (path / (stem + suffix)).is_file():
            return path / (stem + suffix)
    raise CheckpointError(f"{path}: missing {stem}.pth (or {stem}.safetensors)")

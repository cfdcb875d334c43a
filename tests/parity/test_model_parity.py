"""Our transformer, tokenizer, prompt and sampling against upstream fish-speech 0.1.0,
on identical random weights, in float32."""

import json

import pytest
import torch

from fish_speech.content_sequence import ContentSequence, TextPart, VQPart
from fish_speech.models.text2semantic import inference as up_inference
from fish_speech.models.text2semantic.llama import DualARModelArgs, DualARTransformer
from fish_speech.tokenizer import FishTokenizer
from fish_sm.engine.prompt import build_prompt
from fish_sm.engine.sampling import SamplingParams, logits_to_probs, sampling_tensors
from fish_sm.model.config import ModelConfig
from fish_sm.model.dual_ar import load_dual_ar
from fish_sm.model.random_weights import train_byte_bpe
from fish_sm.model.tokenizer import Tokenizer, write_tokenizer

CORPUS = [
    "Hello, world! This is fish-sm speaking.",
    "I'm sure you'll see they've done it; isn't it great?!",
    "你好，世界。今天天气很好，我们去公园散步吧！",
    "こんにちは、世界。カタカナとひらがな、漢字も。",
    "Numbers: 3.14159, 2026-11-22, 1,000,000 and 42%.",
    "Emoji 😀🎉👍🏽 and symbols © ® ™ → ← ∞",
    "(excited) Wow! (whispering) quiet now... (laughing) ha ha (sad) oh no.",
    "Tabs\tand\nnew lines\r\n  and   spaces   ?! end",
    "Mixed 中文 and English 和日本語 in one line 123abc",
    "<|im_end|> literal special token and <|speaker:0|>",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, train_byte_bpe(" ".join(CORPUS) * 3, 800), 4096)
    return Tokenizer.from_dir(d), FishTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    config = ModelConfig.from_file(tiny_checkpoint)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    ours = load_dual_ar(tiny_checkpoint / "model.pth", config, tok.semantic_begin_id, tok.im_end_id)
    ours.setup_caches(1, config.max_seq_len)
    up_tok = FishTokenizer.from_pretrained(str(tiny_checkpoint))
    up = DualARTransformer(DualARModelArgs(**json.loads((tiny_checkpoint / "config.json").read_text())), up_tok)
    weights = {k: v.float() for k, v in torch.load(tiny_checkpoint / "model.pth", weights_only=True).items()}
    result = up.load_state_dict(weights, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    up.eval().setup_caches(1, config.max_seq_len, dtype=torch.float32)
    return ours, tok, up, up_tok


@pytest.mark.parametrize("text", CORPUS)
def test_tokenizer_ids_match(tokenizers, text):
    ours, up = tokenizers
    assert ours.encode(text) == up.encode(text)


def test_special_token_ids_match(tokenizers):
    ours, up = tokenizers
    assert ours.special_ids == up.all_special_tokens_with_ids
    assert (ours.semantic_begin_id, ours.semantic_end_id) == (up.semantic_begin_id, up.semantic_end_id)


def test_a_special_token_alone_encodes_as_upstream(tokenizers):
    ours, up = tokenizers  # (ours looks these up; upstream runs them through tiktoken)
    for token in [*list(ours.special_ids)[:40], *list(ours.special_ids)[-5:]]:
        assert ours.encode(token) == up.encode(token) == [ours.special_ids[token]]
        assert ours.encode(token, allow_special=False) == up.encode(token, allowed_special=False)


def up_prompt(up_tok, refs, text):
    seq = ContentSequence(modality="interleave")
    for t, c in refs:
        seq.append([TextPart(text=t), VQPart(codes=c)], add_end=True, speaker=0)
    seq.append([TextPart(text=text)], add_end=False, speaker=0)
    return seq.encode_for_inference(up_tok, num_codebooks=10)[0].long()


def random_codes(frames, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1024, (10, frames), generator=g)
    codes[0] = torch.randint(0, 4096, (frames,), generator=g)
    return codes


def test_prompt_matches_content_sequence(models):
    ours, tok, up, up_tok = models
    refs = [("First reference, spoken.", random_codes(25, 1)), ("第二个参考。", random_codes(13, 2))]
    text = "Now say this (excited) sentence!"
    assert torch.equal(build_prompt(tok, 10, refs, text), up_prompt(up_tok, refs, text))


def test_slow_transformer_logits_and_hidden_state(models):
    ours, tok, up, up_tok = models
    refs = [("A reference voice says hello.", random_codes(40, 3))]
    prompt = build_prompt(tok, 10, refs, "Hello world, 你好!")
    T = prompt.shape[1]
    with torch.no_grad():
        theirs = up.forward_generate(prompt[None], torch.arange(T))
        logits, hidden = ours.forward_slow(prompt[None], torch.arange(T), T)
        # then one decode step at the next position, with a semantic frame as input
        frame = torch.cat([torch.tensor([tok.semantic_begin_id + 7]), random_codes(1, 4)[:, 0]])[None, :, None]
        theirs2 = up.forward_generate(frame, torch.tensor([T]))
        logits2, hidden2 = ours.forward_slow(frame, torch.tensor([T]), T + 1)
    rows = ours.head_rows()
    d_logits = (theirs.logits[0, -1, rows] - logits[0]).abs().max().item()
    d_hidden = (theirs.hidden_states[0, -1] - hidden[0]).abs().max().item()
    d_step = max((theirs2.logits[0, -1, rows] - logits2[0]).abs().max().item(),
                 (theirs2.hidden_states[0, -1] - hidden2[0]).abs().max().item())
    print(f"\nslow prefill: logits max|d| {d_logits:.2e}, hidden max|d| {d_hidden:.2e}; decode step {d_step:.2e}")
    assert d_logits < 1e-5 and d_hidden < 1e-5 and d_step < 1e-5


def test_fast_transformer_logits_every_codebook(models):
    ours, tok, up, up_tok = models
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    codes = random_codes(1, 6)[:, 0]
    worst = 0.0
    with torch.no_grad():
        up.forward_generate_fast(hidden[:, None], torch.tensor([0]))
        ours.forward_fast(hidden, 0)
        for i in range(1, 10):
            theirs = up.forward_generate_fast(up.fast_embeddings(codes[i - 1 : i]), torch.tensor([i]))[0, -1]
            mine = ours.fast_logits(ours.forward_fast(ours.fast_embeddings(codes[i - 1 : i]), i))[0]
            worst = max(worst, (theirs[: mine.shape[0]] - mine).abs().max().item())  # ours: the 1,024 sampled rows
    print(f"\nfast head: logits max|d| over codebooks 1..9 {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.parametrize("vocab", [4097, 1024])
@pytest.mark.parametrize("params", [(0.8, 0.8, 1.1), (0.3, 0.5, 1.5), (1.0, 1.0, 0.9), (0.7, 0.95, 1.2)])
def test_sampling_probabilities(vocab, params):
    temperature, top_p, penalty = params
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 3
    previous = torch.randint(0, vocab, (16,), generator=g)
    bf16 = lambda v: torch.tensor(v, dtype=torch.bfloat16)  # as upstream's generate() carries them
    theirs = up_inference.logits_to_probs(logits.clone(), bf16(temperature), bf16(top_p), bf16(penalty), previous)
    mine = logits_to_probs(logits.clone(), *sampling_tensors(SamplingParams(temperature, top_p, penalty), "cpu"), previous)
    diff = (theirs - mine).abs().max().item()
    print(f"\nsampling probs (V={vocab}, T={temperature}, p={top_p}, r={penalty}): max|d| {diff:.2e}")
    assert diff < 1e-6
    assert torch.equal(theirs > 0, mine > 0)

"""A LoRA adapter served unmerged by fish-sm against upstream's model with the same adapter
merged (upstream's setup_lora + loralib's merge on eval(), what its merge_lora tool saves),
on identical random weights, in float32."""

import json

import pytest
import torch

from fish_speech.models.text2semantic.llama import DualARModelArgs, DualARTransformer
from fish_speech.models.text2semantic.lora import LoraConfig, get_merged_state_dict, setup_lora
from fish_speech.tokenizer import FishTokenizer
from fish_sm.engine.engine import Engine
from fish_sm.engine.prompt import build_prompt
from fish_sm.kernels import AdapterSlots
from fish_sm.model.config import ModelConfig
from fish_sm.model.dual_ar import load_dual_ar
from fish_sm.model.lora import random_adapter
from fish_sm.model.tokenizer import Tokenizer
from fish_sm.model.weights import write_safetensors


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint):
    # rank 4 and alpha 8 (scaling 2) in slots of rank 8: the padding must not change a thing
    return random_adapter(ModelConfig.from_file(tiny_checkpoint), "tuned", rank=4, alpha=8.0, seed=1, scale=0.05)


@pytest.fixture(scope="module")
def upstream_merged(tiny_checkpoint, adapter):
    up = DualARTransformer(DualARModelArgs(**json.loads((tiny_checkpoint / "config.json").read_text())),
                           FishTokenizer.from_pretrained(str(tiny_checkpoint)))
    setup_lora(up, LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha))
    weights = {k: v.float() for k, v in torch.load(tiny_checkpoint / "model.pth", weights_only=True).items()}
    for target, (a, b) in adapter.pairs.items():
        weights[f"{target}.lora_A"], weights[f"{target}.lora_B"] = a, b
    result = up.load_state_dict(weights, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    up.eval()  # loralib merges W + B·A·alpha/r here
    up.setup_caches(1, up.config.max_seq_len, dtype=torch.float32)
    return up


@pytest.fixture(scope="module")
def ours_unmerged(tiny_checkpoint, adapter):
    config = ModelConfig.from_file(tiny_checkpoint)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    ours = load_dual_ar(tiny_checkpoint / "model.pth", config, tok.semantic_begin_id, tok.im_end_id)
    ours.setup_caches(1, config.max_seq_len)
    slots = AdapterSlots(ours, slots=3, rank=8)
    slots.load(2, adapter)
    slots.set_rows(torch.tensor([2]))
    return ours, tok


def test_slow_transformer_matches_upstream_merged(upstream_merged, ours_unmerged):
    ours, tok = ours_unmerged
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 1024, (10, 30), generator=g)
    prompt = build_prompt(tok, 10, [("A reference voice says hello.", codes)], "Hello world, fine-tuned!")
    T = prompt.shape[1]
    frame = torch.cat([torch.tensor([tok.semantic_begin_id + 7]), codes[:, 0]])[None, :, None]
    with torch.no_grad():
        theirs = upstream_merged.forward_generate(prompt[None], torch.arange(T))
        logits, hidden = ours.forward_slow(prompt[None], torch.arange(T), T)
        theirs2 = upstream_merged.forward_generate(frame, torch.tensor([T]))
        logits2, hidden2 = ours.forward_slow(frame, torch.tensor([T]), T + 1)
    rows = ours.head_rows()
    worst = max((theirs.logits[0, -1, rows] - logits[0]).abs().max().item(),
                (theirs.hidden_states[0, -1] - hidden[0]).abs().max().item(),
                (theirs2.logits[0, -1, rows] - logits2[0]).abs().max().item(),
                (theirs2.hidden_states[0, -1] - hidden2[0]).abs().max().item())
    print(f"\nLoRA slow transformer vs upstream merged: max|d| {worst:.2e}")
    assert worst < 1e-4


def test_fast_transformer_matches_upstream_merged(upstream_merged, ours_unmerged):
    ours, _ = ours_unmerged
    hidden = torch.randn(1, ours.config.fast_dim, generator=torch.Generator().manual_seed(5))
    codes = torch.randint(0, 1024, (10,), generator=torch.Generator().manual_seed(6))
    worst = 0.0
    with torch.no_grad():
        upstream_merged.forward_generate_fast(hidden[:, None], torch.tensor([0]))
        ours.forward_fast(hidden, 0)
        for i in range(1, 10):
            theirs = upstream_merged.forward_generate_fast(upstream_merged.fast_embeddings(codes[i - 1 : i]),
                                                           torch.tensor([i]))[0, -1]
            mine = ours.fast_logits(ours.forward_fast(ours.fast_embeddings(codes[i - 1 : i]), i))[0]
            worst = max(worst, (theirs[: mine.shape[0]] - mine).abs().max().item())
    print(f"\nLoRA fast head vs upstream merged: max|d| {worst:.2e}")
    assert worst < 1e-4


def test_codes_match_upstreams_merged_checkpoint(tiny_checkpoint, tmp_path, adapter, upstream_merged):
    """The same seed gives the same codes from the adapter served unmerged as from the
    checkpoint upstream's merge writes, loaded as it is."""
    merged = tmp_path / "merged"
    merged.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.name != "model.pth":
            (merged / f.name).symlink_to(f)
    write_safetensors(get_merged_state_dict(upstream_merged), merged / "model.safetensors")

    class Source:
        def load(self, name):
            return adapter

    base = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    base.enable_adapters(Source(), memory_bytes=1, rank=8)
    text = "Fine-tuned voices, side by side."
    unmerged = base.synthesize(text, adapter="tuned", seed=0, max_new_tokens=24)
    plain = Engine.from_pretrained(merged, device="cpu").synthesize(text, seed=0, max_new_tokens=24)
    assert unmerged.frames > 0 and torch.equal(unmerged.codes, plain.codes)
    assert not torch.equal(base.synthesize(text, seed=0, max_new_tokens=24).codes, unmerged.codes)

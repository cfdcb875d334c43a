"""The compiled decode step and INT8 weight-only quantization, on the CPU (float32).

On a GPU the same frame is captured as CUDA graphs; `fish_sm.engine.benchmark` runs the
same comparison there (`compare_compiled_to_eager`) in bf16.
"""

import pytest
import torch

from fish_sm.engine import Engine
from fish_sm.engine.benchmark import SENTENCE, compare_compiled_to_eager, weight_bytes
from fish_sm.engine.prompt import build_prompt


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint):
    eager = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    fast = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    fast.compile()
    return eager, fast


def test_compiled_step_gives_the_eager_codes(compiled):
    eager, fast = compiled
    text = "A sentence long enough to cross an attention bucket. " * 6
    a = eager.synthesize(text, seed=5, max_new_tokens=40, chunk_length=1000)
    b = fast.synthesize(text, seed=5, max_new_tokens=40, chunk_length=1000)
    assert fast.compiled and torch.equal(a.codes, b.codes)
    assert abs(a.audio - b.audio).max() < 1e-4


def test_compiled_logits_follow_eager(compiled):
    _, fast = compiled
    prompt = build_prompt(fast.tokenizer, fast.config.num_codebooks, [], SENTENCE)
    report = compare_compiled_to_eager(fast, prompt, steps=4)
    assert report["max_abs_logit_diff"] < 1e-4 and report["code_agreement"] == 1.0


def test_int8_weight_only_quantization(tiny_checkpoint):
    pytest.importorskip("torchao")
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    before = weight_bytes(engine.model)
    reference = engine.synthesize("Quantized speech.", seed=2, max_new_tokens=6)
    engine.quantize_int8()
    assert engine.quantized and weight_bytes(engine.model) < before
    result = engine.synthesize("Quantized speech.", seed=2, max_new_tokens=6)
    assert result.audio.shape == reference.audio.shape and result.frames == reference.frames

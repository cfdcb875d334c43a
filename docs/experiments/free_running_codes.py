"""How long free-running decodes of the same request and seed stay identical between numerics
that differ by rounding only: bf16 against torchao INT8, and torchao INT8 against the
hand-written INT8 products' arithmetic (int8_frame.py's reference, done in torch). CPU, eager,
S1-mini shapes. With random weights the distributions are nearly flat, so a rounding
difference soon changes a sample, and every later frame follows from it. Not part of the package.

    python docs/experiments/free_running_codes.py CHECKPOINT_DIR [FRAMES=40]
"""
import os, sys, time, types

import torch

os.environ["DEV"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import int8_frame  # noqa: E402
from fish_sm.engine import Engine  # noqa: E402
from fish_sm.engine.benchmark import SENTENCE  # noqa: E402
from fish_sm.engine.generate import generate_frames  # noqa: E402
from fish_sm.engine.prompt import build_prompt  # noqa: E402
from fish_sm.engine.sampling import SamplingParams  # noqa: E402
from fish_sm.model.dual_ar import TransformerBlock  # noqa: E402

checkpoint, frames = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40


def codes(engine: Engine) -> torch.Tensor:
    prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
    with torch.inference_mode():
        return torch.stack(list(generate_frames(engine.model, prompt, SamplingParams(seed=3, max_new_tokens=frames),
                                                torch.Generator().manual_seed(3))))


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    n = min(len(a), len(b))
    same = (a[:n] == b[:n])
    return {"first_frames_identical": int(same.all(dim=1).long().cumprod(0).sum()), "codes_same": same.float().mean().item()}


def hand_written_step(self, x, rope, input_pos, live, mask=None, row=0):
    """A decode step's layer through int8_frame's halves (their torch reference on the CPU)."""
    if x.shape[1] == 1:
        q = int8_frame.pre_hand(self, x, rope, input_pos)
        k, v = self.attention.kv_cache.read(live, 0, 1)
        return int8_frame.post_hand(self, x, self.attention.over(q, k, v, input_pos, live, mask))
    return TransformerBlock.forward(self, x, rope, input_pos, live, mask, row)


t0 = time.time()
bf16 = codes(Engine.from_pretrained(checkpoint, device="cpu", dtype="bfloat16"))
engine = Engine.from_pretrained(checkpoint, device="cpu", dtype="bfloat16")
engine.quantize_int8()
torchao = codes(engine)
for block in [*engine.model.layers, *engine.model.fast_layers]:
    int8_frame.attach(block)
    block.forward = types.MethodType(hand_written_step, block)
hand = codes(engine)
print({"bf16_vs_int8_torchao": agreement(bf16, torchao), "int8_torchao_vs_hand_written": agreement(torchao, hand),
       "frames": frames, "seconds": round(time.time() - t0, 1)})

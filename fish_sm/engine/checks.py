"""Checks of the engine's fast paths against its plain ones: the compiled decode step against
the eager one (`compare_compiled_to_eager`), and what quantized weights hold (`weight_bytes`).
The tests run them on the CPU; benchmarks/engine.py runs them on a GPU beside its figures."""

from __future__ import annotations

import torch

from fish_sm import kernels

from fish_sm.contract import SamplingParams
from fish_sm.engine.engine import Engine
from fish_sm.engine.generate import GraphedStep, attention_bucket, decode_frame, noise_size
from fish_sm.engine.sampling import PENALTY_WINDOW, sampling_tensors

# A 20-word sentence, the text the checks (and the benchmark's first audio) prompt with.
SENTENCE = ("The quick brown fox jumps over the lazy dog while the patient engineer measures "
            "how fast this voice can start speaking.")


def compiled_step(engine: Engine):
    """The engine's compiled decode step: on a GPU its batching engine's captured graphs (once
    `engine.compile()` ran; else None), elsewhere `decode_frame` compiled by torch.compile."""
    if engine.device.type == "cuda":
        return engine.batching().runner.captured if engine.compiled else None
    return torch.compile(decode_frame, fullgraph=True)


def compare_compiled_to_eager(engine: Engine, prompt: torch.Tensor, steps: int = 8) -> dict:
    """Run the same frames through the eager step (exact attention length) and the compiled
    one (`compiled_step`: bucketed, masked attention; CUDA graphs or torch.compile) from
    identical states and inputs, in the KV cache's row 0 (while the engine serves nothing);
    report how far the slow head's logits and the sampled codes differ:
    {"max_abs_logit_diff", "max_abs_logit" (the scale), "code_agreement" (a share)}.
    On a GPU before `engine.compile()` both sides are eager (agreement 1.0)."""
    model, dev = engine.model, engine.device
    compiled_slow = model.forward_slow if dev.type == "cuda" else torch.compile(model.forward_slow, fullgraph=True)
    t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(seed=0), dev))
    step = compiled_step(engine)
    captured = isinstance(step, GraphedStep)
    row = torch.zeros(1, dtype=torch.long, device=dev)
    worst, scale, agree, total = 0.0, 0.0, 0, 0
    with torch.inference_mode():
        length = prompt.shape[1]
        model.forward_slow(prompt.to(dev)[None], torch.arange(length, device=dev), length)
        frame = torch.zeros(prompt.shape[0], dtype=torch.long, device=dev)
        frame[0] = model.semantic_begin_id
        window = torch.zeros(prompt.shape[0], PENALTY_WINDOW, dtype=torch.long, device=dev)
        g = torch.Generator(dev).manual_seed(0)
        for i in range(steps):
            pos = torch.tensor([length + i], device=dev)
            bucket = model.positions[: attention_bucket(model.max_seq_len, length + i + 1)]
            eager_logits, _ = model.forward_slow(frame.view(1, -1, 1), pos, length + i + 1)
            comp_logits, _ = compiled_slow(frame.view(1, -1, 1), pos, 0, bucket)
            worst = max(worst, (eager_logits.float() - comp_logits.float()).abs().max().item())
            scale = max(scale, eager_logits.float().abs().max().item())
            noise = torch.empty(1, noise_size(model), device=dev).exponential_(1, generator=g)
            if captured and step.state.keyed:  # the noise the captured step draws from its key
                noise = kernels.exponential_noise(torch.full((1,), i, dtype=torch.long, device=dev), noise)
            a = decode_frame(model, frame[None], pos, window[None], noise, t, p, r, live=length + i + 1)[0]
            if step is None:
                b = a
            elif captured:
                b = _captured_frame(step, frame, length + i, noise, (t, p, r), bucket.shape[0], key=i)
            else:
                b = step(model, frame[None], pos, window[None], noise, t, p, r, key_pos=bucket, rows=row)[0]
            agree += int((a == b).sum())
            total += a.numel()
            frame = a
    return {"max_abs_logit_diff": worst, "max_abs_logit": scale, "code_agreement": agree / total}


def _captured_frame(step, frame: torch.Tensor, position: int, noise: torch.Tensor, sampling, bucket: int,
                    key: int) -> torch.Tensor:
    """The one-slot captured step's frame after `frame` at `position` in cache row 0, with an
    empty penalty window and this noise (drawn from `key` when the step draws its own)."""
    state, (ints, floats) = step.state, step.inputs(1)
    state.current[0] = frame
    state.history[0].zero_()
    if not state.keyed:
        state.noise[:1] = noise
    ints.copy_(torch.tensor([[key], [0], [position], [0], [0]], device=ints.device))
    floats.copy_(torch.stack([x.view(1, 1) for x in sampling]))
    return step.replay(1, bucket)[0].clone()


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage of a tensor, looking inside quantized tensor subclasses (data + scales)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a model's parameters hold (INT8: its int8 data and scales)."""
    return sum(tensor_bytes(p) for p in model.parameters())

"""The batching engine's admissions from position 0 (prompts padded to a captured shape,
one replay): GPU time of the captured replay at 1, 8 and 32 prompts of the benchmark's
texts (CUDA events, median of 20), and the kernels of the same prefill launched from the
compiled layers (torch.profiler), by total time. Then admissions continuing a reused
prefix of 1,000 positions (a packaged voice; compiled layers, attention masked), and
their attention alone: grouped heads as SDPA takes them against heads expanded for the
efficient kernel, and which backends accept each. Not part of the package.

    python docs/experiments/admission_profile.py CHECKPOINT_DIR    # writes $OUT/admission_profile.json
"""
import json, os, statistics, sys

import torch
import torch.nn.functional as F

from experiment_tools import compiled_batcher, kernels_ms

from fish_sm.engine import batching as B
from fish_sm.engine.benchmark import BATCH_TEXTS

batcher, out = compiled_batcher(sys.argv[1], 32)
engine = batcher.engine
prompts = [B.build_prompt(engine.tokenizer, engine.config.num_codebooks, [], BATCH_TEXTS[i % len(BATCH_TEXTS)])
           for i in range(32)]
out["prompt_tokens"] = [p.shape[1] for p in prompts]
out["replay_ms"] = {}
with torch.inference_mode():
    for n in (1, 8, 32):
        inputs = batcher._admission_inputs([(B._Slot(i, p.shape[1]), p, 0) for i, p in enumerate(prompts[:n])])
        shape = tuple(inputs[0].shape[::2])
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batcher._admission(*inputs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        tokens = shape[0] * shape[1]
        ms = statistics.median(times)
        out["replay_ms"][n] = {"padded_shape": shape, "ms": ms, "tflops": 2 * 440e6 * tokens / ms / 1e9}
        print(n, json.dumps(out["replay_ms"][n]), flush=True)
    inputs = batcher._admission_inputs([(B._Slot(i, p.shape[1]), p, 0) for i, p in enumerate(prompts)])
    for _ in range(3):
        batcher._admission(*inputs, captured=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            batcher._admission(*inputs, captured=False)
        torch.cuda.synchronize()


def event_ms(fn, repeats=20):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


with torch.inference_mode():  # the causal admission against the same prompts through the masked path
    inputs = batcher._admission_inputs([(B._Slot(i, p.shape[1]), p, 0) for i, p in enumerate(prompts)])
    tokens, positions, rows, last = inputs[:4]
    causal = batcher._admission(*inputs)[0][:32].float().clone()
    masked = engine.model.forward_slow(tokens, positions, tokens.shape[-1], key_pos=engine.model.positions[:tokens.shape[-1]],
                                       row=rows, last=last)[0][:32].float()
    out["causal_vs_masked"] = {"max_logit_diff": (causal - masked).abs().max().item(),
                               "logit_scale": masked.abs().max().item(),
                               "argmax_equal": (causal.argmax(-1) == masked.argmax(-1)).float().mean().item()}
    print("causal against masked admission", json.dumps(out["causal_vs_masked"]), flush=True)

PREFIX = 1000
out["prefix_admission_ms"] = {}
with torch.inference_mode():
    for n in (1, 8, 32):
        group = [(B._Slot(i, PREFIX + p.shape[1]), torch.cat([p[:, :1].expand(-1, PREFIX), p], dim=1), PREFIX)
                 for i, p in enumerate(prompts[:n])]
        inputs = batcher._admission_inputs(group)
        out["prefix_admission_ms"][n] = {"padded_shape": tuple(inputs[0].shape[::2]), "live": inputs[4],
                                         "ms": event_ms(lambda: batcher._admission(*inputs))}
        print("after a prefix of", PREFIX, n, json.dumps(out["prefix_admission_ms"][n]), flush=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = engine.model.config
    width, live = out["prefix_admission_ms"][32]["padded_shape"][1], out["prefix_admission_ms"][32]["live"]
    q = torch.randn(32, cfg.n_head, width, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(32, cfg.n_local_heads, live, cfg.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = PREFIX + torch.arange(width, device="cuda")
    mask = torch.zeros(32, 1, width, live, device="cuda", dtype=torch.bfloat16).masked_fill_(
        ~(torch.arange(live, device="cuda") <= pos[:, None])[None, None], float("-inf"))
    rep = cfg.n_head // cfg.n_local_heads
    ways = {"grouped": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "expanded": lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask)}
    out["prefix_attention"] = {"shape": [32, cfg.n_head, width, live]}
    for name, fn in ways.items():
        accepted = {}
        for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel([backend]):
                    fn()
                accepted[backend.name] = True
            except RuntimeError as e:
                accepted[backend.name] = str(e).splitlines()[0][:200]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ms = event_ms(fn)
            reference = ways["grouped"]().float()
            diff = (fn().float() - reference).abs().max().item()
        out["prefix_attention"][name] = {"ms_one_layer": ms, "accepted": accepted, "max_diff_vs_grouped": diff}
        print("attention", name, json.dumps(out["prefix_attention"][name]), flush=True)

by_name = kernels_ms(prof)
total = sum(by_name.values())
out["compiled_kernels_ms_per_call"] = total / 5
out["top"] = [(name, ms / 5) for name, ms in by_name.most_common(25)]
print("kernel ms per admission of 32 (compiled, uncaptured):", round(total / 5, 2), flush=True)
for name, ms in out["top"]:
    print(f"{ms:8.3f} ms  {name}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "admission_profile.json"), "w"), indent=1)

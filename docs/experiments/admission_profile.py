"""The batching engine's admissions from position 0 (prompts padded to a captured shape,
one replay): GPU time of the captured replay at 1, 8 and 32 prompts of the benchmark's
texts (CUDA events, median of 20), and the kernels of the same prefill launched from the
compiled layers (torch.profiler), by total time. Not part of the package.

    python docs/experiments/admission_profile.py CHECKPOINT_DIR    # writes $OUT/admission_profile.json
"""
import json, os, statistics, sys

import torch

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
by_name = kernels_ms(prof)
total = sum(by_name.values())
out["compiled_kernels_ms_per_call"] = total / 5
out["top"] = [(name, ms / 5) for name, ms in by_name.most_common(25)]
print("kernel ms per admission of 32 (compiled, uncaptured):", round(total / 5, 2), flush=True)
for name, ms in out["top"]:
    print(f"{ms:8.3f} ms  {name}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "admission_profile.json"), "w"), indent=1)

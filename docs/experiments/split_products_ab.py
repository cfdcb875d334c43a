"""The batching engine's steps of several rows with wo and w2 as `split_products` kernels (as
shipped) and as cuBLAS products with inductor's residual adds, A/B in one process: one
batching engine, its decode graphs captured once each way (the second after compiling the
layers' second half again without the split kernels; the codec's graphs are shared), then
the step of BATCH rows profiled (kernels, replay) and the streamed levels, the variants in
turns. Not part of the package.

    python docs/experiments/split_products_ab.py CHECKPOINT_DIR [BATCH=32] [LEVELS=32:1,32:3,64:1] [ROUNDS=2]
    # LEVELS are streams:rounds (1: one burst; more: a closed loop); $OUT/split_products_ab.json
"""
import json, os, sys, time

import torch

from experiment_tools import compiled_batcher, recaptured_steps

from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level, profile_decode
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.generate import attention_bucket
from fish_sm.engine.sampling import SamplingParams
from fish_sm.model.dual_ar import TransformerBlock, compile_decode

checkpoint = sys.argv[1]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
plan = [tuple(int(x) for x in level.split(":")) for level in (sys.argv[3] if len(sys.argv) > 3 else "32:1,32:3,64:1").split(",")]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
path = os.path.join(os.environ.get("OUT", "."), "split_products_ab.json")

batcher, out = compiled_batcher(checkpoint, max(n for n, _ in plan))
model, step = batcher.model, batcher._step
blocks = [*model.layers, *model.fast_layers]
assert blocks[0].compiled[1][1]._torchdynamo_orig_callable is TransformerBlock._post_attention_split
halves = {"split": blocks[0].compiled}
graphs = {"split": dict(step.graphs)}
t0 = time.perf_counter()
halves["cublas"] = (halves["split"][0], (halves["split"][1][0], compile_decode(TransformerBlock._post_attention, False)))
for b in blocks:
    b.compiled = halves["cublas"]
graphs["cublas"] = recaptured_steps(batcher)
out["recapture_s"] = time.perf_counter() - t0
freeze_start_up_objects()


def use(variant):
    for b in blocks:
        b.compiled = halves[variant]
    step.graphs = graphs[variant]


out["profile"], after = {}, {}
batcher.engine._step = step
for variant in ("cublas", "split", "cublas", "split"):  # twice each, so that drift shows
    use(variant)
    torch.manual_seed(0)  # the same noise each way: the last replay's codes compared below
    p = profile_decode(batcher.engine, batch, 300)
    print(variant, json.dumps({k: v for k, v in p.items() if k != "top"}), flush=True)
    out["profile"].setdefault(variant, []).append(p)
    after[variant] = step.graphs[(batch, attention_bucket(batcher.max_seq_len, 300))][1][:batch].clone()
batcher.engine._step = None
out["codes_equal"] = (after["cublas"] == after["split"]).float().mean().item()
print("codes equal (share)", out["codes_equal"], flush=True)
json.dump(out, open(path, "w"), indent=1)
out["levels"] = []
for round_ in range(rounds):
    for variant in ("split", "cublas"):
        use(variant)
        with batcher:
            batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
            for n, r in plan:
                level = {"variant": variant, "round": round_, **batching_level(batcher, n, 200, True, rounds=r)}
                out["levels"].append(level)
                print(variant, round_, n, r, json.dumps({k: round(level[k], 3) for k in (
                    "aggregate_frames_per_s", "aggregate_decode_frames_per_s", "wall_s",
                    "per_request_decode_frames_per_s_median", "first_audio_ms_p95", "stopped_early")}), flush=True)
        json.dump(out, open(path, "w"), indent=1)
use("split")

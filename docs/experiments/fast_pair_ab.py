"""The batching engine's steps of several rows with the fast transformer's positions 0 and 1 as
one pass of two (generate.FAST_PAIR, as shipped) and as two passes of one, A/B in one process:
one batching engine, its decode graphs captured once each way (the codec's are shared), then
the step of BATCH rows profiled (kernels, replay) and the streamed levels, the variants in
turns. Not part of the package.

    python docs/experiments/fast_pair_ab.py CHECKPOINT_DIR [BATCH=32] [STREAMS=32,64] [ROUNDS=2]
    # one JSON line per level, $OUT/fast_pair_ab.json
"""
import json, os, sys, time

import torch

from experiment_tools import compiled_batcher, recaptured_steps, settings_in_turns

from fish_sm.engine import generate
from fish_sm.engine.benchmark import profile_decode
from fish_sm.engine.engine import freeze_start_up_objects

checkpoint = sys.argv[1]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
streams = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "32,64").split(",")]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
path = os.path.join(os.environ.get("OUT", "."), "fast_pair_ab.json")

generate.FAST_PAIR = True
batcher, out = compiled_batcher(checkpoint, max(streams))
step = batcher._step
graphs = {"pair": dict(step.graphs)}
generate.FAST_PAIR = False
t0 = time.perf_counter()
graphs["two"] = recaptured_steps(batcher)
out["recapture_s"] = time.perf_counter() - t0
freeze_start_up_objects()


def use(variant):
    generate.FAST_PAIR = variant == "pair"
    step.graphs = graphs[variant]


out["profile"], after = {}, {}
batcher.engine._step = step
model = batcher.engine.model
for variant in ("two", "pair", "two"):  # twice, so that drift shows
    use(variant)
    torch.manual_seed(0)  # the same noise each way: the last replay's codes and fast caches compared below
    p = profile_decode(batcher.engine, batch, 300)
    print(variant, json.dumps({k: v for k, v in p.items() if k != "top"}), flush=True)
    out["profile"].setdefault(variant, []).append(p)
    codes = step.graphs[(batch, generate.attention_bucket(batcher.max_seq_len, 300))][1][:batch].clone()
    after[variant] = codes, [b.attention.kv_cache.k[:batch].float().clone() for b in model.fast_layers]
batcher.engine._step = None
(codes_two, k_two), (codes_pair, k_pair) = after["two"], after["pair"]
out["pair_vs_two"] = {"codes_equal": (codes_two == codes_pair).float().mean().item(),
                      "fast_cache_k_max_abs": max((a - b).abs().max().item() for a, b in zip(k_two, k_pair)),
                      "fast_cache_k_max": max(a.abs().max().item() for a in k_two)}
print(json.dumps(out["pair_vs_two"]), flush=True)
json.dump(out, open(path, "w"), indent=1)
out["levels"] = settings_in_turns(batcher, {v: (lambda v=v: use(v)) for v in ("pair", "two")}, streams, rounds,
                                  "fast")
use("pair")
json.dump(out, open(path, "w"), indent=1)

"""Programmatic dependent launch (see pdl_ab.py) for the batching engine's steps of several
rows, off (as shipped, `dual_ar.MANY_ROWS_OPTIONS`) or on: two engines in one process, the
variants in turns, streamed requests of 200 frames (fish_sm.engine.benchmark.batching_level),
and each variant's step profile at 32 rows. Not part of the package.

    python docs/experiments/pdl_batching_ab.py CHECKPOINT_DIR [STREAMS=1,32,64] [ROUNDS=2]
    # prints one JSON line per level, writes $OUT/pdl_batching_ab.json
"""
import json, os, sys, time

import torch

from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine
from fish_sm.engine.benchmark import profile_decode
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.model import dual_ar
from experiment_tools import levels_in_turns

checkpoint = sys.argv[1]
streams = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,32,64").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
batchers = {}
for name in ("off", "on"):
    dual_ar.MANY_ROWS_OPTIONS = {"triton.enable_pdl": True} if name == "on" else {}
    torch._dynamo.reset()  # else dynamo reuses the other variant's graphs (weights are inputs)
    engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
    batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0)
    t0 = time.perf_counter()
    batcher.compile()
    info = {"compile_s": time.perf_counter() - t0}
    engine._step = batcher._step
    p = profile_decode(engine, 32, 300, top=12)
    engine._step = None
    info["profile_32"] = p
    out["variants"][name] = info
    print(name, json.dumps({k: v for k, v in p.items() if k != "top"}), round(info["compile_s"], 1), flush=True)
    batchers[name] = batcher
freeze_start_up_objects()
out["levels"] = levels_in_turns(batchers, streams, rounds, "pdl")
with open(os.path.join(os.environ.get("OUT", "."), "pdl_batching_ab.json"), "w") as f:
    json.dump(out, f, indent=1)

"""`model_fn`'s first start and two warm starts sharing one cache (`benchmark.cold_warm`),
each with the number of Triton kernels the cache holds after it: a warm start that adds
kernels rebuilt what the first start had built. Not part of the package.

    python docs/experiments/warm_start_cache.py CHECKPOINT_DIR none|int8   # $OUT/cache_diag_<quantize>.json
"""
import json, os, sys

from fish_sm.engine.benchmark import cold_warm

checkpoint, quantize = sys.argv[1], sys.argv[2]
out = cold_warm(checkpoint, quantize, warm_starts=2)
for start, t in enumerate([out["first_start"], *out["warm_starts"]]):
    print(quantize, start, round(t["total_s"], 1), {k: round(v, 2) for k, v in t.get("captures", {}).items()},
          "load", round(t.get("load", -1), 1), "triton kernels", t["triton_kernels"], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"cache_diag_{quantize}.json"), "w"), indent=1)

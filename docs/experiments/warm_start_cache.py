"""`model_fn`'s first start and two warm starts sharing one cache (as `cold_warm`), with the
number of Triton kernels the cache holds after each: a warm start that adds kernels rebuilt
what the first start had built. Not part of the package.

    python docs/experiments/warm_start_cache.py CHECKPOINT_DIR none|int8   # $OUT/cache_diag_<quantize>.json
"""
import json, os, subprocess, sys, tempfile

from fish_sm.engine.benchmark import COLD_WARM

checkpoint, quantize = sys.argv[1], sys.argv[2]
out = []
with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "FISH_SM_CACHE_DIR": cache, "FISH_SM_QUANTIZE": quantize, "FISH_SM_COMPILE": "true",
           "FISH_SM_WARMUP": "2"}
    for start in range(3):
        proc = subprocess.run([sys.executable, "-c", COLD_WARM, checkpoint], env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("MODEL_FN ")]
        t = json.loads(line[-1][len("MODEL_FN "):]) if line else {"error": proc.stderr[-1500:]}
        t["triton_cache_dirs"] = sum(len(dirs) for root, dirs, _ in os.walk(cache) if root.endswith("triton"))
        out.append(t)
        print(quantize, start, round(t.get("total_s", -1), 1), {k: round(v, 2) for k, v in t.get("captures", {}).items()},
              "load", round(t.get("load", -1), 1), "triton kernels", t["triton_cache_dirs"], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"cache_diag_{quantize}.json"), "w"), indent=1)

"""The batching engine with and without inductor's coordinate-descent tuning for its steps of
several rows (dual_ar.MANY_ROWS_OPTIONS; one-row steps are tuned in both), at a few stream
counts, in one process. As run once for docs/benchmarks.md (fifth pass). Not part of the package.

    python docs/experiments/batching_tuning_ab.py CHECKPOINT_DIR 1,32    # writes $OUT/batching_ab.json
"""
import json, os, sys
from fish_sm.model import dual_ar
from fish_sm.engine.benchmark import batching_curve

out = {}
streams = [int(n) for n in sys.argv[2].split(",")]
for variant in ("off", "on"):
    dual_ar.MANY_ROWS_OPTIONS = {"coordinate_descent_tuning": True} if variant == "on" else {}
    out[variant] = batching_curve(sys.argv[1], "bf16", streams, 200, 2048, "cuda")
    print(variant, "compile_s", round(out[variant]["compile_s"], 1), flush=True)
    json.dump(out, open(os.environ.get("OUT", ".") + "/batching_ab.json", "w"), indent=1)

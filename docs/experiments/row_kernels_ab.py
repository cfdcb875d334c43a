"""The batching engine with and without the sampling kernels for its steps of several rows
(generate.ROW_KERNELS: `sampling_kernels._pick_rows` against the compiled torch nucleus with its
sort), at a few stream counts, in one process. Not part of the package.

    python docs/experiments/row_kernels_ab.py CHECKPOINT_DIR 32,64 [on,off]   # writes $OUT/row_kernels_ab.json
"""
import json, os, sys

from fish_sm.engine import generate
from fish_sm.engine.benchmark import batching_curve

out = {}
streams = [int(n) for n in sys.argv[2].split(",")]
for variant in (sys.argv[3] if len(sys.argv) > 3 else "on,off").split(","):
    generate.ROW_KERNELS = variant == "on"
    out[variant] = batching_curve(sys.argv[1], "bf16", streams, 200, 2048, "cuda")
    print(variant, json.dumps({k: v for k, v in out[variant].items() if k not in ("levels", "sequential")}), flush=True)
    for level in out[variant]["levels"]:
        print(variant, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in level.items()}), flush=True)
    json.dump(out, open(os.environ.get("OUT", ".") + "/row_kernels_ab.json", "w"), indent=1)

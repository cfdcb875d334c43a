"""The batching engine with its several-row steps compiled with inductor's GEMM autotuning
(max_autotune_gemm: Triton templates timed against cuBLAS for each product, with the work
around them fused into their epilogues) or without (dual_ar.MANY_ROWS_OPTIONS as shipped: the
products stay with cuBLAS), at a few stream counts, with the decode step's kernel profile at
each batch size, in one process. Not part of the package.

    python docs/experiments/gemm_autotune_ab.py CHECKPOINT_DIR 32,64 [autotune,cublas]   # writes $OUT/gemm_autotune_ab.json
"""
import json, os, sys

from fish_sm.model import dual_ar
from fish_sm.engine.benchmark import batching_curve

VARIANTS = {"cublas": {}, "autotune": {"max_autotune_gemm": True}}
out = {}
streams = [int(n) for n in sys.argv[2].split(",")]
for variant in (sys.argv[3] if len(sys.argv) > 3 else "autotune,cublas").split(","):
    dual_ar.MANY_ROWS_OPTIONS = VARIANTS[variant]
    out[variant] = batching_curve(sys.argv[1], "bf16", streams, 200, 2048, "cuda", profile=True)
    print(variant, "compile_s", round(out[variant]["compile_s"], 1), flush=True)
    for level in out[variant]["levels"]:
        print(variant, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in level.items()}), flush=True)
    json.dump(out, open(os.environ.get("OUT", ".") + "/gemm_autotune_ab.json", "w"), indent=1)

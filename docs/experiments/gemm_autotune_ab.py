"""The batching engine with its several-row steps compiled with inductor's GEMM autotuning
(max_autotune_gemm: Triton templates timed against cuBLAS for each product, with the work
around them fused into their epilogues) or without (dual_ar.MANY_ROWS_OPTIONS as shipped: the
products stay with cuBLAS), at a few stream counts, with the decode step's kernel profile at
each batch size, in one process. Not part of the package.

    python docs/experiments/gemm_autotune_ab.py CHECKPOINT_DIR 32,64 [autotune,cublas]   # writes $OUT/gemm_autotune_ab.json
"""
import sys

from experiment_tools import curves_by_variant

from fish_sm.model import dual_ar

VARIANTS = {"cublas": {}, "autotune": {"max_autotune_gemm": True}}


def use(variant):
    dual_ar.MANY_ROWS_OPTIONS = VARIANTS[variant]


curves_by_variant(sys.argv[1], [int(n) for n in sys.argv[2].split(",")],
                  (sys.argv[3] if len(sys.argv) > 3 else "autotune,cublas").split(","), use, "gemm_autotune_ab",
                  profile=True)

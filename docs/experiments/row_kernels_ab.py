"""The batching engine with and without the sampling kernels for its steps of several rows
(generate.ROW_KERNELS: `sampling_kernels._pick_rows` against the compiled torch nucleus with its
sort), at a few stream counts, in one process. Not part of the package.

    python docs/experiments/row_kernels_ab.py CHECKPOINT_DIR 32,64 [on,off]   # writes $OUT/row_kernels_ab.json
"""
import sys

from experiment_tools import curves_by_variant

from fish_sm.engine import generate


def use(variant):
    generate.ROW_KERNELS = variant == "on"


curves_by_variant(sys.argv[1], [int(n) for n in sys.argv[2].split(",")],
                  (sys.argv[3] if len(sys.argv) > 3 else "on,off").split(","), use, "row_kernels_ab")

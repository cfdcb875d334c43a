"""The batching engine with and without inductor's coordinate-descent tuning for its steps of
several rows (dual_ar.MANY_ROWS_OPTIONS; one-row steps are tuned in both), at a few stream
counts, in one process. As run once for docs/benchmarks.md (fifth pass). Not part of the package.

    python docs/experiments/batching_tuning_ab.py CHECKPOINT_DIR 1,32    # writes $OUT/batching_ab.json
"""
import sys

from experiment_tools import curves_by_variant

from fish_sm.model import dual_ar


def use(variant):
    dual_ar.MANY_ROWS_OPTIONS = {"coordinate_descent_tuning": True} if variant == "on" else {}


curves_by_variant(sys.argv[1], [int(n) for n in sys.argv[2].split(",")], ["off", "on"], use, "batching_ab")

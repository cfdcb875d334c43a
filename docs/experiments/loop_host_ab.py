"""The batching loop's host work per step, A/B in one process (eighteenth pass): each step's
noise from a generator per request (one `exponential_` each) against one kernel keyed by
each request's seed and frame (`sampling_kernels.exponential_noise`); and a request's move
to a freed slot as a copy a layer from Python against one `copy_cache_rows` call. 32
streams at once and a closed loop of 32 clients x 6 requests, the settings in turns (the
engine started afresh for each, as `settings_in_turns` runs it; as measured, one start for
all). Not part of the package.

    cd docs/experiments && python3 loop_host_ab.py CHECKPOINT_DIR [ROUNDS]    # writes $OUT/loop_host_ab.json
"""
import json, os, sys

from experiment_tools import LOOP_SUMMARY, compiled_batcher, settings_in_turns

from fish_sm.engine import batching as B

batcher, out = compiled_batcher(sys.argv[1], 32)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
shipped = B.copy_cache_rows


def copy_each_layer(caches, dst, src, length):  # as the seventeenth pass moved a request
    for cache in caches:
        cache.k[dst, :, :length] = cache.k[src, :, :length]
        cache.v[dst, :, :length] = cache.v[src, :, :length]


def setting(keyed: bool, move):
    def apply():
        batcher.keyed_noise, B.copy_cache_rows = keyed, move
    return apply


settings = {"generators, a copy a layer": setting(False, copy_each_layer),
            "keyed noise, one copy call": setting(True, shipped)}
out["levels"] = settings_in_turns(batcher, settings, [32], rounds, "setting", loops=(1, 6), summary=LOOP_SUMMARY)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "loop_host_ab.json"), "w"), indent=1)

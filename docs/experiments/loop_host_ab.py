"""The batching loop's host work per step, A/B in one process (eighteenth pass): each step's
noise from a generator per request (one `exponential_` each) against one kernel keyed by
each request's seed and frame (`sampling_kernels.exponential_noise`); and a request's move
to a freed slot as a copy a layer from Python against one `copy_cache_rows` call. 32
streams at once and a closed loop of 32 clients x 6 requests, the settings in turns.
Not part of the package.

    cd docs/experiments && python3 loop_host_ab.py CHECKPOINT_DIR [ROUNDS]    # writes $OUT/loop_host_ab.json
"""
import json, os, sys

from experiment_tools import compiled_batcher

from fish_sm.engine import batching as B
from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.sampling import SamplingParams

batcher, out = compiled_batcher(sys.argv[1], 32)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
shipped = B.copy_cache_rows


def copy_each_layer(caches, dst, src, length):  # as the seventeenth pass moved a request
    for cache in caches:
        cache.k[dst, :, :length] = cache.k[src, :, :length]
        cache.v[dst, :, :length] = cache.v[src, :, :length]


settings = {"generators, a copy a layer": (False, copy_each_layer), "keyed noise, one copy call": (True, shipped)}
out["levels"] = []
with batcher:
    batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for round_ in range(rounds):
        for name, (keyed, move) in settings.items():
            batcher.keyed_noise, B.copy_cache_rows = keyed, move
            for loop in (1, 6):
                level = {"setting": name, "round": round_, **batching_level(batcher, 32, 200, True, rounds=loop)}
                out["levels"].append(level)
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in level.items() if k in (
                    "setting", "round", "rounds", "aggregate_frames_per_s", "aggregate_decode_frames_per_s",
                    "steady_decode_frames_per_s", "per_request_decode_frames_per_s_median", "stopped_early",
                    "first_audio_ms_p95")}), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "loop_host_ab.json"), "w"), indent=1)

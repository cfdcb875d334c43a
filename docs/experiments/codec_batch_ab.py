"""The batching engine's codec batches, A/B: at most `max_batch_frames` frames of
same-length pieces through the conv back at once (512 as shipped: 8 pieces of 64 frames),
against larger batches, in one process (one engine; the codec's limit changed and its
missing graphs captured between variants), in turns. Not part of the package.

    python docs/experiments/codec_batch_ab.py CHECKPOINT_DIR [LIMITS=512,1024,2048] [STREAMS=16,32,64] [ROUNDS=2]
    # one JSON line per level, $OUT/codec_batch_ab.json
"""
import functools, json, os, sys, time

import torch

from fish_sm.engine.engine import freeze_start_up_objects
from experiment_tools import compiled_batcher, settings_in_turns

checkpoint = sys.argv[1]
limits = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "512,1024,2048").split(",")]
streams = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "16,32,64").split(",")]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
batcher, out = compiled_batcher(checkpoint, max(streams))
out["capture_s"] = {}
codec = batcher._codec.codec
for limit in limits:  # every variant's graphs, before any is measured
    t0 = time.perf_counter()
    codec.max_batch_frames = limit
    batcher._codec.capture(pieces=12)
    out["capture_s"][limit] = time.perf_counter() - t0
print(json.dumps({"compile_s": out["compile_s"], "capture_s": out["capture_s"],
                  "gib_free": torch.cuda.mem_get_info()[0] / 2**30}), flush=True)
freeze_start_up_objects()
out["levels"] = settings_in_turns(batcher, {limit: functools.partial(setattr, codec, "max_batch_frames", limit)
                                            for limit in limits}, streams, rounds, "max_batch_frames")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_batch_ab.json"), "w"), indent=1)

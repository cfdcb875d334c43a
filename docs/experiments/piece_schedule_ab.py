"""The batching engine's streaming codec on other piece schedules (`first:largest` frames,
4:64 as shipped), beside the decode loop: one batching engine, each schedule's codec built and
captured once, then streamed levels of 200-frame requests with the schedules in turns.
Not part of the package.

Longer first pieces mean fewer, larger codec batches; shorter largest pieces a shorter codec
tail after a burst's last frame. Seventeenth pass: neither beat 4:64 beyond the ±4% spread.

    python docs/experiments/piece_schedule_ab.py CHECKPOINT_DIR 4:64,4:32 32:1,32:3 [ROUNDS=2]
    # LEVELS are streams:rounds (1: one burst; more: a closed loop); writes $OUT/pieces_ab.json
"""
import json, os, sys, time

import torch
from experiment_tools import compiled_batcher
from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.codec_stream import StreamingCodec
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
variants = sys.argv[2].split(",")
levels = [tuple(int(x) for x in l.split(":")) for l in sys.argv[3].split(",")]  # streams:rounds
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
batcher, out = compiled_batcher(checkpoint, max(n for n, _ in levels))
print("compiled", round(out["compile_s"], 1), flush=True)
worker, codec = batcher._codec, batcher.engine.codec
codecs = {f"{worker.codec.first}:{worker.codec.largest}": worker.codec}
for v in variants:
    if v in codecs:
        continue
    first, largest = (int(x) for x in v.split(":"))
    worker.codec = StreamingCodec(codec, first, largest)
    t0 = time.perf_counter()
    worker.capture(pieces=12)
    torch.cuda.empty_cache()
    codecs[v] = worker.codec
    print(v, "captured in", round(time.perf_counter() - t0, 1), "s", flush=True)
freeze_start_up_objects()
results = []
for r in range(rounds):
    for v in variants:
        worker.codec = codecs[v]
        with batcher:
            batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
            for n, rr in levels:
                level = batching_level(batcher, n, 200, True, rounds=rr)
                level.update(variant=v, round=r)
                results.append(level)
                print(v, r, n, rr, json.dumps({k: round(level[k], 3) for k in ("aggregate_frames_per_s", "wall_s",
                      "per_request_decode_frames_per_s_median", "first_frame_ms_p50", "first_audio_ms_p95", "stopped_early")}), flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "pieces_ab.json"), "w"), indent=1)

"""A stream's last piece through the codec's back, A/B: over the shortest scheduled length
that holds it (as shipped, `StreamingCodec.back_frames`) against over its whole scheduled
length (before; for the benchmark's 200-frame requests, whose last piece is scheduled at the
largest length, 64 frames). One batching engine, the variants in turns. Not part of the
package.

    python docs/experiments/last_piece_ab.py CHECKPOINT_DIR [STREAMS=1,16,32,64] [ROUNDS=2]
    # one JSON line per level, $OUT/last_piece_ab.json
"""
import json, os, sys, time

import torch

from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.codec_stream import StreamingCodec
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
streams = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,16,32,64").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0)
t0 = time.perf_counter()
batcher.compile()
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "compile_s": time.perf_counter() - t0,
       "levels": []}
freeze_start_up_objects()
shortest = StreamingCodec.back_frames
variants = {"shortest": shortest, "scheduled": lambda self, n: self.largest}
keep = ("aggregate_frames_per_s", "per_request_decode_frames_per_s_median", "per_request_realtime_x_min",
        "first_audio_ms_p50", "first_audio_ms_p95", "wall_s")
for round_ in range(rounds):
    for name, back_frames in variants.items():
        StreamingCodec.back_frames = back_frames
        with batcher:
            batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
            for n in streams:
                level = {"last_piece": name, "round": round_, **batching_level(batcher, n, 200, True)}
                out["levels"].append(level)
                print(json.dumps({k: level[k] for k in ("last_piece", "round", "streams", *keep) if k in level}),
                      flush=True)
StreamingCodec.back_frames = shortest
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "last_piece_ab.json"), "w"), indent=1)

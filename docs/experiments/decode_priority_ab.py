"""A/B of the batching engine's decode stream priority: high (as shipped, `BatchEngine.decode_stream`)
against the default priority, which the codec's stream has too. One process, one compiled
engine, the variants in turns, streamed requests of 200 frames (fish_sm.engine.benchmark.batching_level).
Not part of the package.

    python docs/experiments/decode_priority_ab.py CHECKPOINT_DIR [STREAMS=1,32,64] [ROUNDS=2]
    # prints one JSON line per level, writes $OUT/decode_priority_ab.json
"""
import json, os, sys

import torch

from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
streams = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,32,64").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0)
batcher.compile()
levels = []
for round_ in range(rounds):
    for name, priority in (("high", -1), ("default", 0)):
        batcher.decode_stream = torch.cuda.Stream(batcher.device, priority=priority)
        with batcher:
            batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
            for n in streams:
                level = {"priority": name, "round": round_, **batching_level(batcher, n, 200, True)}
                print(json.dumps(level), flush=True)
                levels.append(level)
with open(os.path.join(os.environ.get("OUT", "."), "decode_priority_ab.json"), "w") as f:
    json.dump(levels, f, indent=1)

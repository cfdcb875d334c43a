"""When the batching engine's codec works, against the decode loop: N streamed requests of
200 frames submitted at once; every codec batch (`CodecWorker._pieces`: start, end after
its audio reached the host, pieces, scheduled frames) and every decode step's hand-over of
frames to the codec, in ms from the submission. Not part of the package.

    python docs/experiments/codec_timeline.py CHECKPOINT_DIR [STREAMS=32] [ROUNDS=2]
    # a summary line per round, $OUT/codec_timeline.json with the whole timeline
"""
import json, os, sys, time

from experiment_tools import compiled_batcher

from fish_sm.engine.batching import BatchEngine, CodecWorker, Job
from fish_sm.engine.benchmark import BATCH_TEXTS
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
events: list = []
pieces, handover = CodecWorker._pieces, BatchEngine._hand_over


def timed_pieces(self, ready):
    t0 = time.perf_counter()
    try:
        return pieces(self, ready)
    finally:
        events.append(("codec", t0, time.perf_counter(), len(ready), sum(len(f) for _, f in ready)))


def timed_handover(self, *a, **k):
    events.append(("step", time.perf_counter()))
    return handover(self, *a, **k)


CodecWorker._pieces = timed_pieces
BatchEngine._hand_over = timed_handover
batcher, out = compiled_batcher(checkpoint, n)
freeze_start_up_objects()
out.update(streams=n, rounds=[])
with batcher:
    batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for r in range(rounds):
        events.clear()
        t0 = time.perf_counter()
        tickets = [batcher.submit(Job(BATCH_TEXTS[i % len(BATCH_TEXTS)], stream=True,
                                      params=SamplingParams(seed=i, max_new_tokens=200))) for i in range(n)]
        for t in tickets:
            for _ in t.events():
                pass
        wall = time.perf_counter() - t0
        ms = lambda t: round((t - t0) * 1e3, 1)
        steps = [ms(e[1]) for e in events if e[0] == "step"]
        codec = [(ms(e[1]), ms(e[2]), e[3], e[4]) for e in events if e[0] == "codec"]
        busy = sum(b - a for a, b, _, _ in codec)
        during = sum(max(0.0, min(b, steps[-1]) - a) for a, b, _, _ in codec)
        row = {"round": r, "wall_ms": round(wall * 1e3, 1), "steps": len(steps), "last_step_ms": steps[-1],
               "codec_batches": len(codec), "codec_busy_ms": round(busy, 1),
               "codec_busy_during_decode_ms": round(during, 1), "codec_frames": sum(c[3] for c in codec),
               "first_codec_batch": codec[0] if codec else None, "last_codec_batch": codec[-1] if codec else None}
        print(json.dumps(row), flush=True)
        out["rounds"].append({**row, "step_ms": steps, "codec": codec})
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_timeline.json"), "w"))
for a, b, p, f in out["rounds"][-1]["codec"]:
    print(f"  codec {a:7.1f} -> {b:7.1f} ms  {p:3d} pieces {f:5d} frames", flush=True)

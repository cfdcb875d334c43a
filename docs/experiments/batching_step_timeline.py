"""Where a batching engine's decode step goes at many streams: host time in the loop's
Python (`_decode_step`, `_check` without its waits), the waits for a step's codes
(`HostCopy.get`), and the GPU time of each step's graph replay (CUDA events on the decode
stream), with the codec running as served and with it stopped (its pieces dropped). Not
part of the package.

    python docs/experiments/batching_step_timeline.py CHECKPOINT_DIR [STREAMS=32,64]
    # one JSON line per level, $OUT/batching_step_timeline.json
"""
import json, os, statistics, sys, time

import torch

from experiment_tools import time_replays, timed_calls

from fish_sm.engine import Engine, generate
from fish_sm.engine.batching import BatchEngine, CodecWorker, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
streams = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "32,64").split(",")]
record = {"decode_step": [], "check": [], "get_wait": [], "replays": []}


def timed(name, fn):
    return timed_calls(fn, lambda t0, t1: record[name].append(t1 - t0))


BatchEngine._decode_step = timed("decode_step", BatchEngine._decode_step)
BatchEngine._check = timed("check", BatchEngine._check)
generate.HostCopy.get = timed("get_wait", generate.HostCopy.get)
time_replays(lambda rows, start, end, t0, t1: record["replays"].append((rows, start, end, t1)))
decode_next = CodecWorker._decode_next


def dropping(self):  # the codec stopped: ready frames are dropped, nothing decoded
    for entry in self._streams.values():
        entry.frames.clear()
    return False


engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0)
batcher.compile()
freeze_start_up_objects()
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "levels": []}
for codec in ("running", "stopped"):
    CodecWorker._decode_next = decode_next if codec == "running" else dropping
    with batcher:
        if codec == "running":
            batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
        for n in streams:
            for v in record.values():
                v.clear()
            level = batching_level(batcher, n, 200, True) if codec == "running" else None
            if codec == "stopped":  # whole requests: their results wait for no audio
                t0 = time.perf_counter()
                tickets = [batcher.submit(Job(BATCH_TEXTS[i % len(BATCH_TEXTS)],
                                              params=SamplingParams(seed=i, max_new_tokens=200))) for i in range(n)]
                for t in tickets:
                    for _ in t.events():
                        pass
                level = {"streams": n, "wall_s": time.perf_counter() - t0}
            torch.cuda.synchronize()
            full = [(b, s.elapsed_time(e), t) for b, s, e, t in record["replays"] if b >= n]
            gpu = [ms for _, ms, _ in full]
            gaps = [(t1 - t0) * 1e3 for (_, _, t0), (_, _, t1) in zip(full, full[1:])]
            summary = {"codec": codec, "streams": n, "steps_at_full_batch": len(full),
                       "gpu_replay_ms_median": statistics.median(gpu) if gpu else None,
                       "host_interval_ms_median": statistics.median(gaps) if gaps else None,
                       "decode_step_host_ms_median": statistics.median(record["decode_step"]) * 1e3,
                       "check_ms_median": statistics.median(record["check"]) * 1e3,
                       "get_wait_ms_total": sum(record["get_wait"]) * 1e3,
                       "aggregate_frames_per_s": level.get("aggregate_frames_per_s"),
                       "per_request_decode_frames_per_s_median": level.get("per_request_decode_frames_per_s_median"),
                       "wall_s": level["wall_s"]}
            out["levels"].append(summary)
            print(json.dumps(summary), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "batching_step_timeline.json"), "w"), indent=1)

"""Where the batching engine's decode loop spends its time, for 32 streams at once and for
a closed loop of 32 clients x 6 requests: the loop thread's host time in each of its parts
(admission bookkeeping, starting chunks and their prefill, queuing the step, checking
frames, retiring requests and moving slots), per decode step; and the GPU time of the decode
steps' replays and of the codec's batches (CUDA events on their own streams). As run for
docs/benchmarks.md (eighteenth pass, calls 5 and 6), before a step's noise became one keyed
kernel (its "noise draws" then counted a generator's `exponential_` per request). Not part
of the package.

    cd docs/experiments && python3 loop_profile.py CHECKPOINT_DIR    # writes $OUT/loop_profile.json
"""
import collections, json, os, sys, threading, time

import torch
from experiment_tools import compiled_batcher, time_replays, timed_calls

from fish_sm.engine import batching as B
from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.generate import HostCopy
from fish_sm.engine.sampling import SamplingParams

host = collections.Counter()
calls = collections.Counter()
replays, codec = [], []


def count(owner, name: str, label: str | None = None) -> None:
    """`owner.name`'s calls on the decode loop's thread, their host time into host[label]."""
    label = label or name

    def done(t0, t1):
        if threading.current_thread().name == "fish-sm-batching":
            host[label] += t1 - t0
            calls[label] += 1
    setattr(owner, name, timed_calls(getattr(owner, name), done))


def replayed(rows, start, end, t0, t1):
    replays.append((rows, start, end))
    host["step replay call"] += t1 - t0
    calls["step replay call"] += 1


for name in ("_admit", "_start_chunks", "_prefill_batch", "_decode_step", "_check", "_retire", "_move",
             "_finish_chunk"):
    count(B.BatchEngine, name)
time_replays(replayed)
count(torch.Tensor, "exponential_", "noise draws")
count(HostCopy, "get", "HostCopy.get (waits for the step before)")
count(HostCopy, "__init__", "HostCopy (pinned copy queued)")
count(B, "to_device", "to_device")
count(B.CodecWorker, "frames", "hand over to the codec")

decode_group = B.CodecWorker._decode_group


def codec_group(self, group):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = decode_group(self, group)
    end.record()
    codec.append((len(group), start, end))
    return out


B.CodecWorker._decode_group = codec_group

batcher, out = compiled_batcher(sys.argv[1], 32)
out["levels"] = []
with batcher:
    batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for rounds in (1, 6):
        host.clear(), calls.clear(), replays.clear(), codec.clear()
        level = batching_level(batcher, 32, 200, True, rounds=rounds)
        torch.cuda.synchronize()
        steps = len(replays)
        gpu_step = sum(s.elapsed_time(e) for _, s, e in replays)
        gpu_codec = sum(s.elapsed_time(e) for _, s, e in codec)
        record = {"rounds": rounds, "frames_per_s": level["aggregate_frames_per_s"],
                  "steady_decode_frames_per_s": level.get("steady_decode_frames_per_s"),
                  "decode_span_frames_per_s": level["aggregate_decode_frames_per_s"],
                  "per_request_decode_median": level["per_request_decode_frames_per_s_median"],
                  "stopped_early": level["stopped_early"], "wall_s": level["wall_s"], "steps": steps,
                  "mean_rows": sum(r for r, _, _ in replays) / max(steps, 1),
                  "wall_ms_per_step": level["wall_s"] * 1e3 / max(steps, 1),
                  "step_replay_gpu_ms_mean": gpu_step / max(steps, 1),
                  "codec_gpu_ms_total": gpu_codec, "codec_batches": len(codec),
                  "codec_pieces_per_batch": sum(n for n, _, _ in codec) / max(len(codec), 1),
                  "host_ms_per_step": {k: v * 1e3 / max(steps, 1) for k, v in host.items()},
                  "host_ms_total": {k: v * 1e3 for k, v in host.items()}, "calls": dict(calls)}
        out["levels"].append(record)
        print(json.dumps(record), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "loop_profile.json"), "w"), indent=1)

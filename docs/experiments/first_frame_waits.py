"""Where a batching request's first frame waits, for 32 streams at once and for two closed
loops of 32 clients x 3 requests: per request, submission -> admission -> its prefill
(host start and end) -> first frame seen, and each admission's GPU time (CUDA events on the
decode stream around `_prefill_batch`: the admission's replay and the first frame's). As run
for docs/benchmarks.md (seventeenth pass, call 9). Not part of the package.

    python docs/experiments/first_frame_waits.py CHECKPOINT_DIR    # one JSON line per level
"""
import collections, json, statistics, sys, time

import torch
from experiment_tools import compiled_batcher
from fish_sm.engine import batching as B
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.sampling import SamplingParams

marks = collections.defaultdict(dict)
checks, gpu = [], []
orig_admit, orig_prefill, orig_check, orig_start = B.BatchEngine._admit, B.BatchEngine._prefill_batch, B.BatchEngine._check, B.BatchEngine._start_chunks

def admit(self, request):
    marks[id(request.ticket)]["admit"] = time.perf_counter()
    return orig_admit(self, request)

def start(self, requests, pending):
    t = time.perf_counter()
    for r in requests:
        marks[id(r.ticket)]["start_chunks"] = t
    return orig_start(self, requests, pending)

def prefill(self, group, pending):
    t = time.perf_counter()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = orig_prefill(self, group, pending)
    e1.record()
    t1 = time.perf_counter()
    gpu.append((e0, e1, len(group)))
    for r, _, _ in group:
        marks[id(r.ticket)].update(prefill=t, prefill_end=t1, group=len(group))
    return out

def check(self, pending, step):
    t = time.perf_counter()
    out = orig_check(self, pending, step)
    checks.append((time.perf_counter() - t) * 1e3)
    return out

B.BatchEngine._admit, B.BatchEngine._start_chunks, B.BatchEngine._prefill_batch, B.BatchEngine._check = admit, start, prefill, check
tickets = []
orig_submit = B.BatchEngine.submit
def submit(self, job, sink=None):
    t = orig_submit(self, job, sink); tickets.append(t); return t
B.BatchEngine.submit = submit

batcher, out = compiled_batcher(sys.argv[1], 32)
print("compile", round(out["compile_s"], 1), flush=True)
def med(xs): return round(statistics.median(xs), 2) if xs else None
with batcher:
    batcher.submit(B.Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for rounds in (1, 3, 3):
        tickets.clear(); marks.clear(); checks.clear(); gpu.clear()
        lv = batching_level(batcher, 32, 200, True, rounds)
        torch.cuda.synchronize()
        rows = []
        for t in tickets:
            m = marks[id(t)]
            ff = t.submitted + t.timings["first_frame"]
            rows.append({"queue": (m["admit"] - t.submitted) * 1e3, "admit_to_start": (m["start_chunks"] - m["admit"]) * 1e3,
                         "start_to_prefill": (m["prefill"] - m["start_chunks"]) * 1e3,
                         "prefill_host": (m["prefill_end"] - m["prefill"]) * 1e3,
                         "prefill_end_to_first_frame": (ff - m["prefill_end"]) * 1e3, "first_frame": t.timings["first_frame"] * 1e3,
                         "first_audio": t.timings.get("first_audio", 0) * 1e3, "group": m["group"]})
        summary = {k: med([r[k] for r in rows]) for k in rows[0]}
        summary["p90_first_frame"] = sorted(r["first_frame"] for r in rows)[int(0.9 * len(rows))]
        g = [(a.elapsed_time(b), n) for a, b, n in gpu]
        print(json.dumps({"rounds": rounds, "frames_per_s": round(lv["aggregate_frames_per_s"]),
                          "per_request_median": summary, "admissions": len(g), "admission_gpu_ms_median": med([x for x, _ in g]),
                          "admission_gpu_ms_by_group": {n: med([x for x, k in g if k == n]) for n in sorted({k for _, k in g})},
                          "check_ms_median": med(checks), "checks": len(checks)}), flush=True)

"""Where time to first audio goes in the batching engine: every scheduler and codec call
timed (thread, start, duration), for 32 requests at once (two text sets) and for a closed
loop of 32 clients, 3 requests each (like `fish-sm bench --stream`), with each request's
queue / first frame / first audio. As run for docs/benchmarks.md (sixth pass). Not part of
the package.

    python docs/experiments/admission_timeline.py CHECKPOINT_DIR    # writes $OUT/timeline.json

DEV (cuda), N (32 requests) and F (200 frames) in the environment shrink it for a CPU try.
"""
import collections, functools, json, math, os, statistics, sys, threading, time
import torch
from fish_sm.engine import Engine
from fish_sm.engine.sampling import SamplingParams
from fish_sm.engine import batching as B
from fish_sm.engine import codec_stream as CS
from fish_sm.engine import generate as G
from fish_sm.aws.bench import BUILTIN_TEXTS
from fish_sm.engine.benchmark import BATCH_TEXTS

events = []
T0 = time.perf_counter()

def wrap(cls, name):
    fn = getattr(cls, name)
    @functools.wraps(fn)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            extra = None
            if name in ("_prefill_batch",):
                extra = len(a[1])
            elif name == "push_many":
                extra = [int(p[1].shape[-1]) for p in a[1]]
            events.append((threading.current_thread().name, name, t - T0, time.perf_counter() - t, extra))
    setattr(cls, name, timed)

for cls, names in ((B.BatchEngine, ["_start_chunks", "_prefill_batch", "_decode_step", "_check", "_take_waiting"]),
                   (B.CodecWorker, ["_decode_next", "_pieces"]),
                   (CS.StreamingCodec, ["_fronts", "push_many"]), (G.GraphedStep, ["first_frame"])):
    for n in names:
        wrap(cls, n)

engine = Engine.from_pretrained(sys.argv[1], device=os.environ.get("DEV","cuda"), max_seq_len=2048)
batcher = B.BatchEngine(engine, max_batch=64, max_queue=0)
t = time.perf_counter(); batcher.compile(); print("compile", time.perf_counter() - t, flush=True)
out = {}
def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]
def summary(tickets):
    r = {}
    for key in ("queue", "first_frame", "first_audio"):
        xs = [t.timings[key] * 1e3 for t in tickets if key in t.timings]
        r[key] = {"p50": statistics.median(xs), "p95": pct(xs, 0.95)} if xs else None
    return r
with batcher:
    batcher.submit(B.Job(BUILTIN_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for texts, name in ((BATCH_TEXTS, "burst_bench_texts"), (BUILTIN_TEXTS, "burst_builtin_texts")):
        events.clear(); T0 = time.perf_counter()
        tickets = [batcher.submit(B.Job(texts[i % len(texts)], stream=True, params=SamplingParams(seed=i, max_new_tokens=int(os.environ.get("F",200))))) for i in range(int(os.environ.get("N",32)))]
        [t.result() for t in tickets]
        out[name] = {"requests": summary(tickets), "events": list(events),
                     "per_request": [{k: v * 1e3 for k, v in t.timings.items()} for t in tickets]}
        print(name, json.dumps(out[name]["requests"]), flush=True)
    # closed loop: 32 clients, 3 requests each, back to back
    events.clear(); T0 = time.perf_counter()
    done = []
    lock = threading.Lock()
    def client(c):
        for j in range(3):
            i = c * 3 + j
            t = batcher.submit(B.Job(BUILTIN_TEXTS[i % len(BUILTIN_TEXTS)], stream=True, params=SamplingParams(seed=i, max_new_tokens=int(os.environ.get("F",200)))))
            t.submitted_at = time.perf_counter() - T0
            t.result()
            with lock: done.append(t)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(int(os.environ.get("N",32)))]
    [th.start() for th in threads]; [th.join() for th in threads]
    out["closed_loop"] = {"requests": summary(done), "events": list(events),
                          "per_request": [{"at": t.submitted_at * 1e3, **{k: v * 1e3 for k, v in t.timings.items()}} for t in done]}
    print("closed_loop", json.dumps(out["closed_loop"]["requests"]), flush=True)
for name, part in out.items():
    agg = collections.defaultdict(lambda: [0, 0.0])
    horizon = max(r.get("first_audio", 0) for r in part["per_request"]) / 1e3 if name != "closed_loop" else 1e9
    for th, fn, st, dur, extra in part["events"]:
        if st <= horizon:
            agg[(th, fn)][0] += 1; agg[(th, fn)][1] += dur * 1e3
    print(name, "until last first audio" if horizon < 1e8 else "whole run", {f"{th}:{fn}": (n, round(ms, 1)) for (th, fn), (n, ms) in sorted(agg.items())}, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "timeline.json"), "w"))

"""What the batching engine's start-up holds in GPU memory, phase by phase, at the model's
full KV length: allocated and reserved memory after each capture phase, and, at the end (or
when it runs out), the live blocks grouped by the fish_sm line that allocated them, in graph
pools or not. As run for docs/benchmarks.md (seventh pass), after `fish-sm serve` ran out of
memory starting at 64 slots of 8,192 tokens. Not part of the package.

    python docs/experiments/batching_memory.py CHECKPOINT_DIR [MAX_BATCH]   # writes $OUT/batching_memory.json
"""
import collections, functools, json, os, sys, time
import torch
from fish_sm.engine.engine import Engine
from fish_sm.engine import batching as B, codec_stream as CS, generate as G

torch.cuda.memory._record_memory_history(max_entries=400000)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": []}
T0 = time.perf_counter()


def note(name):
    free, total = torch.cuda.mem_get_info()
    row = {"phase": name, "s": round(time.perf_counter() - T0, 1), "allocated_gib": torch.cuda.memory_allocated() / 2**30,
           "reserved_gib": torch.cuda.memory_reserved() / 2**30, "free_gib": free / 2**30}
    out["phases"].append(row)
    print(json.dumps(row), flush=True)


def phase(cls, name):
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapped(*a, **k):
        try:
            return fn(*a, **k)
        finally:
            note(f"{cls.__name__}.{name}")
    setattr(cls, name, wrapped)


for cls, name in ((G.GraphedStep, "capture_all"), (B.BatchEngine, "_compile_admissions"),
                  (B.BatchEngine, "_check_admissions"), (CS.StreamingCodec, "capture"),
                  (CS.StreamingCodec, "working_bytes")):
    phase(cls, name)

engine = Engine.from_pretrained(sys.argv[1], device="cuda")
note("loaded")
batcher = B.BatchEngine(engine, max_batch=int(sys.argv[2]) if len(sys.argv) > 2 else 64)
note(f"slots allocated ({batcher.slots})")
out["slots"] = batcher.slots
try:
    batcher.compile()
    out["outcome"] = "compiled"
except torch.OutOfMemoryError as exc:
    out["outcome"] = f"out of memory: {str(exc)[:300]}"
note("end")

live = collections.Counter()
for segment in torch.cuda.memory_snapshot():
    pooled = tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    for block in segment["blocks"]:
        if block["state"] != "active_allocated":
            continue
        frames = [f for f in block.get("frames", []) if "fish_sm" in f["filename"] or "experiments" in f["filename"]]
        where = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames[:3]) or "?"
        live[("pool" if pooled else "plain", where)] += block["size"]
out["live_gib"] = [{"kind": k, "where": w, "gib": round(b / 2**30, 3)} for (k, w), b in live.most_common(40)]
for row in out["live_gib"][:30]:
    print(row["gib"], row["kind"], row["where"][:230])
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "batching_memory.json"), "w"), indent=1)

"""Where a warm `model_fn` start spends its time: a first start fills an empty compile cache,
then a second start from that cache runs under cProfile. As run once for docs/benchmarks.md
(fifth pass). Not part of the package.

    python docs/experiments/warm_start_profile.py CHECKPOINT_DIR none|int8 [OPTIONS_JSON]    # writes $OUT/warm_start_<mode>.txt

OPTIONS_JSON: inductor options added to the decode step's (dual_ar.ONE_ROW_OPTIONS).
"""
import os, subprocess, sys, tempfile

RUN = """
import cProfile, io, json, os, pstats, sys, time
from fish_sm.model import dual_ar
dual_ar.ONE_ROW_OPTIONS.update(json.loads(os.environ.get("EXTRA_OPTIONS", "{}")))
from fish_sm.serving.handler import model_fn
profiler = cProfile.Profile() if sys.argv[2] == "profile" else None
t0 = time.perf_counter()
if profiler: profiler.enable()
model = model_fn(sys.argv[1])
if profiler: profiler.disable()
total = time.perf_counter() - t0
from torch._dynamo.utils import counters
print("MODEL_FN", json.dumps({"total_s": total, **model.timings,
      "counters": {f"{g}.{k}": v for g in ("inductor", "aot_autograd", "stats") for k, v in counters[g].items()}}))
if profiler:
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(45)
        print(out.getvalue())
"""

checkpoint, mode = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "FISH_SM_CACHE_DIR": cache, "FISH_SM_QUANTIZE": mode, "FISH_SM_COMPILE": "true",
           "FISH_SM_WARMUP": "2", "EXTRA_OPTIONS": sys.argv[3] if len(sys.argv) > 3 else "{}"}
    report = []
    for run in ("plain", "profile"):
        proc = subprocess.run([sys.executable, "-c", RUN, checkpoint, run], env=env, capture_output=True, text=True)
        report.append(f"==== {run} start (rc {proc.returncode})\n{proc.stdout}\n{proc.stderr[-2000:] if proc.returncode else ''}")
        print(report[-1][:3000], flush=True)
    open(os.path.join(os.environ.get("OUT", "."), f"warm_start_{mode}.txt"), "w").write("\n".join(report))

"""Where a warm `model_fn` start spends its time: a first start fills an empty compile cache,
then a second start from that cache runs under cProfile. Every coordinate-descent tuning and
Triton compile is recorded with its kernel, autotune-cache state, seconds and caller (added
in the sixth pass). As run for docs/benchmarks.md (fifth and sixth passes). Not part of the
package.

    python docs/experiments/warm_start_profile.py CHECKPOINT_DIR none|int8 [OPTIONS_JSON]
    # writes $OUT/warm_start_<mode>.txt and $OUT/warm_start_<mode>_kernels_{plain,warm,profile}.json

Three starts: the first fills the cache, the second is a warm start as served, the third a
warm start under cProfile (added in the seventh pass; before, the profiled one was the only
warm start). OPTIONS_JSON: inductor options added to the decode step's
(dual_ar.ONE_ROW_OPTIONS); the environment's PICKERS_TUNED (JSON) updates generate.PICKERS_TUNED.
"""
import os, subprocess, sys, tempfile

RUN = """
import cProfile, io, json, os, pstats, sys, time
t0 = time.perf_counter()
import torch
import_torch = time.perf_counter() - t0
t0 = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); cuda_init = time.perf_counter() - t0
from torch._inductor.runtime import triton_heuristics as th
from fish_sm.model import dual_ar
from fish_sm.engine import generate
dual_ar.ONE_ROW_OPTIONS.update(json.loads(os.environ.get("EXTRA_OPTIONS", "{}")))
generate.PICKERS_TUNED.update(json.loads(os.environ.get("PICKERS_TUNED", "{}")))

tuned, compiled = [], []  # every coordinate-descent tuning and Triton compile, with its kernel
autotuner = th.CachingAutotuner
tune_name = "_coordinate_descent_tuning" if hasattr(autotuner, "_coordinate_descent_tuning") else "coordinate_descent_tuning"
tune, precompile = getattr(autotuner, tune_name), autotuner._precompile_config

def recorded_tune(self, launcher, *args, **kwargs):
    t = time.perf_counter()
    out = tune(self, launcher, *args, **kwargs)
    info = getattr(self, "autotune_cache_info", None) or {}
    tuned.append({"kernel": self.inductor_meta.get("kernel_name"), "configs": len(getattr(self, "configs", None) or []),
                  "cache_info": {k: str(v) for k, v in info.items()}, "s": time.perf_counter() - t})
    return out

def recorded_precompile(self, config, *args, **kwargs):
    t = time.perf_counter()
    out = precompile(self, config, *args, **kwargs)
    compiled.append({"kernel": self.inductor_meta.get("kernel_name"), "cfg": str(config), "s": time.perf_counter() - t,
                     "stack": [sys._getframe(i).f_code.co_name for i in range(1, 5)]})
    return out

setattr(autotuner, tune_name, recorded_tune)
autotuner._precompile_config = recorded_precompile
from fish_sm.serving.handler import model_fn
profiler = cProfile.Profile() if sys.argv[2] == "profile" else None
t0 = time.perf_counter()
if profiler: profiler.enable()
model = model_fn(sys.argv[1])
if profiler: profiler.disable()
total = time.perf_counter() - t0
from torch._dynamo.utils import counters
print("MODEL_FN", json.dumps({"total_s": total, "import_torch_s": import_torch, "cuda_init_s": cuda_init, **model.timings,
      "counters": {f"{g}.{k}": v for g in ("inductor", "aot_autograd", "stats") for k, v in counters[g].items()},
      "coordesc_tuned": len(tuned), "precompiles": len(compiled), "precompile_s": sum(c["s"] for c in compiled)}))
json.dump({"tuned": tuned, "compiled": compiled}, open(sys.argv[3], "w"), indent=1)
if profiler:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    for key in ("cumulative", "tottime"):
        stats.sort_stats(key).print_stats(45)
    stats.print_callers("_precompile_config|make_cubin|coordinate_descent_tuning|recheck_autotune_cache")
    print(out.getvalue())
"""

checkpoint, mode = sys.argv[1], sys.argv[2]
out = os.environ.get("OUT", ".")
with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "FISH_SM_CACHE_DIR": cache, "FISH_SM_QUANTIZE": mode, "FISH_SM_COMPILE": "true",
           "FISH_SM_WARMUP": "2", "EXTRA_OPTIONS": sys.argv[3] if len(sys.argv) > 3 else "{}"}
    report = []
    for run in ("plain", "warm", "profile"):
        kernels = os.path.join(out, f"warm_start_{mode}_kernels_{run}.json")
        proc = subprocess.run([sys.executable, "-c", RUN, checkpoint, run, kernels], env=env, capture_output=True, text=True)
        report.append(f"==== {run} start (rc {proc.returncode})\n{proc.stdout}\n{proc.stderr[-2000:] if proc.returncode else ''}")
        print(report[-1][:3000], flush=True)
    open(os.path.join(out, f"warm_start_{mode}.txt"), "w").write("\n".join(report))

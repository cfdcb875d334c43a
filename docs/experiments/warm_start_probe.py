"""What a warm `model_fn` start spends its time on, kernel by kernel: a first start fills an
empty compile cache, then a second start from it runs under cProfile with every
coordinate-descent tuning and Triton compile recorded (kernel, cache state, seconds,
caller). As run for docs/benchmarks.md (sixth pass). Not part of the package.

    python docs/experiments/warm_start_probe.py CHECKPOINT_DIR none|int8
    # writes $OUT/probe_{plain,profile}.json, $OUT/profile_warm.txt, $OUT/torch_src.txt
"""
import os, subprocess, sys, tempfile, json

RUN = r'''
import cProfile, pstats, io, json, os, sys, time, inspect
t00 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t00
t0 = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); t_cuda = time.perf_counter() - t0
from torch._inductor.runtime import triton_heuristics as th
tuned = []
orig = getattr(th.CachingAutotuner, "_coordinate_descent_tuning", None) or th.CachingAutotuner.coordinate_descent_tuning
def patched(self, launcher, *a, **k):
    t = time.perf_counter()
    out = orig(self, launcher, *a, **k)
    tuned.append({"kernel": self.inductor_meta.get("kernel_name"), "fn": getattr(self.fn, "__name__", None),
                  "configs": len(getattr(self, "configs", None) or []), "cache_info": {k2: str(v) for k2, v in (getattr(self, "autotune_cache_info", None) or {}).items()},
                  "static": bool(getattr(self, "is_statically_launchable", lambda: None)()) if hasattr(self, "is_statically_launchable") else None,
                  "s": time.perf_counter() - t})
    return out
setattr(th.CachingAutotuner, "_coordinate_descent_tuning" if hasattr(th.CachingAutotuner, "_coordinate_descent_tuning") else "coordinate_descent_tuning", patched)
compiled = []
orig_pc = th.CachingAutotuner._precompile_config
def patched_pc(self, cfg, *a, **k):
    t = time.perf_counter()
    out = orig_pc(self, cfg, *a, **k)
    st = [sys._getframe(i).f_code.co_name for i in range(1, 5)]
    compiled.append({"kernel": self.inductor_meta.get("kernel_name"), "cfg": str(cfg), "s": time.perf_counter() - t, "stack": st})
    return out
th.CachingAutotuner._precompile_config = patched_pc
from fish_sm.serving.handler import model_fn
pr = cProfile.Profile() if sys.argv[2] == "profile" else None
t0 = time.perf_counter()
if pr: pr.enable()
model = model_fn(sys.argv[1])
if pr: pr.disable()
total = time.perf_counter() - t0
from torch._dynamo.utils import counters
slow = sorted(compiled, key=lambda c: -c["s"])
print("MODEL_FN", json.dumps({"total_s": total, "import_torch_s": t_torch, "cuda_init_s": t_cuda, **model.timings,
      "counters": {f"{g}.{k}": v for g in ("inductor", "aot_autograd", "stats") for k, v in counters[g].items()},
      "coordesc_tuned": len(tuned), "precompiles": len(compiled), "precompile_s": sum(c["s"] for c in compiled)}))
out = os.environ.get("OUT", ".")
json.dump({"tuned": tuned, "compiled": compiled}, open(f"{out}/probe_{sys.argv[2]}.json", "w"), indent=1)
if pr:
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(40)
    st.print_callers("_precompile_config|make_cubin|coordinate_descent_tuning|recheck_autotune_cache")
    open(f"{out}/profile_warm.txt", "w").write(s.getvalue())
    src = []
    for obj in (th.CachingAutotuner.recheck_autotune_cache if hasattr(th.CachingAutotuner, "recheck_autotune_cache") else None,
                th.check_autotune_cache, th.CachingAutotuner.precompile, th.CachingAutotuner.run,
                getattr(th.CachingAutotuner, "_make_launchers", None)):
        if obj is not None:
            src.append(inspect.getsource(obj))
    open(f"{out}/torch_src.txt", "w").write("\n\n".join(src))
'''

checkpoint, mode = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "FISH_SM_CACHE_DIR": cache, "FISH_SM_QUANTIZE": mode, "FISH_SM_COMPILE": "true", "FISH_SM_WARMUP": "2"}
    for run in ("plain", "profile"):
        proc = subprocess.run([sys.executable, "-c", RUN, checkpoint, run], env=env, capture_output=True, text=True)
        print(f"==== {run} rc {proc.returncode}", flush=True)
        print("\n".join(l for l in proc.stdout.splitlines() if l.startswith("MODEL_FN"))[:4000], flush=True)
        open(os.path.join(os.environ.get("OUT", "."), f"probe_{run}.stderr"), "w").write(proc.stderr[-20000:])
        if proc.returncode:
            print(proc.stderr[-3000:])
    subprocess.run(["bash", "-c", f"du -sh {cache}/*/*"])

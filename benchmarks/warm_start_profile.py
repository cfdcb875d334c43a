"""Where a warm `model_fn` start spends its time. Three fresh processes share one empty
FISH_SM_CACHE_DIR: the first start fills it, the second is a warm start as served, the third a
warm start under cProfile. Each reports its total, `model_fn`'s phases (verify, load,
quantize, cache, compile, warmup, cache_save), the compile phase's graph captures by kind,
the seconds to import torch and to start CUDA, and the compile caches' hit and miss counters
(torch._dynamo's `counters`): a warm start that misses rebuilt what the first start had built.
The profiled start's functions by cumulative and own time follow, with who called Triton's
and inductor's compiles and autotuning.

    python benchmarks/warm_start_profile.py CHECKPOINT [--quantize none|int8] [--top 40] [--out DIR]

Prints each start's JSON line and the profile; writes DIR/warm_start_<quantize>.txt (all of
it) and DIR/warm_start_<quantize>.prof (pstats, for snakeviz or `python -m pstats`); DIR is
--out, else $OUT, else the current directory. It needs a GPU to mean anything (on a CPU,
`model_fn` compiles with torch.compile only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import cProfile, io, json, pstats, sys, time
checkpoint, profiled, stats_path, top = sys.argv[1], sys.argv[2] == "profile", sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
import torch
import_torch = time.perf_counter() - t0
t0 = time.perf_counter()
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
cuda_init = time.perf_counter() - t0
from fish_sm.serving.mms.handler import model_fn
profiler = cProfile.Profile() if profiled else None
t0 = time.perf_counter()
if profiler:
    profiler.enable()
model = model_fn(checkpoint)
if profiler:
    profiler.disable()
total = time.perf_counter() - t0
from torch._dynamo.utils import counters
print("MODEL_FN " + json.dumps({
    "total_s": total, "import_torch_s": import_torch, "cuda_init_s": cuda_init, **model.timings,
    "captures": getattr(model.engine.batching().runner.captured, "timings", {}),
    "counters": {f"{g}.{k}": v for g in ("inductor", "aot_autograd", "stats") for k, v in counters[g].items()}}))
if profiler:
    profiler.dump_stats(stats_path)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    for key in ("cumulative", "tottime"):
        stats.sort_stats(key).print_stats(top)
    stats.sort_stats("cumulative").print_callers("precompile|make_cubin|coordinate_descent|autotune|compile_module")
    print(out.getvalue())
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint or package directory")
    p.add_argument("--quantize", default="none", choices=("none", "int8"), help="FISH_SM_QUANTIZE for the starts")
    p.add_argument("--top", type=int, default=40, help="functions listed per sort")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where the report and the pstats file go")
    a = p.parse_args(argv)
    stats = os.path.join(a.out, f"warm_start_{a.quantize}.prof")
    report = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FISH_SM_CACHE_DIR": cache, "FISH_SM_QUANTIZE": a.quantize, "FISH_SM_COMPILE": "true",
               "FISH_SM_WARMUP": "2"}
        env.pop("TRITON_CACHE_DIR", None)  # Triton's kernels in the compile cache, as in a fresh container
        for run in ("first", "warm", "profile"):
            proc = subprocess.run([sys.executable, "-c", CHILD, a.checkpoint, run, stats, str(a.top)], env=env,
                                  capture_output=True, text=True)
            lines = proc.stdout.splitlines()
            summary = next((json.loads(x[len("MODEL_FN "):]) for x in lines if x.startswith("MODEL_FN ")), None)
            rest = "\n".join(x for x in lines if not x.startswith("MODEL_FN "))
            text = f"==== {run} start (rc {proc.returncode})\n{json.dumps(summary)}\n{rest}"
            if proc.returncode:
                text += "\n" + proc.stderr[-3000:]
            report.append(text)
            print(text, flush=True)
            if proc.returncode:
                break
    with open(os.path.join(a.out, f"warm_start_{a.quantize}.txt"), "w") as f:
        f.write("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a batching engine core's start goes (`serving.core.start_engine`, the path to a healthy
`/ping` once the front end is up): its phases, every graph capture timed by kind and shape
(decode steps, first frames, admissions, the codec's fronts and backs), dynamo's and inductor's
compile times, and the compile caches' counters. One process a start; run it with an empty
FISH_SM_CACHE_DIR for a cold start, again with the same one for a warm start.

`--save-artifacts FILE` writes torch's portable compile artifacts (`torch.compiler.
save_cache_artifacts`) after the start; `--load-artifacts FILE` loads them before it (give the
run a fresh FISH_SM_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR=$FISH_SM_CACHE_DIR/cuda0, where the
start looks): the two ways to ship compiled work, side by side.

    FISH_SM_CACHE_DIR=DIR python benchmarks/core_start_profile.py CHECKPOINT [--label L]
        [--save-artifacts FILE | --load-artifacts FILE]

Prints one JSON line (RESULT ...). Settings come from the environment, as a server takes them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from fish_sm.engine import codec_stream, generate  # noqa: E402
from fish_sm.engine.batching import runner  # noqa: E402
from fish_sm.settings import Settings  # noqa: E402

TIMES: dict[str, list] = collections.defaultdict(list)


def timed(owner, name: str, key=lambda args: str(args[1:])[:40]) -> None:
    """Record each call of owner.name: (its key of the call's arguments, by default all but
    `self`; seconds, the GPU's work included)."""
    fn = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        TIMES[name].append((key(args), round(time.perf_counter() - t0, 3)))
        return out

    setattr(owner, name, call)


def summary(calls: list) -> dict:
    return {"n": len(calls), "seconds": round(sum(s for _, s in calls), 1),
            "slowest": sorted(calls, key=lambda c: -c[1])[:6]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--label", default="start")
    ap.add_argument("--save-artifacts")
    ap.add_argument("--load-artifacts")
    args = ap.parse_args()
    for name in ("capture", "capture_first", "capture_admission"):
        timed(generate.GraphedStep, name)
    timed(runner.ModelRunner, "_compile_admissions")
    timed(runner.ModelRunner, "_check_admissions")
    # A codec graph's capture is its Replay's construction: its first run (compiling, cuDNN's
    # timing of its convs' algorithms) and the capture; keyed by the half and the input's shape.
    timed(codec_stream, "Replay", key=lambda a: f"{getattr(a[0], '__name__', '?')} {tuple(a[1][-1].shape)}")
    t0 = time.perf_counter()
    out: dict = {"label": args.label}
    if args.load_artifacts:
        torch.compiler.load_cache_artifacts(Path(args.load_artifacts).read_bytes())
        out["artifacts_load_s"] = round(time.perf_counter() - t0, 2)
    from fish_sm.serving.core import start_engine

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model, batcher = start_engine(Path(args.checkpoint), device, Settings.from_env())
    out.update(total_s=round(time.perf_counter() - t0, 1), slots=batcher.slots,
               phases={k: round(v, 2) for k, v in model.timings.items()},
               captures={k: summary(v) for k, v in TIMES.items()})
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    out["compile_times_s"] = {n: round(float(v), 2) for n, v in zip(names, values) if float(v) >= 0.5}
    out["counters"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "inductor", "aot_autograd")}
    if args.save_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved:
            Path(args.save_artifacts).write_bytes(saved[0])
            out["artifacts_bytes"] = len(saved[0])
    print("RESULT", json.dumps(out, default=str), flush=True)
    batcher.stop()
    os._exit(0)  # the engine's threads and compile workers need not wind down


if __name__ == "__main__":
    main()

"""The batching engine's codec alone, as served (`CodecWorker`: its thread and CUDA stream, its
captured graphs, its batching of pieces and its hold): N streamed requests of F random frames
each, handed over all at once so that nothing waits on the transformer. Per codec precision
(`CodecWorker`'s `precision`: auto, as shipped, or float32) and batches queued at once
(`--depths`: the worker's `depth`, 2 as shipped), two plain runs, and one under a CUDA profile
at the first depth: frames/s, the latest first audio, and the kernels by GPU time.

    python benchmarks/codec_throughput.py CHECKPOINT [--streams 32] [--frames 200] [--precisions auto,float32]
        [--depths 2] [--top 12] [--out DIR]

One JSON line per run (the profiled one's top kernels below it); DIR/codec_throughput.json
(DIR: --out, else $OUT, else .). On a CPU it runs on a tiny checkpoint (no graphs, no
profile), to check the script.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import environment, release  # noqa: E402


def kernels_ms(prof, width: int = 90) -> collections.Counter:
    """A finished CUDA profile's kernel time in ms by name (cut to `width` characters)."""
    by_name = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:width]] += e.device_time_total / 1e3
    return by_name


def one_run(worker, codes: list[np.ndarray], label: str, profile: bool, top: int) -> dict:
    """Every stream's frames handed to a started worker at once, one frame of all streams at a
    time (as decode steps hand them over), then their ends; until every stream's last audio."""
    from fish_sm.engine.batching import Job, Ticket

    n, frames = len(codes), codes[0].shape[1]
    tickets = [Ticket(Job("x", stream=True)) for _ in range(n)]
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    lanes = np.array([worker.lanes.take() for _ in range(n)])
    for lane, ticket in zip(lanes, tickets):
        worker.open(int(lane), ticket)
    stacked = np.stack(codes)  # [streams, C, frames]
    worker.start()
    t0 = time.perf_counter()
    for i in range(frames):
        worker.frames(lanes, stacked[:, :, i])
    for lane, c in zip(lanes, codes):
        worker.finish(int(lane), [c])
    firsts = []
    for t in tickets:
        for kind, payload in t.events():
            if kind == "error":
                raise RuntimeError(f"the codec failed: {payload!r}")
        firsts.append(t.timings.get("first_audio", 0.0))
    wall = time.perf_counter() - t0
    worker.stop()
    result = {"run": label, "wall_s": wall, "frames_per_s": n * frames / wall, "first_audio_ms_max": max(firsts) * 1e3}
    if prof is not None:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        by_name = kernels_ms(prof)
        result["kernel_ms_total"] = sum(by_name.values())
        result["top"] = by_name.most_common(top)
    return result


def main(argv: list[str] | None = None) -> dict:
    from fish_sm.engine import Engine
    from fish_sm.engine.batching import CodecWorker

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--frames", type=int, default=200, help="frames per stream")
    p.add_argument("--precisions", default="auto,float32", help="CodecWorker precisions: auto, float32")
    p.add_argument("--first-piece", type=int, default=4, help="the schedule's first piece, in frames")
    p.add_argument("--largest-piece", type=int, default=64, help="the schedule's largest piece, in frames")
    p.add_argument("--depths", default="2", help="CodecWorker depths to run (batches on the GPU at once)")
    p.add_argument("--top", type=int, default=12, help="kernels listed from the profiled run")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where codec_throughput.json goes")
    a = p.parse_args(argv)
    engine = Engine.from_pretrained(a.checkpoint, device=a.device)
    cuda = engine.device.type == "cuda"
    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 1024, size=(engine.config.num_codebooks, a.frames)) for _ in range(a.streams)]
    out = {"environment": environment(), "streams": a.streams, "frames": a.frames, "precisions": {}}
    for precision in a.precisions.split(","):
        worker = CodecWorker(engine, a.first_piece, a.largest_piece, precision, lanes=a.streams)
        t0 = time.perf_counter()
        worker.capture()
        runs = out["precisions"][precision] = {"capture_s": time.perf_counter() - t0, "runs": []}
        depths = [int(d) for d in a.depths.split(",")]
        labels = [(d, "plain") for d in depths for _ in range(2)] + ([(depths[0], "profiled")] if cuda else [])
        for depth, label in labels:
            worker.depth = depth
            r = dict(one_run(worker, codes, label, label == "profiled", a.top), depth=depth)
            runs["runs"].append(r)
            print(precision, json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
            for name, ms in r.get("top", []):
                print(f"    {ms:9.2f} ms  {name}", flush=True)
            with open(os.path.join(a.out, "codec_throughput.json"), "w") as f:
                json.dump(out, f, indent=1)
        del worker
        release(engine.device)
    return out


if __name__ == "__main__":
    main()

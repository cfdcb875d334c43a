"""Where the batching engine's time goes at many streams, step by step: each level (N streamed
requests of F frames, as one burst or as a closed loop of R requests a client, as
benchmarks/engine.py runs them) is run up to three times on one compiled engine (`--runs`):

1. plain: frames/s (text to last audio, decode span, steady window), first audio, the wall
   time per decode step, and the engine thread's host time per step: its iterations' wall time
   less their waits for the GPU's frames and for work, and the part of it that was the thread's
   own CPU time (the rest: waiting for the GIL) (`BatchEngine.stats`, always counted), the CPU
   its waits took (a driver spinning in them), and the codec thread's CPU time per step, split
   into its waits for audio (`CodecWorker.audio_waits`) and its own work;
2. cuda: the same with a CUDA profile (torch.profiler) and no Python hook: each CUDA stream's
   GPU time (kernels, busy time as the union of its kernels' intervals, the kernels that took
   most of it), the decode stream's busy time per step (the stream that ran the decode step's
   noise kernel), how long it and the codec's stream (the next busiest) ran at the same time,
   and the wall time per step against that busy time;
3. hook: the host time of the engine thread's and the codec thread's calls, per decode step,
   from a profile hook on those threads (`threading.setprofile`: nothing in fish_sm is
   replaced; each call's time includes what it calls, and the hook slows the Python it
   watches, so compare this run's frames/s with the plain one's);
4. ops: torch.profiler's CPU view of the same threads: per step, the CPU time of the torch ops
   and CUDA runtime calls each thread made, and those that took most of it.

    python benchmarks/batching_profile.py CHECKPOINT [--streams 32] [--frames 200] [--rounds 1,6]
        [--modes bf16] [--max-seq-len 2048] [--runs plain,cuda,hook] [--out DIR]

One JSON line per level and run; DIR/batching_profile.json (DIR: --out, else $OUT, else .).
On a CPU it runs (without the CUDA profile) on a tiny checkpoint, to check the script.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import (BATCH_TEXTS, batching_level, environment, load,  # noqa: E402
                               start_up_frozen)

# The calls timed, by thread: (class, method) as the engine's modules name them today. One
# that no longer exists is reported as missing, not an error.
ENGINE_THREAD = "fish-sm-batching"
CODEC_THREAD = "fish-sm-codec"
TOP_KERNELS = 12  # kernels by time reported per CUDA stream
DECODE_KERNEL = "_exponential"  # the Triton kernel that draws each decode step's noise (kernels.exponential_noise)
TIMED = [
    ("fish_sm.engine.batching.engine", "BatchEngine", "_schedule"),  # wait for work, the scheduler's decisions
    ("fish_sm.engine.batching.engine", "BatchEngine", "_execute"),  # admissions, prefills, the step queued
    ("fish_sm.engine.batching.runner", "ModelRunner", "prefill"),  # chunks that start: prefill and first frames
    ("fish_sm.engine.batching.runner", "ModelRunner", "decode"),  # one decode step queued (its graph replay)
    ("fish_sm.engine.batching.scheduler", "Scheduler", "decoding"),  # which slots decode (arrays)
    ("fish_sm.engine.batching.engine", "BatchEngine", "_update"),  # stop checks on the last step, hand-over
    ("fish_sm.engine.batching.scheduler", "Scheduler", "check"),  # a step's stop checks (arrays)
    ("fish_sm.engine.generate", "HostCopy", "get"),  # waits for a copy to the host (a step's codes, audio)
    ("fish_sm.engine.batching.engine", "BatchEngine", "_retire"),  # a finished request leaves its slot
    ("fish_sm.engine.batching.codec_worker", "CodecWorker", "_launch"),  # choose one batch and queue it
    ("fish_sm.engine.batching.codec_worker", "CodecWorker", "_finish"),  # wait for a batch's audio, deliver it
    ("fish_sm.engine.batching.codec_worker", "CodecWorker", "_pieces"),  # one batch of pieces queued through the codec
    ("fish_sm.engine.codec_stream", "StreamingCodec", "push"),  # the codec's fronts and backs
    ("fish_sm.engine.batching.codec_worker", "CodecWorker", "_take_all"),  # messages taken in from the queue
]


def timed_code() -> tuple[dict, list[str]]:
    """{code object: "Class.method"} for `TIMED`, and those not found."""
    import importlib

    codes, missing = {}, []
    for module, cls, name in TIMED:
        fn = getattr(getattr(importlib.import_module(module), cls, None), name, None)
        code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
        if code is None:
            missing.append(f"{cls}.{name}")
        else:
            codes[code] = f"{cls}.{name}"
    return codes, missing


class CallTimer:
    """A profile hook (`sys.setprofile` / `threading.setprofile`) that times the calls of chosen
    code objects: seconds and calls by (thread name, label), each call from its start to its
    return (what it calls included)."""

    def __init__(self, codes: dict):
        self.codes = codes
        self.started: dict[int, float] = {}  # id(frame) -> start
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg):
        if event == "call":
            if frame.f_code in self.codes:
                self.started[id(frame)] = time.perf_counter()
        elif event == "return":
            label = self.codes.get(frame.f_code)
            if label is not None:
                t0 = self.started.pop(id(frame), None)
                if t0 is not None:
                    key = (threading.current_thread().name, label)
                    self.seconds[key] += time.perf_counter() - t0
                    self.calls[key] += 1


@contextlib.contextmanager
def timing_new_threads(codes: dict):
    """A `CallTimer` hooked into the threads started inside the block (the batching engine's,
    started by `with batcher`)."""
    timer = CallTimer(codes)
    threading.setprofile(timer)
    try:
        yield timer
    finally:
        threading.setprofile(None)


def stream_times(trace: list[dict]) -> dict:
    """Per CUDA stream of a chrome trace: kernels, their summed and busy (union) ms, and its
    busy intervals (for overlaps)."""
    by_stream = collections.defaultdict(list)
    by_name = collections.defaultdict(lambda: collections.defaultdict(float))  # stream -> kernel -> µs
    for e in trace:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            stream = e.get("args", {}).get("stream", e.get("tid"))
            by_stream[stream].append((e["ts"], e["ts"] + e["dur"], e["cat"]))
            if e.get("cat") == "kernel":
                by_name[stream][e.get("name", "")] += e["dur"]
    out = {}
    for stream, spans in by_stream.items():
        merged = union((start, end) for start, end, _ in spans)
        names = by_name[stream]
        out[stream] = {"kernels": sum(cat == "kernel" for _, _, cat in spans),
                       "summed_ms": sum(end - start for start, end, _ in spans) / 1e3,
                       "busy_ms": sum(end - start for start, end in merged) / 1e3, "intervals": merged,
                       "decode": any(DECODE_KERNEL in name for name in names),
                       # the kernels that took most of the stream's time (names cut to 90 characters)
                       "top_ms": {name[:90]: round(us / 1e3, 2)
                                  for name, us in sorted(names.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]}}
    return out


def reported(stream: dict, digits: int) -> dict:
    """One stream of `stream_times` as reported: its figures rounded, its top kernels, no intervals."""
    return {k: v if k == "top_ms" else round(v, digits) for k, v in stream.items() if k != "intervals"}


def union(intervals) -> list[list[float]]:
    """(start, end) intervals as the sorted, disjoint intervals that cover them."""
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def chrome_trace(prof) -> list[dict]:
    """A finished torch.profiler profile's events, through its Chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def overlap_ms(a: list, b: list) -> float:
    """Time two sorted, disjoint interval lists (µs) share, in ms."""
    i = j = 0
    shared = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        shared += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared / 1e3


def gpu_summary(prof, steps: int) -> dict:
    streams = stream_times(chrome_trace(prof))
    # The decode stream: the one that ran the decode step's noise kernel (else the one with the most
    # kernels); the codec's: the busiest of the others.
    ranked = sorted(streams, key=lambda s: (not streams[s]["decode"], -streams[s]["kernels"]))
    out = {"streams": {str(s): reported(streams[s], 2) for s in ranked}}
    if ranked:
        decode = streams[ranked[0]]
        out["decode_stream"] = str(ranked[0])
        out["decode_busy_ms_per_step"] = decode["busy_ms"] / max(steps, 1)
        out["decode_kernels_per_step"] = decode["kernels"] / max(steps, 1)
        rest = sorted(ranked[1:], key=lambda s: -streams[s]["busy_ms"])
        if rest:
            out["codec_stream"] = str(rest[0])
            out["codec_busy_ms"] = streams[rest[0]]["busy_ms"]
            out["decode_and_codec_together_ms"] = overlap_ms(decode["intervals"], streams[rest[0]]["intervals"])
    return out


def ops_summary(prof, threads: dict[int, str], steps: int, top: int = 12) -> dict:
    """Per thread of the engine (by native id): ms per step inside torch ops and inside CUDA
    runtime calls (each the union of its events' intervals), and the ops and calls that took
    most of it (inclusive times, and calls per step)."""
    trace = chrome_trace(prof)
    spans = collections.defaultdict(list)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in trace:
        thread = threads.get(e.get("tid"))
        if thread is None or e.get("ph") != "X" or "dur" not in e:
            continue
        kind = "runtime" if e.get("cat") in ("cuda_runtime", "cuda_driver") else "op"
        spans[(thread, kind)].append((e["ts"], e["ts"] + e["dur"]))
        entry = by_name[(thread, kind, e["name"])]
        entry[0] += e["dur"]
        entry[1] += 1
    per = max(steps, 1)
    out = {}
    for thread in threads.values():
        record = out[thread] = {}
        for kind in ("op", "runtime"):
            merged = union(spans[(thread, kind)])
            record[f"{kind}_ms_per_step"] = round(sum(hi - lo for lo, hi in merged) / 1e3 / per, 3)
            named = sorted(((name, v) for (t, k, name), v in by_name.items() if t == thread and k == kind),
                           key=lambda kv: -kv[1][0])[:top]
            record[f"top_{kind}s"] = {name: [round(us / 1e3 / per, 4), round(calls / per, 2)] for name, (us, calls) in named}
    return out


def run_level(batcher, n: int, frames: int, rounds: int, run: str, codes: dict) -> dict:
    """One level on a started-afresh engine (its threads start inside the hook's block); `run`
    is plain, cuda (a CUDA profile) or hook (the profile hook and a CUDA profile)."""
    from fish_sm.engine.batching import Job
    from fish_sm.engine.sampling import SamplingParams

    prof = None
    hook = timing_new_threads(codes) if run == "hook" else contextlib.nullcontext()
    with hook as timer, start_up_frozen(), batcher:
        batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()  # warm-up
        if timer is not None:
            timer.seconds.clear(), timer.calls.clear()
        if run == "ops":  # every op's and CUDA call's CPU time, by thread
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            prof = torch.profiler.profile(activities=activities, experimental_config=every_thread)
            prof.__enter__()
        elif run != "plain" and torch.cuda.is_available():
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        codec_cpu, codec_waits = thread_cpu_clock(batcher._codec._thread), batcher._codec.audio_waits
        before, prefills = batcher.stats.snapshot(), collections.Counter(batcher.runner.prefills)
        codec_before = codec_cpu(), codec_waits.wall_s, codec_waits.cpu_s
        level = batching_level(batcher, n, frames, True, rounds)
        after = batcher.stats.snapshot()
        codec_cpu_s, codec_wait_s, codec_wait_cpu_s = (now - then for now, then in zip(
            (codec_cpu(), codec_waits.wall_s, codec_waits.cpu_s), codec_before))
        if prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
        threads = {batcher._thread.native_id: ENGINE_THREAD, batcher._codec._thread.native_id: CODEC_THREAD}
    steps = after["steps"] - before["steps"]
    per_step = {k: (after[k] - before[k]) * 1e3 / max(steps, 1)
                for k in ("wall_s", "wait_s", "host_s", "host_cpu_s", "launch_s", "wait_cpu_s")}
    record = {"run": run, "streams": n, "rounds": rounds,
              "aggregate_frames_per_s": level["aggregate_frames_per_s"],
              "aggregate_decode_frames_per_s": level["aggregate_decode_frames_per_s"],
              "steady_decode_frames_per_s": level.get("steady_decode_frames_per_s"),
              "per_request_decode_frames_per_s_median": level["per_request_decode_frames_per_s_median"],
              "first_audio_ms_p95": level.get("first_audio_ms_p95"), "stopped_early": level["stopped_early"],
              "wall_s": level["wall_s"], "steps": steps,
              "decode_span_ms_per_step": level["decode_span_s"] * 1e3 / max(steps, 1),
              "iteration_ms_per_step": per_step["wall_s"], "host_ms_per_step": per_step["host_s"],
              "host_cpu_ms_per_step": per_step["host_cpu_s"],
              "step_launch_ms_per_step": per_step["launch_s"],
              # The codec thread's CPU time (its Python, its CUDA calls and any spin in its
              # waits), the GIL's other taker beside the engine thread.
              "codec_thread_cpu_ms_per_step": codec_cpu_s * 1e3 / max(steps, 1),
              # Of it, its waits for its batches' audio (wall, and the CPU a spinning driver took
              # in them), and its own work: the CPU outside those waits.
              "codec_thread_wait_ms_per_step": codec_wait_s * 1e3 / max(steps, 1),
              "codec_thread_wait_cpu_ms_per_step": codec_wait_cpu_s * 1e3 / max(steps, 1),
              "codec_thread_work_cpu_ms_per_step": (codec_cpu_s - codec_wait_cpu_s) * 1e3 / max(steps, 1),
              "gpu_wait_ms_per_step": per_step["wait_s"],
              # the engine thread's CPU in its waits (for frames, for work): a spinning driver's
              "wait_cpu_ms_per_step": per_step["wait_cpu_s"],
              "host_ms_per_step_by_phase": {k: round((after["phases_s"][k] - before["phases_s"][k]) * 1e3 / max(steps, 1), 3)
                                            for k in after["phases_s"]},
              "rows_per_step": level["aggregate_decode_frames_per_s"] * level["decode_span_s"] / max(steps, 1)}
    if timer is not None:
        record["hook_ms_per_step"] = {f"{thread}: {label}": round(s * 1e3 / max(steps, 1), 3)
                                      for (thread, label), s in sorted(timer.seconds.items())}
        record["calls"] = {f"{thread}: {label}": c for (thread, label), c in sorted(timer.calls.items())}
    # How this level's admissions ran: captured, compiled (a padded shape without a graph), continued.
    record["prefills"] = {" ".join(map(str, k)) if isinstance(k, tuple) else k: v
                          for k, v in (batcher.runner.prefills - prefills).items()}
    if prof is not None and run == "ops":
        record["ops"] = ops_summary(prof, threads, steps)
    elif prof is not None:
        record["gpu"] = gpu_summary(prof, steps)
        busy = record["gpu"].get("decode_busy_ms_per_step")
        if busy:
            record["gpu"]["iteration_over_busy"] = per_step["wall_s"] / busy
    return record


def thread_cpu_clock(thread: threading.Thread):
    """A function giving another thread's CPU seconds so far (Linux; NaN where the platform
    has no per-thread CPU clocks)."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident)
    except (AttributeError, OSError):
        return lambda: float("nan")
    return lambda: time.clock_gettime(clock)


def main(argv: list[str] | None = None) -> dict:
    from fish_sm.engine.batching import BatchEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--streams", default="32", help="stream counts, comma-separated")
    p.add_argument("--frames", type=int, default=200, help="frames per request")
    p.add_argument("--rounds", default="1,6", help="requests a client: 1 is a burst, more a closed loop")
    p.add_argument("--modes", default="bf16", help="weights: bf16, int8 (comma-separated: one engine each)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV length per request")
    p.add_argument("--device", default="auto")
    p.add_argument("--runs", default="plain,cuda,hook",
                   help="runs of each level: plain, cuda (a CUDA profile), hook (Python profile hook + CUDA profile), "
                        "ops (CPU time of ops and CUDA calls)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where batching_profile.json goes")
    a = p.parse_args(argv)
    streams = [int(s) for s in a.streams.split(",")]
    rounds = [int(r) for r in a.rounds.split(",")]
    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    codes, missing = timed_code()
    os.makedirs(a.out, exist_ok=True)
    out = {"environment": environment(), "frames": a.frames, "max_seq_len": a.max_seq_len, "missing_calls": missing,
           "modes": {}}
    if missing:
        print("not timed (not found):", ", ".join(missing), flush=True)
    for mode in a.modes.split(","):
        engine = load(a.checkpoint, mode, device, a.max_seq_len)
        # Decode as fast as it can, every request to its full length (random weights' <|im_end|> ends none).
        batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0, horizon_s=0, forced_lengths=True)
        if batcher.slots < max(streams):  # before compiling: a level of more streams than slots is refused
            sys.exit(f"{max(streams)} streams need as many slots; this GPU holds {batcher.slots} of "
                     f"{a.max_seq_len} tokens: ask for fewer streams or a shorter --max-seq-len")
        t0 = time.perf_counter()
        batcher.compile(capture_all=True)
        records = out["modes"][mode] = {"slots": batcher.slots, "compile_s": time.perf_counter() - t0, "levels": []}
        print(mode, json.dumps({k: v for k, v in records.items() if k != "levels"}), flush=True)
        for n in streams:
            for r in rounds:
                for run in a.runs.split(","):
                    record = run_level(batcher, n, a.frames, r, run, codes)
                    records["levels"].append({"mode": mode, **record})
                    print(json.dumps(records["levels"][-1]), flush=True)
                    with open(os.path.join(a.out, "batching_profile.json"), "w") as f:
                        json.dump(out, f, indent=1)
        del batcher, engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()

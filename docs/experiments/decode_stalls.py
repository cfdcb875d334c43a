"""Where the batching engine's decode loop stalls while the codec works. At 32 streams most
decode steps take their usual ~3.9 ms, but about one step per large codec batch takes
~30 ms (twelfth pass, `codec_timeline.py`), ~0.4 s in all. This times, on each thread, the
calls around those stalls, with the GPU time of each decode step's replay, and a third
thread that only sleeps 0.5 ms at a time: its late wake-ups show when the GIL was held, and
at each wake-up it samples where the two engine threads are (their Python lines).
Not part of the package.

    python docs/experiments/decode_stalls.py CHECKPOINT_DIR [STREAMS=32] [ROUNDS=2]
    # a summary line per round, the longest steps, $OUT/decode_stalls.json
"""
import collections, json, os, statistics, sys, threading, time

import torch

from experiment_tools import compiled_batcher, time_replays, timed_calls

from fish_sm.engine import generate
from fish_sm.engine.batching import BatchEngine, CodecWorker, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.codec_stream import ConvBack, StreamingCodec
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
spans: list = []  # (thread, name, start, end)
replays: list = []  # (start, host end, CUDA start event, CUDA end event, rows)


def timed(name, fn):
    return timed_calls(fn, lambda t0, t1: spans.append((threading.current_thread().name, name, t0, t1)))


for owner, names in ((BatchEngine, ("_decode_step", "_check", "_hand_over", "_start_chunks", "_take_waiting")),
                     (CodecWorker, ("_pieces", "_deliver", "_summarise_finished", "_drain")),
                     (StreamingCodec, ("_fronts",)), (ConvBack, ("forward",)),
                     (generate.HostCopy, ("get", "__init__")),
                     (torch.cuda.CUDAGraph, ("replay",)), (torch.Tensor, ("cpu",))):
    for name in names:
        setattr(owner, name, timed(f"{owner.__name__}.{name}", getattr(owner, name)))
time_replays(lambda rows, start, end, t0, t1: replays.append((t0, t1, start, end, rows)))
late: list = []  # (woke, ms later than asked)
ticking = True


def where(frame) -> str:
    """A thread's innermost Python line, and the engine's own line that led there."""
    inner = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
    while frame is not None and "fish_sm" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return inner
    return inner + f" <- {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"


def ticker():
    """Sleeps 0.5 ms at a time: how late it wakes (the GIL held), and where the engine's
    two threads are at each wake-up (a sampling profile of their Python lines)."""
    while ticking:
        t0 = time.perf_counter()
        time.sleep(0.0005)
        woke = time.perf_counter()
        frames = sys._current_frames()
        at = {th.name: where(frames[th.ident]) for th in threading.enumerate()
              if th.name in ("fish-sm-batching", "fish-sm-codec") and th.ident in frames}
        late.append((woke, (woke - t0) * 1e3 - 0.5, at))


batcher, out = compiled_batcher(checkpoint, n)
freeze_start_up_objects()
out.update(streams=n, rounds=[])
threading.Thread(target=ticker, name="ticker", daemon=True).start()


def within(a: float, b: float, thread: str) -> dict:
    """ms of each timed call of `thread` inside [a, b] (clipped)."""
    got = collections.Counter()
    for th, name, s, e in spans:
        if th == thread and e > a and s < b:
            got[name] += (min(e, b) - max(s, a)) * 1e3
    return {k: round(v, 2) for k, v in got.most_common(8)}


with batcher:
    batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for r in range(rounds):
        spans.clear(), replays.clear(), late.clear()
        level = batching_level(batcher, n, 200, True)
        torch.cuda.synchronize()
        full = [(t0, t1, s.elapsed_time(e), rows) for t0, t1, s, e, rows in replays]
        intervals = [(b[0] - a[0]) * 1e3 for a, b in zip(full, full[1:])]
        longest = sorted(range(len(intervals)), key=intervals.__getitem__)[-12:][::-1]
        steps = []
        for i in longest:
            a, b = full[i][0], full[i + 1][0]
            steps.append({"at_ms": round((a - full[0][0]) * 1e3, 1), "interval_ms": round(intervals[i], 2),
                          "gpu_replay_ms": round(full[i][2], 2), "next_gpu_replay_ms": round(full[i + 1][2], 2),
                          "rows": full[i][3],
                          "ticker_late_ms_max": round(max([ms for t, ms, _ in late if a <= t <= b] or [0]), 2),
                          "decode_thread_at": collections.Counter(w.get("fish-sm-batching", "-") for t, _, w in late
                                                                  if a <= t <= b).most_common(4),
                          "codec_thread_at": collections.Counter(w.get("fish-sm-codec", "-") for t, _, w in late
                                                                 if a <= t <= b).most_common(3),
                          "decode_thread": within(a, b, "fish-sm-batching"), "codec_thread": within(a, b, "fish-sm-codec")})
        gpu = [g for _, _, g, _ in full]
        row = {"round": r, "aggregate_frames_per_s": round(level["aggregate_frames_per_s"]), "steps": len(full),
               "interval_ms_median": round(statistics.median(intervals), 2),
               "interval_ms_total": round(sum(intervals), 1),
               "intervals_over_10ms": sum(i > 10 for i in intervals),
               "ms_in_intervals_over_10ms": round(sum(i for i in intervals if i > 10), 1),
               "gpu_replay_ms_median": round(statistics.median(gpu), 2), "gpu_replay_ms_max": round(max(gpu), 2),
               "gpu_replay_ms_total": round(sum(gpu), 1),
               "ticker_late_ms_p50": round(statistics.median(ms for _, ms, _ in late), 3),
               "ticker_late_ms_max": round(max(ms for _, ms, _ in late), 2),
               "ticker_late_over_5ms": sum(ms > 5 for _, ms, _ in late)}
        print(json.dumps(row), flush=True)
        for s in steps[:5]:
            print("  ", json.dumps({k: s[k] for k in ("at_ms", "interval_ms", "gpu_replay_ms", "decode_thread_at",
                                                       "codec_thread_at")}), flush=True)
        out["rounds"].append({**row, "longest_steps": steps, "level": level,
                              "intervals_ms": [round(i, 2) for i in intervals], "gpu_replay_ms": [round(g, 2) for g in gpu]})
ticking = False
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "decode_stalls.json"), "w"), indent=1)

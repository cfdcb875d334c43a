"""What several experiments here share. Not part of the package. Scripts run as
`python docs/experiments/NAME.py` find it on sys.path (the script's own folder)."""
import json, statistics, time

import torch

from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level, measure
from fish_sm.engine.sampling import SamplingParams


def graphed_us(fn, calls=100):
    """Microseconds a call, replayed from one CUDA graph of `calls` calls."""
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (5 * calls) * 1e6


def levels_in_turns(batchers: dict, streams: list[int], rounds: int, label: str, frames: int = 200) -> list[dict]:
    """Each named BatchEngine in turn, `rounds` times (so that drift shows): started, warmed
    up, then `batching_level` at each number of streamed requests; one JSON line per level."""
    levels = []
    for round_ in range(rounds):
        for name, batcher in batchers.items():
            with batcher:
                batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
                for n in streams:
                    level = {label: name, "round": round_, **batching_level(batcher, n, frames, True)}
                    print(json.dumps(level), flush=True)
                    levels.append(level)
    return levels


def decode_in_turns(engines: dict, rounds: int, out: dict, save=lambda: None) -> None:
    """Each named engine's `measure` (decode of a 1,098-token prompt, 2 x 400 frames) in turn,
    `rounds` times, so that drift between them shows: into out["rounds"], then each one's
    median into out["decode_frames_per_s_median"]; `save` after every measurement."""
    for round_ in range(rounds):
        for name, engine in engines.items():
            m = measure(engine, 400, 2, 1000)
            out["rounds"].append({"variant": name, "round": round_, **m})
            print(name, round_, round(m["decode_frames_per_s"], 1), flush=True)
            save()
    out["decode_frames_per_s_median"] = {name: statistics.median(r["decode_frames_per_s"] for r in out["rounds"]
                                                                  if r["variant"] == name) for name in engines}

"""What several experiments here share. Not part of the package. Scripts run as
`python docs/experiments/NAME.py` find it on sys.path (the script's own folder)."""
import json, time

import torch

from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
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

"""Put this folder first on PYTHONPATH to log every garbage collection of 10 ms or more
(to stderr, which `fish-sm bench --local` keeps in the server's log) in every Python process
started; GC_FREEZE=off also turns off the server's `gc.freeze()` after start-up, for an A/B.
As run for docs/benchmarks.md (seventh pass). Not part of the package.

    PYTHONPATH=docs/experiments/gc_pauses:$PYTHONPATH GC_FREEZE=off fish-sm bench --local ...
"""
import gc
import os
import sys
import time

if os.environ.get("GC_FREEZE") == "off":
    gc.freeze = lambda: None

_started = [0.0]


def _timed(phase, info):
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started[0]) * 1e3
    if ms >= 10:
        print(f"GC_PAUSE generation {info['generation']} {ms:.0f} ms, {info['collected']} collected, "
              f"{len(gc.get_objects(info['generation']))} tracked in it", file=sys.stderr, flush=True)


gc.callbacks.append(_timed)

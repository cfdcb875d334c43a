"""The batching engine's codec beside the decode loop in several variants: the back in float16
or float32, the fronts' float32 matmuls on TF32 tensor cores or not, and its graphs captured
on a stream of their own (`Captures`, as shipped) or, as before the sixteenth pass, on
`torch.cuda.graph`'s default stream, where the decode step's graphs are captured. For each
variant the codec is swapped in and captured, then streamed levels run, each with its slowest
decode replay (CUDA events on the decode stream) and its slowest codec call.

In the fifteenth pass, TF32 fronts captured on the default stream stalled the GPU for 5-35 s
at a time beside the decode loop. Not part of the package.

Variants: shipped (as compiled), fp32, fp16back, tf32fronts, fast (fp16 back, TF32 fronts);
a `-shared` suffix captures on the decode graphs' stream. `VARIANT/LEVELS` gives a variant
levels of its own.

    python docs/experiments/codec_tf32_stalls.py CHECKPOINT_DIR [VARIANTS=shipped,fast-shared/16:100] [LEVELS=16:100,32:200,32:200]
    # one line per level
"""
import json, statistics, sys, time

import torch

from experiment_tools import compiled_batcher, time_replays, timed_calls

from fish_sm.engine.batching import CodecWorker, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.codec_stream import Captures, StreamingCodec
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]


def levels(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in level.split(":")) for level in text.split(",")]


variants = (sys.argv[2] if len(sys.argv) > 2 else "shipped,fast-shared/16:100").split(",")
plan = levels(sys.argv[3] if len(sys.argv) > 3 else "16:100,32:200,32:200")
plans = {v.split("/")[0]: levels(v.split("/")[1]) if "/" in v else plan for v in variants}
BACK = {"fp32": torch.float32, "tf32fronts": torch.float32, "fp16back": torch.float16, "fast": torch.float16}
codec_calls, replays = [], []
CodecWorker._decode_next = timed_calls(CodecWorker._decode_next, lambda a, b: codec_calls.append(b - a))
time_replays(lambda rows, start, end, t0, t1: replays.append((start, end)))
batcher, out = compiled_batcher(checkpoint, max(n for p in plans.values() for n, _ in p))
freeze_start_up_objects()
worker, codec = batcher._codec, batcher.engine.codec


def swap_codec(variant: str) -> None:
    """The worker's codec as `variant` (shipped: as compiled), captured as `BatchEngine.compile` does."""
    if variant == "shipped":
        return
    kind, shared = variant.removesuffix("-shared"), variant.endswith("-shared")
    sc = StreamingCodec(codec, worker.codec.first, worker.codec.largest, back_dtype=BACK[kind],
                        front_tf32=kind in ("fast", "tf32fronts"))
    if shared:  # the decode step's graphs were captured there (see Captures)
        sc.captures = sc.full.captures = Captures(codec._param.device, stream=torch.cuda.graph.default_capture_stream,
                                                  tf32=sc.captures.tf32)
    worker.codec = sc
    t0 = time.perf_counter()
    worker.capture(pieces=12)
    torch.cuda.empty_cache()
    print(variant, "captured in", round(time.perf_counter() - t0, 1), "s", flush=True)


for variant, plan in plans.items():
    swap_codec(variant)
    with batcher:
        batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
        for n, frames in plan:
            replays.clear(), codec_calls.clear()
            level = batching_level(batcher, n, frames, True)
            torch.cuda.synchronize()
            ms = [s.elapsed_time(e) for s, e in replays]
            print(variant, n, frames, json.dumps({k: round(level[k], 3) for k in ("aggregate_frames_per_s", "wall_s",
                                                                                  "first_audio_ms_p95")}),
                  "replay median/max ms", round(statistics.median(ms), 2), round(max(ms), 1),
                  "slowest codec call s", round(max(codec_calls), 3), flush=True)

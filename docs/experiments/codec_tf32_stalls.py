"""The batching engine with its codec's float32 matmuls on TF32 tensor cores in the fronts'
graphs, its back in float16, both, or neither, beside the decode loop: for each variant, the
codec swapped in and captured, then streamed levels, each with its slowest decode replay (CUDA
events on the decode stream) and its slowest codec call. Alone, TF32 fronts made the codec 15%
faster; beside the decode loop they stalled the GPU for 5-35 s at a time (fifteenth pass; the
cause is not found). Not part of the package.

Variants: fp16back (as shipped), fp32, tf32fronts (fp32 back), fast (fp16 back and TF32 fronts).

    python docs/experiments/codec_tf32_stalls.py CHECKPOINT_DIR [VARIANTS=fp32,fp16back] [LEVELS=16:100,16:100,32:200]
    # one line per level
"""
import json, statistics, sys, time

import torch

from experiment_tools import compiled_batcher, time_replays, timed_calls

from fish_sm.engine.batching import CodecWorker, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.codec_stream import StreamingCodec
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.sampling import SamplingParams

checkpoint = sys.argv[1]
variants = (sys.argv[2] if len(sys.argv) > 2 else "fp32,fp16back").split(",")
plan = [tuple(int(x) for x in level.split(":")) for level in (sys.argv[3] if len(sys.argv) > 3 else
                                                                 "16:100,16:100,32:200").split(",")]
codec_calls, replays = [], []
CodecWorker._decode_next = timed_calls(CodecWorker._decode_next, lambda a, b: codec_calls.append(b - a))
time_replays(lambda rows, start, end, t0, t1: replays.append((start, end)))
batcher, out = compiled_batcher(checkpoint, max(n for n, _ in plan))
freeze_start_up_objects()
worker, codec = batcher._codec, batcher.engine.codec


def swap_codec(variant: str) -> None:
    """The worker's codec as `variant` (fp16back: as compiled), captured as `BatchEngine.compile`
    does; TF32 fronts: captured with TF32 matmuls allowed, which their graphs keep."""
    if variant == "fp16back":
        return
    sc = StreamingCodec(codec, worker.codec.first, worker.codec.largest,
                        back_dtype=torch.float16 if variant == "fast" else torch.float32)
    worker.codec = sc
    t0 = time.perf_counter()
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = variant in ("fast", "tf32fronts")
    try:
        worker.capture(pieces=12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    torch.cuda.empty_cache()
    print(variant, "captured in", round(time.perf_counter() - t0, 1), "s", flush=True)


for variant in variants:
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

"""Where a single stream of the batching engine loses against the sequential decode loop, in
one process on one engine (KV 2,048, bf16), three runs each of 200 frames of a short text:
the sequential loop (`generate_frames`, compiled step, no codec); the batching engine at one
stream with its codec thread decoding as frames arrive; and the same with the codec handed
no frames (the decode loop alone). Not part of the package.

    python docs/experiments/one_stream_gap.py CHECKPOINT_DIR    # writes $OUT/one_stream_gap.json
    # DEV=cpu runs it on the CPU (to check the script, not for figures)
"""
import json, os, statistics, sys, time

import torch

from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine, Job
from fish_sm.engine.benchmark import BATCH_TEXTS, batching_level
from fish_sm.engine.generate import generate_frames
from fish_sm.engine.prompt import build_prompt
from fish_sm.engine.sampling import SamplingParams

FRAMES, RUNS = 200, 3
DEV = os.environ.get("DEV", "cuda")
engine = Engine.from_pretrained(sys.argv[1], device=DEV, max_seq_len=2048)
engine.compile()
out = {}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def sequential(i: int) -> float:
    prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], BATCH_TEXTS[i % len(BATCH_TEXTS)])
    n, t = 0, time.perf_counter()
    for n, _ in enumerate(generate_frames(engine.model, prompt, SamplingParams(seed=i, max_new_tokens=FRAMES),
                                          step=engine._step)):
        if n == 0:
            sync()
            t = time.perf_counter()
    sync()
    return n / (time.perf_counter() - t)


sequential(0)
out["sequential_decode"] = [sequential(i) for i in range(RUNS)]
engine._step = None
if DEV == "cuda":
    torch.cuda.empty_cache()
batcher = BatchEngine(engine, max_batch=64, max_queue=0)
batcher.compile()
with batcher:
    batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
    for name in ("batching_with_codec", "batching_codec_idle", "batching_with_codec_again"):
        handover = batcher._codec.frames
        if name == "batching_codec_idle":
            batcher._codec.frames = lambda frames: None  # the codec thread gets no frames to decode
        out[name] = [batching_level(batcher, 1, FRAMES, False)["per_request_decode_frames_per_s_median"]
                     for _ in range(RUNS)]
        batcher._codec.frames = handover
        print(json.dumps({name: out[name]}), flush=True)
out["medians"] = {k: statistics.median(v) for k, v in out.items()}
print(json.dumps(out["medians"]), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "one_stream_gap.json"), "w") as f:
    json.dump(out, f, indent=1)

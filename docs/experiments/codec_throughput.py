"""The batching engine's codec alone (`CodecWorker`, as served: its thread and CUDA stream,
captured graphs): N streamed requests of F frames handed over at once, so nothing waits on
the transformer. Its throughput, where its time goes (fronts, back, the copies to the host,
each timed with a synchronize in a second run), and its kernels by GPU time. Not part of
the package.

    python docs/experiments/codec_throughput.py CHECKPOINT_DIR [STREAMS=32] [FRAMES=200]
    # JSON lines, $OUT/codec_throughput.json
"""
import collections, json, os, sys, time

import numpy as np
import torch

from experiment_tools import kernels_ms, synchronised

from fish_sm.engine import Engine
from fish_sm.engine.batching import CodecWorker, Job, Ticket

checkpoint = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
frames = int(sys.argv[3]) if len(sys.argv) > 3 else 200
engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
worker = CodecWorker(engine, 4, 64)
t0 = time.perf_counter()
worker.capture(pieces=12)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "capture_s": time.perf_counter() - t0,
       "streams": n, "frames": frames, "runs": []}
rng = np.random.default_rng(0)
codes = [rng.integers(0, 1024, size=(engine.config.num_codebooks, frames)) for _ in range(n)]
spent = collections.defaultdict(float)


def one_run(label: str, profile: bool = False) -> dict:
    tickets = [Ticket(Job("x", stream=True)) for _ in range(n)]
    worker.start()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profile else None
    if prof:
        prof.__enter__()
    t0 = time.perf_counter()
    for i in range(frames):
        worker.frames([(t, c[:, i]) for t, c in zip(tickets, codes)])
    for t, c in zip(tickets, codes):
        worker.finish(t, [c[:, i] for i in range(frames)])
    firsts = []
    for t in tickets:
        for kind, _ in t.events():
            if kind == "error":
                raise RuntimeError("codec failed")
        firsts.append(t.timings.get("first_audio", 0))
    wall = time.perf_counter() - t0
    worker.stop()
    result = {"run": label, "wall_s": wall, "frames_per_s": n * frames / wall, "first_audio_ms_max": max(firsts) * 1e3}
    if prof:
        prof.__exit__(None, None, None)
        by_name = kernels_ms(prof)
        result["kernel_ms_total"] = sum(by_name.values())
        result["top"] = by_name.most_common(12)
    return result


for label in ("plain", "plain", "profiled"):
    r = one_run(label, profile=label == "profiled")
    out["runs"].append(r)
    print(json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
    for row in r.get("top", []):
        print("   ", row, flush=True)
codec = worker.codec
codec._fronts = synchronised(spent, "fronts", codec._fronts)
codec.back.forward = synchronised(spent, "back", codec.back.forward)
CodecWorker._pieces = synchronised(spent, "pieces_total", CodecWorker._pieces)
r = one_run("synchronised")
r["seconds"] = dict(spent)
out["runs"].append(r)
print(json.dumps(r), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_throughput.json"), "w"), indent=1)

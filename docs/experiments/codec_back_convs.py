"""Which of the streaming codec's convolutions take its GPU time, and with which kernels: N
streams of F frames through `push_many` as served (captured fronts), the back run through its
compiled code instead of its graphs so that each conv's kernels can be attributed to its
shapes in a CUDA profile. Not part of the package.

    python docs/experiments/codec_back_convs.py CHECKPOINT_DIR [STREAMS=32] [FRAMES=200]
    # a table on stdout, $OUT/codec_back_convs.json
"""
import collections, json, os, sys

import numpy as np
import torch

from experiment_tools import stream_all

from fish_sm.engine import Engine
from fish_sm.engine.codec_stream import StreamingCodec

checkpoint = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
frames = int(sys.argv[3]) if len(sys.argv) > 3 else 200
engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
rng = np.random.default_rng(0)
codes = [torch.from_numpy(rng.integers(0, 1024, size=(1, engine.codec.n_rows, frames))).cuda() for _ in range(n)]


def subtree_kernels(event):
    """(name, ms) of the kernels launched under a profiled CPU op and its children."""
    found = [(k.name, k.duration / 1e3) for k in event.kernels]
    for child in event.cpu_children:
        found += subtree_kernels(child)
    return found


with torch.inference_mode():
    sc = StreamingCodec(engine.codec, 4, 64)
    sc.capture(12)
    graphed = sorted(stream_all(sc, codes) for _ in range(3))[1]
    sc.back.graphs.clear()  # the compiled code, where the profiler sees each op
    stream_all(sc, codes)
    compiled = sorted(stream_all(sc, codes) for _ in range(3))[1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        stream_all(sc, codes)

by_conv = collections.defaultdict(lambda: collections.Counter())
other = collections.Counter()
seen = set()
for e in prof.events():
    if e.name == "aten::convolution" and (e.cpu_parent is None or e.cpu_parent.name != "aten::convolution"):
        x, w = e.input_shapes[0], e.input_shapes[1]
        key = f"x[B,{x[1]},{'x'.join(map(str, x[2:-1]))},T] w{w}"
        for name, ms in subtree_kernels(e):
            by_conv[key][name[:90]] += ms
        seen.add(e.id)
total_ms = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
conv_ms = sum(sum(c.values()) for c in by_conv.values())
rows = sorted(((sum(c.values()), key, c.most_common(3)) for key, c in by_conv.items()), reverse=True)
print(f"wall: graphed back {graphed:.4f} s, compiled back {compiled:.4f} s; kernels {total_ms:.1f} ms, of which convs {conv_ms:.1f} ms")
for ms, key, kernels in rows:
    print(f"{ms:8.1f} ms  {key}")
    for name, k_ms in kernels:
        print(f"          {k_ms:7.1f}  {name[:80]}")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "streams": n, "frames": frames,
       "graphed_s": graphed, "compiled_s": compiled, "kernel_ms": total_ms, "conv_ms": conv_ms,
       "convs": [{"ms": ms, "conv": key, "kernels": kernels} for ms, key, kernels in rows]}
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_back_convs.json"), "w"), indent=1)

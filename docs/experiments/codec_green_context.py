"""The batching engine's codec confined to part of the GPU (a CUDA green context of K SMs),
the decode loop keeping all of it. Decode steps at 32 rows are chains of small kernels that
leave most SMs idle; the codec's convolutions fill every SM, and with both on the whole GPU
their times add up (twelfth pass). Not part of the package.

First a probe: ten 8,192² bf16 products, eager and as a CUDA graph, on an ordinary stream and
on green-context streams of 16 and 66 SMs (which of them keep to the green context's SMs?).
Then one compiled BatchEngine under each setting in order: "all" (as shipped), or "K": the
codec's graphs captured again on a green context of K SMs and its thread's work on that
stream. Streamed requests of 200 frames (`batching_level`).

    python docs/experiments/codec_green_context.py CHECKPOINT_DIR [SMS=all,66,88,all2] [STREAMS=32,64]
    # JSON lines, $OUT/codec_green_context.json
"""
import json, os, sys, time

import torch
from torch.cuda import green_contexts

from experiment_tools import capture_on, compiled_batcher, recapture_codec, settings_in_turns

checkpoint = sys.argv[1]
sms = (sys.argv[2] if len(sys.argv) > 2 else "all,66,88,all2").split(",")
streams = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "32,64").split(",")]
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
       "green_contexts_supported": green_contexts.SUPPORTED,
       "green_context_api": [a for a in dir(green_contexts.GreenContext) if not a.startswith("_")]}
print(json.dumps(out), flush=True)
save = lambda: json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_green_context.json"), "w"), indent=1)
contexts = {}  # kept alive: their streams live as long as they do


def green_stream(k: int) -> torch.cuda.Stream:
    """A stream of a new green context of k SMs."""
    ctx = green_contexts.GreenContext.create(num_sms=k, device_id=0)
    contexts[len(contexts)] = ctx
    return ctx.Stream()


def timed_ms(fn, stream) -> float:
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 3


def captured(fn, stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.synchronize()
    return g


a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
c = torch.empty_like(a)


def products():
    for _ in range(10):
        torch.mm(a, a, out=c)


side = torch.cuda.Stream()
timed_ms(products, side)
ordinary = captured(products, side)
probe = {"eager, ordinary stream": timed_ms(products, side), "graph, ordinary stream": timed_ms(ordinary.replay, side)}
for k in (16, 66):
    gs = green_stream(k)
    for name, fn in ((f"eager, green {k}", lambda: timed_ms(products, gs)),
                     (f"graph captured on an ordinary stream, replayed on green {k}", lambda: timed_ms(ordinary.replay, gs)),
                     (f"graph captured and replayed on green {k}", lambda: timed_ms(captured(products, gs).replay, gs))):
        try:
            probe[name] = fn()
        except Exception as exc:  # what this torch/driver refuses, recorded
            probe[name] = f"{type(exc).__name__}: {exc}"[:300]
out["probe_ms_ten_products"] = probe
for name, ms in probe.items():
    print(f"  {ms if isinstance(ms, str) else round(ms, 2)}  {name}", flush=True)
save()
confined = probe.get("graph captured and replayed on green 16")
if not isinstance(confined, float) or confined < 3 * probe["graph, ordinary stream"]:
    sys.exit("graphs captured on a green context's stream do not keep to its SMs here")

batcher, record = compiled_batcher(checkpoint, max(streams))
out.update(record)
worker, shipped = batcher._codec, batcher._codec._cuda
retired = []  # replaced graphs stay alive (see recapture_codec)


def recapture(stream: torch.cuda.Stream) -> None:
    """The codec's graphs captured again on `stream`, and the codec thread's work put on it."""
    worker._cuda = stream
    t0 = time.perf_counter()
    capture_on(stream, lambda: recapture_codec(worker, retired))
    out.setdefault("recapture_s", []).append(round(time.perf_counter() - t0, 1))


settings = {}
for i, name in enumerate(sms):  # in order, each once; "all" first keeps the graphs compile() captured
    stream = shipped if name.startswith("all") else green_stream(int(name))
    settings[name] = lambda s=stream, keep=i == 0 and name.startswith("all"): None if keep else recapture(s)
t0 = time.perf_counter()
out["levels"] = settings_in_turns(batcher, settings, streams, 1, "codec_sms")
out["levels_s"] = time.perf_counter() - t0
save()
for lv in out["levels"]:
    print(lv["codec_sms"], lv["streams"], round(lv["aggregate_frames_per_s"]), round(lv["first_audio_ms_p95"]),
          round(lv["per_request_decode_frames_per_s_median"]), flush=True)

"""The codec's options on a GPU, as run once for docs/benchmarks.md (fourth pass):
eager against compiled, float32 against bf16, 1, 4 and 16 rows of 64-frame pieces, with
their top kernels and bf16's error against float32. Not part of the package.

    python docs/experiments/codec_options.py CHECKPOINT_DIR    # writes $OUT/codec_exp.json
"""
import json, statistics, sys, time, os
import torch
from fish_sm.model.codec import load_codec
from fish_sm.engine.codec_stream import StreamingCodec, decode_in_pieces

path = sys.argv[1]
dev = torch.device(os.environ.get("DEV", "cuda"))
out = {}

def sync():
    if dev.type == "cuda": torch.cuda.synchronize()

def timed(fn, n=5):
    fn(); sync()
    ts = []
    for _ in range(n):
        sync(); t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

from fish_sm.engine.benchmark import kernel_profile
def top_kernels(fn, k=12):
    if dev.type != "cuda": return {}
    r = kernel_profile(fn, 3, dev, top=k)
    r["top"] = [(t["name"], t["per_call"], round(t["us_per_call"])) for t in r["top"]]
    return r

codec32 = load_codec(os.path.join(path, "codec.pth"), device=dev, dtype=torch.float32)
codec16 = load_codec(os.path.join(path, "codec.pth"), device=dev, dtype=torch.bfloat16)
g = torch.Generator().manual_seed(3)
codes = {b: torch.randint(0, 1024, (b, 10, 64), generator=g).to(dev) for b in (1, 4, 16)}
long = torch.randint(0, 1024, (1, 10, 215), generator=g).to(dev)

with torch.inference_mode():
    a32 = codec32.decode(long).float(); a16 = codec16.decode(long).float()
    err = (a16 - a32)
    out["bf16_vs_fp32"] = {"max_abs": err.abs().max().item(), "snr_db": (10 * torch.log10(a32.pow(2).mean() / err.pow(2).mean())).item()}
    print(json.dumps(out), flush=True)
    for name, c in (("fp32", codec32), ("bf16", codec16)):
        for b, x in codes.items():
            t = timed(lambda: c.decode(x))
            out[f"eager_{name}_b{b}_fps"] = b * 64 / t
        out[f"eager_{name}_10s_ms"] = timed(lambda: c.decode(long)) * 1e3
        out[f"profile_{name}_b1"] = top_kernels(lambda: c.decode(codes[1]))
        print(json.dumps({k: v for k, v in out.items() if not k.startswith("profile")}), flush=True)
    torch.backends.cudnn.benchmark = True
    for name, c in (("fp32", codec32), ("bf16", codec16)):
        for b, x in codes.items():
            out[f"bench_{name}_b{b}_fps"] = b * 64 / timed(lambda: c.decode(x))
    torch.backends.cudnn.benchmark = False
    print(json.dumps({k: v for k, v in out.items() if k.startswith("bench")}), flush=True)
    # compiled decoder (whole sequence)
    for name, c in (("fp32", codec32), ("bf16", codec16)):
        t0 = time.perf_counter()
        dec = torch.compile(c.decoder, dynamic=False)
        orig = c.decoder.forward
        def run(x, c=c, dec=dec):
            z = c.quantizer.decode(x.long(), None)
            return dec(z, None)[:, 0]
        for b, x in codes.items():
            run(x)
            out[f"compiled_{name}_b{b}_fps"] = b * 64 / timed(lambda: run(x))
        out[f"compiled_{name}_compile_s"] = time.perf_counter() - t0
        out[f"profile_compiled_{name}_b1"] = top_kernels(lambda: run(codes[1]))
        print(json.dumps({k: v for k, v in out.items() if k.startswith("compiled")}), flush=True)
    # streaming graphs as now
    for name, c in (("fp32", codec32), ("bf16", codec16)):
        sc = StreamingCodec(c)
        x = torch.randint(0, 1024, (1, 10, 300), generator=g).to(dev)
        decode_in_pieces(sc, x)
        out[f"pieces_{name}_fps"] = 300 / timed(lambda: decode_in_pieces(sc, x), 3)
    print(json.dumps({k: v for k, v in out.items() if k.startswith("pieces")}), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "codec_exp.json"), "w"), indent=1)
for k in out:
    if k.startswith("profile"):
        print(k, json.dumps(out[k]))

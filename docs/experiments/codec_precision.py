"""The streaming codec's precision and layout, measured: for each variant, N streams of F
frames decoded piece by piece (every stream's piece k in one `push_many`, captured fronts
and back as served), its throughput, the fronts' and the back's share, and one stream's
audio against a float32 decode with TF32 off. Not part of the package.

Variants:
- fp32: as shipped before the fifteenth pass (float32; cuDNN runs the convolutions in TF32,
  matmuls stay float32; the back over channels-last [B, C, 1, T] tensors).
- tf32mm: fp32 plus TF32 matmuls (the fronts' linear layers).
- autocast: under torch.autocast(bfloat16), as upstream's serving engine decodes
  (TTSInferenceEngine.get_audio_segment); weights and Snake math stay float32.
- bf16: the codec's weights in bfloat16.
- fp16back (with any of the others): the back's weights and activations in float16 (inputs
  rounded to 10-bit mantissas, as TF32 rounds them, on tensor cores twice TF32's rate), as
  shipped since the fifteenth pass (`StreamingCodec`'s default on CUDA).
- bench (with any of the others): cuDNN benchmark mode while capturing (it times its
  algorithms for each shape instead of taking its heuristics' pick).
- 1d, 1d-autocast: the back over [B, C, T] tensors and 1-D convolutions (cuDNN converts
  layouts around its kernels; as shipped before the twelfth pass).

    python docs/experiments/codec_precision.py CHECKPOINT_DIR [VARIANTS=fp32,autocast,...] [STREAMS=32] [FRAMES=200]
    # JSON lines, $OUT/codec_precision.json
"""
import collections, contextlib, copy, gc, json, math, os, sys, time

import numpy as np
import torch

from experiment_tools import kernels_ms, stream_all, synchronised

from fish_sm.engine import Engine
from fish_sm.engine.codec_stream import ConvBack, StreamingCodec, decode_in_pieces

checkpoint = sys.argv[1]
variants = (sys.argv[2] if len(sys.argv) > 2 else "fp32,1d,tf32mm,autocast,bf16").split(",")
n = int(sys.argv[3]) if len(sys.argv) > 3 else 32
frames = int(sys.argv[4]) if len(sys.argv) > 4 else 200
engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
codec = engine.codec
rng = np.random.default_rng(0)
codes = [torch.from_numpy(rng.integers(0, 1024, size=(1, codec.n_rows, frames))).cuda() for _ in range(n)]


def _set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


with torch.inference_mode():
    _set_tf32(False)
    reference = codec.decode(codes[0]).float()
    torch.backends.cudnn.allow_tf32 = True
torch.cuda.synchronize()


def setting(name):
    stack = contextlib.ExitStack()
    _set_tf32(False)
    torch.backends.cudnn.allow_tf32 = True  # torch's default
    if "tf32mm" in name:
        torch.backends.cuda.matmul.allow_tf32 = True
    if "bench" in name:  # cuDNN times its algorithms for each shape (in the warm-ups before capture)
        torch.backends.cudnn.benchmark = True
        stack.callback(setattr, torch.backends.cudnn, "benchmark", False)
    if "autocast" in name:
        stack.enter_context(torch.autocast("cuda", torch.bfloat16))
    return stack


spent = collections.defaultdict(float)


out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "streams": n, "frames": frames,
       "variants": {}}
for name in variants:
    model = copy.deepcopy(codec).to(torch.bfloat16) if name == "bf16" else codec
    with setting(name), torch.inference_mode():
        t0 = time.perf_counter()
        back = torch.float16 if "fp16back" in name else None if name == "bf16" else torch.float32
        sc = StreamingCodec(model, 4, 64, back_dtype=back)
        if name.startswith("1d"):
            sc.back = ConvBack(model, compiled=True, channels_last=False)
        sc.capture(12)
        capture_s = time.perf_counter() - t0
        walls = [stream_all(sc, codes) for _ in range(3)]
        spent.clear()
        fronts, back = sc._fronts, sc.back.forward
        sc._fronts, sc.back.forward = synchronised(spent, "fronts", fronts), synchronised(spent, "back", back)
        split_wall = stream_all(sc, codes)
        sc._fronts, sc.back.forward = fronts, back
        audio = decode_in_pieces(sc, codes[0]).float()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            stream_all(sc, codes)
        by_name = kernels_ms(prof, 80)
    err = audio - reference
    row = {"capture_s": round(capture_s, 1), "wall_s": [round(w, 4) for w in walls],
           "frames_per_s_median": round(n * frames / sorted(walls)[1]),
           "split_s": {"wall": round(split_wall, 4), **{k: round(v, 4) for k, v in spent.items()}},
           "snr_db": round(10 * math.log10(reference.pow(2).sum().item() / max(err.pow(2).sum().item(), 1e-30)), 2),
           "max_abs": float(err.abs().max()),
           "kernel_ms": round(sum(by_name.values()), 1),
           "top_kernels_ms": [(k, round(v, 1)) for k, v in by_name.most_common(8)]}
    out["variants"][name] = row
    print(json.dumps({"variant": name, **{k: v for k, v in row.items() if k != "top_kernels_ms"}}), flush=True)
    for kernel, ms in row["top_kernels_ms"]:
        print(f"    {ms:7.1f} ms  {kernel[:70]}", flush=True)
    del sc, model
    gc.collect()
    torch.cuda.empty_cache()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_precision.json"), "w"), indent=1)

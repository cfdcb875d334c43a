"""The decode step compiled with and without inductor's coordinate-descent tuning (one-row
matmuls as tuned Triton reductions, see dual_ar.ONE_ROW_OPTIONS), bf16 and INT8,
decode speed and kernel profile, in one process; then single-query attention by SDPA
backend. As run once for docs/benchmarks.md (fifth pass; that run was before the one-row
options turned the static launcher off; decoding replays graphs, so that affects start-up only). Not part of the package.

    python docs/experiments/gemv_tuning_ab.py CHECKPOINT_DIR bf16:off,bf16:on,int8:on    # writes $OUT/gemv_ab.json

"""
import json, os, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from fish_sm.model import dual_ar
from fish_sm.engine.engine import Engine
from fish_sm.engine.benchmark import measure, profile_decode, weight_bytes
from experiment_tools import graphed_us

out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def save():
    json.dump(out, open(os.environ.get("OUT", ".") + "/gemv_ab.json", "w"), indent=1)


for variant in sys.argv[2].split(","):
    mode, tuning = variant.split(":")
    dual_ar.ONE_ROW_OPTIONS = {**dual_ar.ONE_ROW_OPTIONS, "coordinate_descent_tuning": tuning == "on"}
    engine = Engine.from_pretrained(sys.argv[1], device="cuda")
    if mode == "int8":
        engine.quantize_int8()
    t0 = time.perf_counter(); engine.compile(); c = time.perf_counter() - t0
    m = measure(engine, 300, 2, 1000)
    p = profile_decode(engine, 1, 1100, top=int(os.environ.get("TOP", 16)))
    out[variant] = {"compile_s": c, "weight_gb": weight_bytes(engine.model) / 1e9, "fps": m["decode_frames_per_s"],
                    "measure": m, "profile": {k: v for k, v in p.items() if k != "top"}, "top": p["top"]}
    print(variant, json.dumps({k: v for k, v in out[variant].items() if k not in ("top", "measure")}), flush=True)
    for t in p["top"]:
        print("   ", round(t["per_call"]), round(t["us_per_call"], 1), t["name"])
    save()
    del engine
    torch.cuda.empty_cache()

# Single-query attention of the slow layers (16 query heads over 8 KV heads of 128).
att = {}
for live in (1280, 4096):
    q = torch.randn(1, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, live, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bias = torch.zeros(1, 1, 1, live, device="cuda", dtype=torch.bfloat16)
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]:
        for masked in (False, True):
            try:
                with sdpa_kernel([backend]):
                    us = graphed_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias if masked else None,
                                                                          enable_gqa=True))
            except Exception as e:  # a backend that does not take this shape
                us = repr(e)[:120]
            att[f"{live}/{name}/{'mask' if masked else 'plain'}"] = us
            print("attention", live, name, "mask" if masked else "plain", us, flush=True)
out["attention_us"] = att
save()

"""INT8 with and without int8 embeddings against bf16, decode speed and kernel profile, in one
process, as run once for docs/benchmarks.md (fourth pass). Not part of the package.

    python docs/experiments/int8_embeddings_ab.py CHECKPOINT_DIR all,linear,bf16    # writes $OUT/int8_ab.json
"""
import json, os, sys, time
import torch
from fish_sm.engine.engine import Engine
from fish_sm.engine.benchmark import measure, profile_decode, weight_bytes

out = {}
for variant in sys.argv[2].split(","):
    engine = Engine.from_pretrained(sys.argv[1], device="cuda")
    if variant == "linear":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantize_(engine.model, Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
        engine.quantized = True
    elif variant == "all":
        engine.quantize_int8()
    t0 = time.perf_counter(); engine.compile(); c = time.perf_counter() - t0
    m = measure(engine, 300, 2, 1000)
    p = profile_decode(engine, 1, 1100)
    out[variant] = {"compile_s": c, "weight_gb": weight_bytes(engine.model) / 1e9, "fps": m["decode_frames_per_s"],
                    "profile": {k: v for k, v in p.items() if k != "top"}, "top": p["top"][:14]}
    print(variant, json.dumps({k: v for k, v in out[variant].items() if k != "top"}), flush=True)
    for t in p["top"][:14]:
        print("   ", t)
    del engine
    torch.cuda.empty_cache()
json.dump(out, open(os.environ["OUT"] + "/int8_ab.json", "w"), indent=1)

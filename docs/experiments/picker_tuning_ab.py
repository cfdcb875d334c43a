"""The one-row pickers (generate.pick, pick_residual) compiled with and without the decode
step's coordinate-descent tuning: decode speed and kernels a frame at batch 1, in one
process, every variant compiled first and then measured in turns (run-to-run spread on the
device is larger than the effect looked for). Its warm-start side is
warm_start_profile.py with PICKERS_TUNED set. As run for docs/benchmarks.md (seventh pass).
Not part of the package.

    python docs/experiments/picker_tuning_ab.py CHECKPOINT_DIR on:on,off:off,off:on [ROUNDS]
    # head:residual per variant; writes $OUT/picker_ab.json
"""
import json, os, sys, time
import torch
from fish_sm.engine import generate
from fish_sm.engine.engine import Engine
from fish_sm.engine.benchmark import measure, profile_decode

out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
variants = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
engines = {}
for variant in variants:
    head, residual = variant.split(":")
    generate.PICKERS_TUNED.update(head=head == "on", residual=residual == "on")
    engine = Engine.from_pretrained(sys.argv[1], device="cuda")
    t0 = time.perf_counter(); engine.compile(); compile_s = time.perf_counter() - t0
    p = profile_decode(engine, 1, 1100, top=12)
    engines[variant] = engine
    out["variants"][variant] = {"compile_s": compile_s, "profile": {k: v for k, v in p.items() if k != "top"},
                                "top": p["top"], "fps": [], "short_fps": []}
    print(variant, "compile", round(compile_s, 1), "s;", json.dumps(out["variants"][variant]["profile"]), flush=True)

for r in range(rounds):
    for variant in (variants if r % 2 == 0 else variants[::-1]):
        m = measure(engines[variant], 300, 1, 1000)
        out["variants"][variant]["fps"].append(m["decode_frames_per_s"])
        out["variants"][variant]["short_fps"].append(m["decode_short_prompt_frames_per_s"])
        print("round", r, variant, round(m["decode_frames_per_s"], 1), flush=True)
for variant, v in out["variants"].items():
    v["median_fps"] = sorted(v["fps"])[len(v["fps"]) // 2]
    print(variant, "median", round(v["median_fps"], 1), "all", [round(x, 1) for x in v["fps"]])
json.dump(out, open(os.environ.get("OUT", ".") + "/picker_ab.json", "w"), indent=1)

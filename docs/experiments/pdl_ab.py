"""Programmatic dependent launch (PDL) for the decode step's compiled kernels, on or off,
bf16 and INT8, in one process: decode speed (rounds in turns, so that drift shows), the
kernel profile, the graph replay and the compiled-against-eager check. Not part of the package.

With PDL (inductor's `triton.enable_pdl`, Hopper and later), a kernel is launched while
the one before it drains and waits inside (`gdc_wait`) only before its first read of what
that one wrote: at batch 1 a frame is ~860 kernels whose fixed costs are most of its time.
As shipped, the one-row steps use it in bf16 and not with INT8 weights
(`dual_ar.ONE_ROW_OPTIONS`, `NOT_WITH_INT8`); "on" here uses it for both.

    python docs/experiments/pdl_ab.py CHECKPOINT_DIR bf16:off,bf16:on,int8:off,int8:on [ROUNDS]   # $OUT/pdl_ab.json
"""
import json, os, sys, time

import torch
import torch._inductor.config as inductor_config

from fish_sm.model import dual_ar

from fish_sm.engine.benchmark import SENTENCE, compare_compiled_to_eager, profile_decode
from fish_sm.engine.engine import Engine
from fish_sm.engine.prompt import build_prompt
from experiment_tools import decode_in_turns

out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "has_enable_pdl": hasattr(inductor_config.triton, "enable_pdl"), "variants": {}, "rounds": []}


def save():
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "pdl_ab.json"), "w"), indent=1)


engines = {}
for variant in sys.argv[2].split(","):
    mode, pdl = variant.split(":")
    options = {k: v for k, v in dual_ar.ONE_ROW_OPTIONS.items() if k != "triton.enable_pdl"}
    dual_ar.ONE_ROW_OPTIONS = {**options, "triton.enable_pdl": True} if pdl == "on" else options
    dual_ar.NOT_WITH_INT8 = ()
    torch._dynamo.reset()  # dynamo would otherwise reuse the variant before's graphs (weights are inputs)
    try:
        engine = Engine.from_pretrained(sys.argv[1], device="cuda")
        if mode == "int8":
            engine.quantize_int8()
        t0 = time.perf_counter()
        engine.compile()
        info = {"compile_s": time.perf_counter() - t0}
        prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
        info["compiled_vs_eager"] = compare_compiled_to_eager(engine, prompt)
        p = profile_decode(engine, 1, 1100, top=int(os.environ.get("TOP", 12)))
        info["profile"] = p
        info["inductor_files_with_gdc_wait"] = int(os.popen(
            "grep -rl gdc_wait /tmp/torchinductor_$(whoami) 2>/dev/null | wc -l").read().strip() or 0)
        engines[variant] = engine
    except Exception as e:  # a variant this torch cannot build
        info = {"error": repr(e)[:2000]}
    out["variants"][variant] = info
    print(variant, json.dumps({k: v for k, v in info.items() if k != "profile"}),
          json.dumps({k: v for k, v in info.get("profile", {}).items() if k != "top"}), flush=True)
    save()

decode_in_turns(engines, int(sys.argv[3]) if len(sys.argv) > 3 else 2, out, save)

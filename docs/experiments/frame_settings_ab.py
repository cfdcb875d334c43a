"""Whole engines in turns, each with a setting of its one-row frames changed: the products'
launch configs (`row_products.LAUNCH_CONFIGS`), chosen inside whole frames, where each product
starts loading weights while the one before it drains (programmatic dependent launch), not
from products timed alone; where the products load their constants; how the slow head picks.
Not part of the package.

    python docs/experiments/frame_settings_ab.py CHECKPOINT_DIR "bf16:own;int8:own;int8:bf16cfg+wholek;int8:6144x1024=4/1024/4" [ROUNDS]
        VARIANT = weights:change[+change...]: own (as shipped); late (the scales and norm weights
        loaded after the wait, `row_products.EARLY_CONSTANTS` off); pairwise / bisect (the slow
        head's one-row pick, `sampling_kernels.HEAD_BISECTION` off / on); lateslots (attention's
        first cached slots loaded after the wait, `decode_attention.EARLY_SLOTS` off); bf16cfg (INT8 products take bf16's
        config for their shape); wholek (inputs per block ≥ K, a power of 2: every weight a program reads is
        loaded before it waits on the kernel before it); NxK=rows/block_k/warps (that shape).
        Decode speed in turns, the compiled-against-eager check ($OUT/frame_settings_ab.json)
"""
import json, os, sys, time

import torch

from fish_sm.engine.benchmark import SENTENCE, compare_compiled_to_eager
from fish_sm.engine.engine import Engine
from fish_sm.engine import sampling_kernels
from fish_sm.engine.prompt import build_prompt
from fish_sm.model import decode_attention, row_products

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from experiment_tools import decode_in_turns  # noqa: E402

OUT = os.environ.get("OUT", ".")


def configs_for(changes: str, shipped: dict) -> dict:
    """`shipped` launch configs with `changes` applied in order."""
    configs = dict(shipped)
    for change in changes.split("+"):
        if change in ("own", "late", "pairwise", "bisect", "lateslots"):
            continue
        if change == "bf16cfg":
            configs.update({(n, k, True): configs[(n, k, False)] for n, k, int8 in list(configs) if not int8})
        elif change == "wholek":
            configs = {(n, k, q): (rows, 1 << (k - 1).bit_length(), warps) for (n, k, q), (rows, _, warps) in configs.items()}
        else:
            shape, config = change.split("=")
            n, k = map(int, shape.split("x"))
            rows, block_k, warps = map(int, config.split("/"))
            for q in (False, True):
                configs[(n, k, q)] = (rows, block_k, warps)
    return configs


def main(checkpoint: str, variants: list[str], rounds: int) -> dict:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}, "rounds": []}
    save = lambda: json.dump(out, open(os.path.join(OUT, "frame_settings_ab.json"), "w"), indent=1)
    shipped, early, bisect = row_products.LAUNCH_CONFIGS, row_products.EARLY_CONSTANTS, sampling_kernels.HEAD_BISECTION
    engines = {}
    for variant in variants:
        mode, changes = variant.split(":", 1)
        changes_ = changes.split("+")
        row_products.LAUNCH_CONFIGS = configs_for(changes, shipped)
        row_products.EARLY_CONSTANTS = early and "late" not in changes_
        sampling_kernels.HEAD_BISECTION = "bisect" in changes_ or (bisect and "pairwise" not in changes_)
        decode_attention.EARLY_SLOTS = "lateslots" not in changes_
        engine = Engine.from_pretrained(checkpoint, device="cuda")
        if mode == "int8":
            engine.quantize_int8()
        t0 = time.perf_counter()
        engine.compile()  # the frames are captured: their launch configs are fixed from here on
        info = {"compile_s": time.perf_counter() - t0,
                "configs": {f"{n}x{k}": c for (n, k, q), c in row_products.LAUNCH_CONFIGS.items() if q == (mode == "int8")},
                "compiled_vs_eager": compare_compiled_to_eager(
                    engine, build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE))}
        engines[variant] = engine
        out["variants"][variant] = info
        print(variant, json.dumps(info), flush=True)
        save()
    row_products.LAUNCH_CONFIGS, row_products.EARLY_CONSTANTS, sampling_kernels.HEAD_BISECTION = shipped, early, bisect
    decode_attention.EARLY_SLOTS = True
    decode_in_turns(engines, rounds, out, save)
    print(json.dumps(out["decode_frames_per_s_median"]), flush=True)
    save()
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3]) if len(sys.argv) > 3 else 3)

"""Whole engines in turns, each with a setting of its one-row frames changed: the products'
launch configs (`row_products.LAUNCH_CONFIGS`), chosen inside whole frames, where each product
starts loading weights while the one before it drains (programmatic dependent launch), not
from products timed alone; where the products load their constants; how the slow head picks.
Not part of the package.

    python docs/experiments/frame_settings_ab.py CHECKPOINT_DIR "bf16:own;int8:own;int8:bf16cfg+wholek;int8:6144x1024=4/1024/4" [ROUNDS]
        VARIANT = weights:change[+change...]: own (as shipped); late (the scales and norm weights
        loaded after the wait, `row_products.EARLY_CONSTANTS` off); pairwise / bisect (the slow
        head's one-row pick, `sampling_kernels.HEAD_BISECTION` off / on); lateslots (attention's
        first cached slots loaded after the wait, `decode_attention.EARLY_SLOTS` off); attn=P
        (`decode_attention.TARGET_PROGRAMS` P); reslaunch=J/W (`sampling_kernels.RESIDUAL_LAUNCH`:
        logits a residual code's `_nucleus` program decides for, warps); bf16cfg (INT8 products take bf16's
        config for their shape); wholek (inputs per block ≥ K, a power of 2: every weight a program reads is
        loaded before it waits on the kernel before it); NxK=rows/block_k/warps (that shape);
        nopf=T.P[,T.P] (products P of transformer T, slow or fast, stream no later weights into L2:
        `PREFETCH_AHEAD`'s chain with those links cut); i2f (int8 weights turned into floats by the
        conversion instruction, `row_products.INT8_BY_MANTISSA` off).
        Decode speed in turns, the compiled-against-eager check ($OUT/frame_settings_ab.json); with
        TIMELINE=1, each variant's frame timeline by part (frame_timeline.py's `role_sums`).
"""
import json, os, sys

import torch

from fish_sm.engine import sampling_kernels
from fish_sm.model import decode_attention, row_products
from fish_sm.model.dual_ar import DualARTransformer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frame_timeline  # noqa: E402
from experiment_tools import compiled_variant, decode_in_turns  # noqa: E402

OUT = os.environ.get("OUT", ".")


VALUED = ("attn=", "reslaunch=", "nopf=")  # changes with a value after their name


def value_of(changes: list[str], name: str) -> str | None:
    """The value of change `name` (one of VALUED) among `changes`, or None."""
    return next((c[len(name):] for c in changes if c.startswith(name)), None)


def configs_for(changes: str, shipped: dict) -> dict:
    """`shipped` launch configs with `changes` applied in order."""
    configs = dict(shipped)
    for change in changes.split("+"):
        if change in ("own", "late", "pairwise", "bisect", "lateslots", "i2f") or change.startswith(VALUED):
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
    mantissa = row_products.INT8_BY_MANTISSA
    programs, residual_launch = decode_attention.TARGET_PROGRAMS, sampling_kernels.RESIDUAL_LAUNCH
    chain, cut = DualARTransformer._chain_row_weights, set()

    def chain_with_cuts(model, ahead):  # the shipped chain, then the variant's links cut
        chain(model, ahead)
        for transformer, name in cut:
            for block in (model.layers if transformer == "slow" else model.fast_layers):
                block.rows_ahead.pop(name, None)

    DualARTransformer._chain_row_weights = chain_with_cuts
    engines = {}
    for variant in variants:
        mode, changes = variant.split(":", 1)
        changes_ = changes.split("+")
        row_products.LAUNCH_CONFIGS = configs_for(changes, shipped)
        row_products.EARLY_CONSTANTS = early and "late" not in changes_
        row_products.INT8_BY_MANTISSA = mantissa and "i2f" not in changes_
        sampling_kernels.HEAD_BISECTION = "bisect" in changes_ or (bisect and "pairwise" not in changes_)
        decode_attention.EARLY_SLOTS = "lateslots" not in changes_
        attn, reslaunch = value_of(changes_, "attn="), value_of(changes_, "reslaunch=")
        decode_attention.TARGET_PROGRAMS = programs if attn is None else int(attn)
        sampling_kernels.RESIDUAL_LAUNCH = residual_launch if reslaunch is None else tuple(map(int, reslaunch.split("/")))
        cut = {tuple(link.split(".")) for link in (value_of(changes_, "nopf=") or "").split(",") if link}
        engines[variant] = compiled_variant(checkpoint, mode, variant, out, save, facts=lambda engine: {
            "configs": {f"{n}x{k}": c for (n, k, q), c in row_products.LAUNCH_CONFIGS.items() if q == engine.quantized},
            "prefetch_cut": sorted(".".join(c) for c in cut), "int8_by_mantissa": row_products.INT8_BY_MANTISSA})
    row_products.LAUNCH_CONFIGS, row_products.EARLY_CONSTANTS, sampling_kernels.HEAD_BISECTION = shipped, early, bisect
    decode_attention.EARLY_SLOTS, DualARTransformer._chain_row_weights = True, chain
    row_products.INT8_BY_MANTISSA = mantissa
    decode_attention.TARGET_PROGRAMS, sampling_kernels.RESIDUAL_LAUNCH = programs, residual_launch
    decode_in_turns(engines, rounds, out, save)
    if os.environ.get("TIMELINE") == "1":
        out["parts"] = {}
        for variant, engine in engines.items():
            out["parts"][variant] = frame_timeline.role_sums(frame_timeline.timeline(engine)["rows"])
            save()
        for part in out["parts"][variants[0]]:
            print(f"{part:28s}", " ".join(f'{p.get(part, 0):7.1f}' for p in out["parts"].values()), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3]) if len(sys.argv) > 3 else 3)

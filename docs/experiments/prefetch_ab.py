"""Whole engines in turns, each with its one-row products streaming the weights of products
ahead into L2 or not (`row_products.PREFETCH_AHEAD`). Not part of the package.

    python docs/experiments/prefetch_ab.py CHECKPOINT_DIR "int8:0;int8:1;int8:1:fast;bf16:0;bf16:1" [ROUNDS]
        VARIANT = weights:ahead[:part]: weights bf16 or int8; ahead, products ahead (0: none);
        part, all (default), slow or fast: only that transformer's products (and head)
        prefetch. Decode speed in turns, the compiled-against-eager check ($OUT/prefetch_ab.json)
"""
import json, os, sys

import torch

from fish_sm.model import dual_ar, row_products

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from experiment_tools import compiled_variant, decode_in_turns  # noqa: E402

OUT = os.environ.get("OUT", ".")


def chain_for(part: str):
    """`_chain_row_weights` keeping only `part`'s prefetches."""
    chain = dual_ar.DualARTransformer._chain_row_weights

    def chained(model, ahead):
        chain(model, ahead)
        if part != "all":
            for block in model.fast_layers if part == "slow" else model.layers:
                block.rows_ahead = {}
            model.rows_ahead.pop("fast_head" if part == "slow" else "head", None)
    return chained


def main(checkpoint: str, variants: list[str], rounds: int) -> dict:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}, "rounds": []}
    save = lambda: json.dump(out, open(os.path.join(OUT, "prefetch_ab.json"), "w"), indent=1)
    shipped, chain = dict(row_products.PREFETCH_AHEAD), dual_ar.DualARTransformer._chain_row_weights
    engines = {}
    for variant in variants:
        mode, ahead, part = (variant.split(":") + ["all"])[:3]
        row_products.PREFETCH_AHEAD = {"bf16": int(ahead), "int8": int(ahead)}
        dual_ar.DualARTransformer._chain_row_weights = chain_for(part)
        engines[variant] = compiled_variant(checkpoint, mode, variant, out, save, facts=lambda engine: {
            "prefetching": {"slow layer": len(engine.model.layers[0].rows_ahead),
                            "fast layer": len(engine.model.fast_layers[0].rows_ahead),
                            "heads": list(engine.model.rows_ahead)}})
    row_products.PREFETCH_AHEAD, dual_ar.DualARTransformer._chain_row_weights = shipped, chain
    decode_in_turns(engines, rounds, out, save)
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3]) if len(sys.argv) > 3 else 3)

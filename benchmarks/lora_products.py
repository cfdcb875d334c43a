"""The adapters' product kernel of a decode step of several rows (`fish_sm.kernels.lora_products.
lora_delta`: shrink and expand in one kernel) alone, at S1-mini's adapted shapes, against the
base product it is added to (cuBLAS's, `F.linear`): each outputs-per-program and warps of a
grid against the config the engine ships (`lora_products.delta_config`). Every row names an
adapter, `--distinct` of them in turn; the stacked weights rotate through `--copies` copies
(so each call reads them from memory, not from a cache the last call filled), and the calls
run back to back in a CUDA graph. CUDA only; no checkpoint (random weights of the real shapes).

    python benchmarks/lora_products.py [--rows 32,256] [--distinct 32,64] [--rank 8] [--slots 64] [--copies 4] [--out DIR]

One line per product and row count: the base product's µs a call, the shipped config's and the
best config's µs, and the shipped config's largest difference from the torch reference;
DIR/lora_products.json (DIR: --out, else $OUT, else .) has every config's time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import environment, graphed_us, record, time_configs  # noqa: E402

# (name, outputs, inputs, halves): the products an adapter adapts in a decode step (the heads
# with the rows they keep at S1-mini's sizes).
PRODUCTS = (("slow wqkv", 4096, 1024, 1), ("slow wo", 1024, 2048, 1), ("w13", 6144, 1024, 2), ("w2", 1024, 3072, 1),
            ("fast wqkv", 2048, 1024, 1), ("fast wo", 1024, 1024, 1), ("fast head", 4096, 1024, 1))
GRID = [(o, w) for o in (256, 512, 1024, 2048) for w in (4, 8)]


def product(name: str, out: int, width: int, parts: int, rows: int, distinct: int, rank: int, slots: int,
            copies: int) -> dict:
    from fish_sm.kernels import lora_products

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g).to("cuda", torch.bfloat16)
    ids = (torch.arange(rows) % distinct + 1).to("cuda")  # every row an adapter, `distinct` of them
    weights = []
    for _ in range(copies):
        a = torch.randn(slots + 1, parts * rank, width, generator=g) * 0.03
        b = torch.randn(slots + 1, out, rank, generator=g) * 0.03
        a[0], b[0] = 0, 0
        weights.append((a.to("cuda", torch.bfloat16), b.to("cuda", torch.bfloat16),
                        (torch.randn(out, width, generator=g) * 0.03).to("cuda", torch.bfloat16)))
    expected = lora_products.expand_reference(lora_products.shrink_reference(x, *weights[0][:1], ids, 1),
                                              weights[0][1], ids, 1, parts).float()
    shipped = lora_products.delta_config(out // parts, rank)
    block_r = 1 << (rank - 1).bit_length()
    fits = [c for c in GRID if c[0] <= max(64, 1 << (out // parts - 1).bit_length())
            and c[0] * block_r <= 2 * lora_products.BLOCK_A]
    turn = iter(range(10**9))
    base_us = graphed_us(lambda: F.linear(x, weights[next(turn) % copies][2]))
    times, numeric, best = time_configs(shipped, fits, lambda c, i: lora_products.launch_delta(
        x, *weights[i % copies][:2], ids, 1, parts, config=c))
    error = (lora_products.launch_delta(x, *weights[0][:2], ids, 1, parts, config=shipped).float()
             - expected).abs().max().item()
    return {"product": name, "rows": rows, "distinct": distinct, "rank": rank, "shape": [out, width], "parts": parts,
            "base_us": base_us, "shipped": str(shipped), "shipped_us": numeric.get(shipped), "best": str(best),
            "best_us": numeric[best], "max_abs_error": error, "all": {str(c): t for c, t in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32,256", help="comma-separated row counts (a step's rows)")
    p.add_argument("--distinct", default="32,64", help="adapters among the rows, one per row count (the last repeats)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--slots", type=int, default=64, help="adapter slots stacked (at least the most --distinct)")
    p.add_argument("--copies", type=int, default=4, help="copies of the stacked weights the calls rotate through")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where lora_products.json goes")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    distinct = [int(d) for d in a.distinct.split(",")]
    distinct += distinct[-1:] * (len(rows) - len(distinct))
    if max(distinct) > a.slots:
        p.error(f"--distinct {max(distinct)} is more than --slots {a.slots}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with Triton (the kernel alone)")
    out = {"environment": environment(), "copies": a.copies, "products": []}
    for n, d in zip(rows, distinct):
        for name, outputs, width, parts in PRODUCTS:
            record(out, product(name, outputs, width, parts, n, min(d, n), a.rank, a.slots, a.copies),
                   os.path.join(a.out, "lora_products.json"))
    return out


if __name__ == "__main__":
    main()

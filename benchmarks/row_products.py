"""The one-row product kernels (`fish_sm.kernels.row_products`) alone, bf16 against INT8 weights,
at S1-mini's shapes: each product at every launch config of a grid (rows per program, inputs
per block, warps), against the config the engine ships (`row_products.launch_config`). The
weights rotate through `--copies` copies, so each call reads them from memory as a decode
frame does, and the calls run back to back in a CUDA graph (with dependent launch where the
GPU has it, as in a frame). CUDA only; no checkpoint (random weights of the real shapes).

    python benchmarks/row_products.py [--products "slow wqkv,slow wo,w13,w2,fast wqkv,fast wo"] [--kinds bf16,int8]
        [--copies 16] [--lora RANK] [--out DIR]

Per product and weight kind, one line: the shipped config and its µs a call, the best of the
grid and its µs, the weights' MB and the best config's bandwidth, and the shipped and best
configs' largest difference from the kernel's torch reference; with `--lora R`, each product
with a rank-R adapter's part (a grid of larger programs, each with its rows in one half);
DIR/row_products.json
(DIR: --out, else $OUT, else .) has every config's time. A config that is fastest alone is
not always fastest in a whole frame (docs/benchmarks.md, issue 5): the shipped configs were
chosen in whole frames; try a change there (benchmarks/frame_timeline.py, benchmarks/engine.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import environment, record, time_configs  # noqa: E402

# (name, N, K, prologue, residual): a slow layer's four products, then the fast layers' two
# other shapes (their w13 and w2 are the slow layers').
PRODUCTS = [("slow wqkv", 4096, 1024, "NORM", False), ("slow wo", 1024, 2048, "PLAIN", True),
            ("w13", 6144, 1024, "NORM", False), ("w2", 1024, 3072, "SWIGLU", True),
            ("fast wqkv", 2048, 1024, "NORM", False), ("fast wo", 1024, 1024, "PLAIN", True)]
GRID = [(n, k, w) for n in (2, 4, 8, 16) for k in (512, 1024, 2048, 4096) for w in (2, 4, 8)]
# With an adapter's part: more rows a program (each repeats the shrink over all of A's rows).
LORA_GRID = [(n, k, w) for n in (2, 4, 8, 16, 32) for k in (512, 1024) for w in (4, 8)]
EPS = 1e-6


def launch(x, w, scale, norm, res, prologue: int, config: tuple[int, int, int], lora: tuple | None = None
           ) -> torch.Tensor:
    """`row_products.row_product`'s kernel launched with `config` (rows per program, inputs per
    block, warps) instead of `launch_config`'s, no prefetch; with `lora` (A, B, slot ids, halves),
    the adapter's part added."""
    from fish_sm.kernels import row_products

    la, lb, ids, parts = lora if lora is not None else (None, None, None, 1)
    return row_products._launch(x, w, scale, norm, res, prologue, EPS, None, la, lb, ids, parts, config=config)


def adapter(n: int, k: int, rank: int, parts: int, g: torch.Generator) -> tuple:
    """One adapter of `rank` in slot 1 of two (slot 0 zeros), as `AdapterSlots` stacks it, and
    the row's slot: `launch`'s `lora`."""
    a = torch.zeros(2, parts * rank, k)
    b = torch.zeros(2, n, rank)
    a[1], b[1] = torch.randn(parts * rank, k, generator=g) * 0.03, torch.randn(n, rank, generator=g) * 0.03
    return (a.to("cuda", torch.bfloat16), b.to("cuda", torch.bfloat16), torch.ones(1, dtype=torch.long, device="cuda"),
            parts)


def product(name: str, n: int, k: int, prologue_name: str, residual: bool, kind: str, copies: int,
            rank: int = 0) -> dict:
    from fish_sm.kernels import row_products

    prologue = getattr(row_products, prologue_name)
    g = torch.Generator().manual_seed(0)
    width = 2 * k if prologue == row_products.SWIGLU else k
    x = (torch.randn(1, 1, width, generator=g) * 2).to("cuda", torch.bfloat16)
    norm = torch.ones(k, device="cuda", dtype=torch.bfloat16) if prologue == row_products.NORM else None
    res = torch.randn(1, 1, n, generator=g).to("cuda", torch.bfloat16) if residual else None
    sets = []
    for _ in range(copies):
        w = (torch.randn(n, k, generator=g) * 0.03).to("cuda", torch.bfloat16)
        if kind == "int8":
            scale = w.float().abs().amax(1) / 127
            sets.append((torch.round(w.float() / scale[:, None]).to(torch.int8), scale))
        else:
            sets.append((w, None))
    parts = 2 if name == "w13" else 1
    lora = adapter(n, k, rank, parts, g) if rank else None
    expected = row_products.reference(x, *sets[0], norm, res, prologue, EPS,
                                      **(dict(zip(("lora_a", "lora_b", "lora_ids", "parts"), lora)) if lora else {})).float()
    shipped = row_products.launch_config(n, k, kind == "int8", lora=(rank, parts) if rank else None)
    fits = [c for c in GRID if c[1] <= max(512, 1 << (k - 1).bit_length())]
    if rank:  # the configs the kernel takes with an adapter's part as they are
        fits = [c for c in LORA_GRID if row_products.with_adapter(c, n, rank, parts) == c]
    times, numeric, best = time_configs(shipped, fits, lambda c, i: launch(x, *sets[i % copies], norm, res,
                                                                            prologue, c, lora))
    error = {label: (launch(x, *sets[0], norm, res, prologue, config, lora).float() - expected).abs().max().item()
             for label, config in (("shipped", shipped), ("best", best))}
    megabytes = n * k * (1 if kind == "int8" else 2) / 1e6
    return {"product": name, "kind": kind, "lora_rank": rank, "shape": [n, k], "shipped": str(shipped),
            "shipped_us": numeric.get(shipped), "best": str(best), "best_us": numeric[best], "weight_mb": megabytes,
            "best_gb_per_s": megabytes / numeric[best] * 1e3, "max_abs_error": error,
            "all": {str(c): t for c, t in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--products", default=",".join(name for name, *_ in PRODUCTS),
                   help="comma-separated, of: " + ", ".join(name for name, *_ in PRODUCTS))
    p.add_argument("--kinds", default="bf16,int8", help="weights: bf16, int8")
    p.add_argument("--copies", type=int, default=16, help="copies of the weights the calls rotate through")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="with an adapter of this rank on the row (its part added in the kernel); 0: none")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where row_products.json goes")
    a = p.parse_args(argv)
    wanted = a.products.split(",")
    unknown = set(wanted) - {name for name, *_ in PRODUCTS}
    if unknown:
        p.error(f"unknown products: {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with Triton (the kernels alone)")
    out = {"environment": environment(), "copies": a.copies, "products": []}
    for name, n, k, prologue, residual in PRODUCTS:
        if name not in wanted:
            continue
        for kind in a.kinds.split(","):
            record(out, product(name, n, k, prologue, residual, kind, a.copies, a.lora),
                   os.path.join(a.out, "row_products.json"))
    return out


if __name__ == "__main__":
    main()

"""The kernels of a decode step of many rows alone, against what torch would run in their place,
at S1-mini's shapes: the split products (`fish_sm.kernels.split_products`, wo and w2 with their
residual add) against cuBLAS's product and an add, and the fast layers' attention over their
few codebook positions, the decode-attention kernel against SDPA. Each call timed back to back
in a CUDA graph of 100 calls (weights rotating through `--copies` copies). CUDA only; no
checkpoint (random weights of the real shapes).

    python benchmarks/step_kernels.py [--rows 16,32,64,128,256,512] [--copies 8] [--out DIR]

One line per shape and row count: each way's µs a call and which is shipped for it;
DIR/step_kernels.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import environment, graphed_us  # noqa: E402

# (name, N, K): the slow layers' wo and w2, the fast layers' wo (their w2 is the slow one's shape).
PRODUCTS = (("slow wo", 1024, 2048), ("w2", 1024, 3072), ("fast wo", 1024, 1024))
FAST_ATTENTION = (16, 8, 64)  # query heads, kv heads, head dim


def products(rows: int, copies: int) -> list[dict]:
    from fish_sm.kernels import split_products

    g = torch.Generator("cuda").manual_seed(rows)
    counts = torch.zeros(split_products.COUNTERS, dtype=torch.int32, device="cuda")
    out = []
    for name, n, k in PRODUCTS:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.03 for _ in range(copies)]
        x = torch.randn(rows, 1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(rows, 1, n, device="cuda", dtype=torch.bfloat16, generator=g)
        turn = iter(range(10**9))
        entry = {"product": name, "rows": rows, "shipped": "split" if split_products._splits(x, ws[0]) else "cublas",
                 "cublas_us": graphed_us(lambda: res + F.linear(x, ws[next(turn) % copies]))}
        if split_products.triton is not None and split_products._splits(x, ws[0], most_split_rows=rows):
            entry["split_us"] = graphed_us(lambda: split_products._launch(x, ws[next(turn) % copies], res, counts))
            entry["max_abs_error"] = (split_products._launch(x, ws[0], res, counts).float()
                                      - (res + F.linear(x, ws[0])).float()).abs().max().item()
        out.append(entry)
    return out


def fast_attention(rows: int) -> list[dict]:
    from fish_sm.kernels import decode_attention

    heads, kv, dim = FAST_ATTENTION
    g = torch.Generator("cuda").manual_seed(rows)
    out = []
    for live in (2, 5, 10):
        q = torch.randn(rows, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        cache = [torch.randn(rows, kv, 10, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
        k, v = (c[:, :, :live] for c in cache)
        pos = torch.tensor([live - 1], device="cuda")

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        want = sdpa().transpose(1, 2).reshape(rows, 1, heads * dim).float()
        got = decode_attention.decode_attention(q, k, v, pos).float()
        out.append({"attention": "fast", "rows": rows, "live": live, "sdpa_us": graphed_us(sdpa),
                    "kernel_us": graphed_us(lambda: decode_attention.decode_attention(q, k, v, pos)),
                    "max_abs_error": (got - want).abs().max().item()})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,32,64,128,256,512", help="rows of a step, comma-separated")
    p.add_argument("--copies", type=int, default=8, help="copies of the weights the calls rotate through")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where step_kernels.json goes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with Triton (the kernels alone)")
    out = {"environment": environment(), "copies": a.copies, "results": []}
    for rows in (int(r) for r in a.rows.split(",")):
        for entry in products(rows, a.copies) + fast_attention(rows):
            out["results"].append(entry)
            print(json.dumps(entry), flush=True)
    with open(os.path.join(a.out, "step_kernels.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

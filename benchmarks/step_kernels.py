"""The kernels of a decode step of many rows alone, against what torch would run in their place,
at S1-mini's shapes: the split products (`fish_sm.kernels.split_products`, wo and w2 with their
residual add) against cuBLAS's product and an add, and the fast layers' attention over their
few codebook positions, the decode-attention kernel against SDPA. Each call timed back to back
in a CUDA graph of 100 calls (weights rotating through `--copies` copies). CUDA only; no
checkpoint (random weights of the real shapes).

`--launch N`: the host time of launching a CUDA graph of N small kernels (a decode step has
~950), as the engine thread pays it: on an idle GPU, behind 1-3 launches of itself still
running, and behind those with a second stream's graph running too (the codec's). A launch
that waits for room in the GPU's queue is the GPU's time, not the host's.

    python benchmarks/step_kernels.py [--rows 16,32,64,128,256,512] [--copies 8] [--launch 950] [--out DIR]

One line per shape and row count: each way's µs a call and which is shipped for it; with
--launch, one line per case; DIR/step_kernels.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
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
        if split_products._splits(x, ws[0], most_split_rows=rows):  # the kernel can run these rows (Triton, shapes)
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


def launches(nodes: int, repeats: int = 20) -> list[dict]:
    """Host µs of `graph.replay()` for a graph of `nodes` kernels, each over 16 MB, idle and
    behind others (median of `repeats`)."""
    x = torch.zeros(1 << 22, device="cuda")
    side = torch.cuda.Stream()

    def captured(n: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.mul_(0.5).add_(1.0)  # ~two kernels; the values stay bounded
        return graph

    step, other = captured(nodes // 2), captured(nodes // 2)
    for g in (step, other):
        g.replay()
    torch.cuda.synchronize()
    out = []
    for ahead in (0, 1, 3):
        for codec in (False, True):
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                if codec:
                    with torch.cuda.stream(side):
                        other.replay()
                for _ in range(ahead):
                    step.replay()
                t0 = time.perf_counter()
                step.replay()
                times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            out.append({"launch": nodes, "in_flight_of_itself": ahead, "second_stream_busy": codec,
                        "host_us": statistics.median(times), "host_us_max": max(times)})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,32,64,128,256,512", help="rows of a step, comma-separated")
    p.add_argument("--copies", type=int, default=8, help="copies of the weights the calls rotate through")
    p.add_argument("--launch", type=int, default=0, help="kernels of a graph whose launch is timed (0: none)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where step_kernels.json goes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with Triton (the kernels alone)")
    out = {"environment": environment(), "copies": a.copies, "results": []}
    for rows in (int(r) for r in a.rows.split(",") if r):
        for entry in products(rows, a.copies) + fast_attention(rows):
            out["results"].append(entry)
            print(json.dumps(entry), flush=True)
    for entry in launches(a.launch) if a.launch else []:
        out["results"].append(entry)
        print(json.dumps(entry), flush=True)
    with open(os.path.join(a.out, "step_kernels.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

"""The batched decode step's products at 32 and 64 rows: cuBLAS (as the step runs them) against
a plain Triton tile kernel with an optional split over K. Not part of the package.

At 32 rows a step's cuBLAS products read their weights at 0.5-1.9 TB/s (the 1,024-wide ones
worst: few tiles, or split-K with a reduction kernel after; fifteenth pass profile). This
measures what a kernel of our own could do for each S1-mini shape before any of it goes into
the model: weights rotating through 16 copies (read from memory, as a step reads them), each
product timed in a CUDA graph of 96 calls. A split kernel adds into a zeroed float32 buffer
(atomics); its total counts the zeroing and the conversion to bf16 that the step would fuse
into the residual add after it.

    python docs/experiments/skinny_gemm.py [ROWS=32,64]    # GPU: writes $OUT/skinny_gemm.json
"""
import itertools, json, os, sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from experiment_tools import graphed_us

SHAPES = {"slow wqkv": (4096, 1024), "slow wo": (1024, 2048), "w13": (6144, 1024), "w2": (1024, 3072),
          "fast wqkv": (2048, 1024), "fast wo": (1024, 1024)}
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, SPLIT=s, num_stages=st, num_warps=4)
           for n, k, s, st in itertools.product((16, 32, 64), (64, 128), (1, 2, 4), (3, 5))]
COPIES, CALLS = 16, 96


@triton.jit
def skinny(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           SPLIT: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T for M <= BLOCK_M; with SPLIT > 1, this program's K/SPLIT
    slice added into a float32 out."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    per = K // SPLIT
    start = tl.program_id(1) * per
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(start, start + per, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None] * K + ks[None, :], mask=m[:, None] < M, other=0.0)
        b = tl.load(w_ptr + n[None, :] * K + ks[:, None])
        acc = tl.dot(a, b, acc)
    live = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT == 1:
        tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=live)
    else:
        tl.atomic_add(out_ptr + m[:, None] * N + n[None, :], acc, mask=live, sem="relaxed")


def main() -> None:
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "32,64").split(",")]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "results": []}
    for rows, (name, (n, k)) in itertools.product(rows_list, SHAPES.items()):
        torch.manual_seed(0)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(COPIES)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        acc = torch.empty(rows, n, device="cuda", dtype=torch.float32)
        want = F.linear(x, ws[0]).float()
        turn = itertools.cycle(ws)  # each call captured reads the next copy
        cublas = graphed_us(lambda: torch.mm(x, next(turn).t(), out=y), CALLS)
        block_m = max(16, triton.next_power_of_2(rows))
        tried = []
        for c in CONFIGS:
            if k % (c["SPLIT"] * c["BLOCK_K"]):
                continue
            grid = (triton.cdiv(n, c["BLOCK_N"]), c["SPLIT"])
            meta = dict(BLOCK_M=block_m, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT=c["SPLIT"],
                        num_stages=c["num_stages"], num_warps=c["num_warps"])
            split = c["SPLIT"] > 1

            def kernel(w=ws[0]):
                skinny[grid](x, w, acc if split else y, rows, n, k, **meta)

            def total(w=ws[0]):
                if split:
                    acc.zero_()
                kernel(w)
                if split:
                    y.copy_(acc)

            try:
                total()
                torch.cuda.synchronize()
                err = ((y.float() - want).abs().max() / want.abs().max()).item()
                tried.append({**c, "kernel_us": graphed_us(lambda: kernel(next(turn)), CALLS),
                              "total_us": graphed_us(lambda: total(next(turn)), CALLS), "rel_err": err})
            except Exception as exc:  # a config Triton cannot build (shared memory): skipped, noted
                tried.append({**c, "error": str(exc)[:120]})
        ok = [t for t in tried if "total_us" in t and t["rel_err"] < 2e-2]
        best = min(ok, key=lambda t: t["total_us"]) if ok else None
        mb = n * k * 2 / 1e6
        result = {"rows": rows, "product": name, "N": n, "K": k, "weight_MB": mb, "cublas_us": cublas,
                  "cublas_TBps": mb / cublas, "best": best,
                  "best_TBps": mb / best["total_us"] if best else None, "tried": tried}
        out["results"].append(result)
        print(json.dumps({k_: (round(v, 2) if isinstance(v, float) else v) for k_, v in result.items() if k_ != "tried"}),
              flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "skinny_gemm.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""The decode-attention kernel (`fish_sm.kernels.decode_attention`) alone against SDPA, at the
shapes the engine's steps give it, over its one tuning option: `target`, about how many
programs it spreads the work over (the engine ships `decode_attention.TARGET_PROGRAMS`).
SDPA gets the decode step's additive mask, as the compiled steps without the kernel ran it.
Each call timed back to back in a CUDA graph of 100 calls. CUDA only; no checkpoint.

    python benchmarks/decode_attention.py [--targets 64,128,256,512,1024] [--out DIR]

One line per shape: rows x cache slots (per-row positions or one shared), head dim; SDPA's
µs, the shipped target's, the best target and its µs, and the kernel's largest difference
from SDPA; DIR/decode_attention.json (DIR: --out, else $OUT, else .).
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

# (rows, query heads, kv heads, head dim, cache slots, a position per row): one stream's slow
# layers at 1,280 and 4,096 slots, 32 and 8 streams' at 512 and 256, a fast layer's 10 slots.
SHAPES = ((1, 16, 8, 128, 1280, False), (1, 16, 8, 128, 4096, False), (32, 16, 8, 128, 512, False),
          (32, 16, 8, 128, 512, True), (8, 16, 8, 128, 256, True), (1, 16, 8, 64, 10, False))


def shape_times(bsz: int, heads: int, kv: int, dim: int, live: int, per_row: bool, targets: list[int]) -> dict:
    from fish_sm.kernels import decode_attention

    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(bsz, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (torch.randn(bsz, kv, live, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    pos = (torch.randint(live // 2, live, (bsz, 1), device="cuda", generator=g) if per_row
           else torch.tensor([live - 1], device="cuda"))
    rows = pos.reshape(-1).expand(bsz) if pos.numel() == 1 else pos.reshape(-1)
    bias = torch.zeros(bsz, 1, 1, live, device="cuda", dtype=torch.bfloat16).masked_fill_(
        (torch.arange(live, device="cuda")[None, :] > rows[:, None])[:, None, None], float("-inf"))

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    expected = sdpa().transpose(1, 2).reshape(bsz, 1, heads * dim).float()
    out = {"sdpa_us": graphed_us(sdpa), "targets": {}}
    shipped = decode_attention.TARGET_PROGRAMS
    for target in dict.fromkeys([shipped, *targets]):
        out["targets"][target] = graphed_us(lambda t=target: decode_attention.decode_attention(q, k, v, pos, target=t))
    best = min(out["targets"], key=out["targets"].get)
    got = decode_attention.decode_attention(q, k, v, pos, target=shipped).float()
    out.update(shipped=shipped, shipped_us=out["targets"][shipped], best=best, best_us=out["targets"][best],
               max_abs_diff_from_sdpa=(got - expected).abs().max().item())
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="64,128,256,512,1024", help="`target` values (programs), comma-separated")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where decode_attention.json goes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with Triton (the kernel alone)")
    targets = [int(t) for t in a.targets.split(",")]
    out = {"environment": environment(), "shapes": {}}
    for shape in SHAPES:
        key = "{}x{}{} d{}".format(shape[0], shape[4], " per-row" if shape[5] else "", shape[3])
        r = shape_times(*shape, targets)
        out["shapes"][key] = r
        print(key, json.dumps({k: v for k, v in r.items() if k != "targets"}), flush=True)
        with open(os.path.join(a.out, "decode_attention.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

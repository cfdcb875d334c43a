"""The codec back's narrow residual units (`fish_sm.kernels.codec_units`) alone, at S1-mini's
widths and the back's batch shapes: a block's three units compiled as the back runs them
unfused (Snake and context by inductor, the dilated convs by cuDNN over channels-last
memory, the 1x1 convs as GEMMs) against `FusedUnits` compiled; with `--grid`, the middle
unit's kernel at every launch config of a grid. CUDA only; random weights; float16 (the
back's dtype on a GPU).

    python benchmarks/codec_units.py [--channels 96,192] [--shapes 8x64,128x4] [--grid] [--out DIR]

A shape RxF is R pieces of F code frames (a batch of the back: 512 frames). One line per
(channels, shape); DIR/codec_units.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import environment, graphed_us  # noqa: E402

# Samples per code frame at each width of S1-mini's decoder (1536 channels at 4 latent steps a
# frame, halving the channels as each block upsamples by 8, 8, 4, 2).
SAMPLES_PER_FRAME = {768: 32, 384: 256, 192: 1024, 96: 2048}
# (time rows, input channels a load, outputs a 1x1 block, warps, stages); the channels a
# multiple of both blocks, at most 32K accumulators a program (time rows x channels rounded up
# to a power of two).
GRID = [(t, k, n, w, s) for t in (16, 32, 64, 128) for k in (32, 64) for n in (32, 64) for w in (4, 8) for s in (3, 4)]


def units_pair(channels: int):
    """(the three units of a block compiled as the back ran them, as `FusedUnits` compiled, the
    fused module), float16 on the GPU, same random weights; each a function of (x, contexts)."""
    from fish_sm.kernels.codec_units import FusedUnits
    from fish_sm.model.codec.layers import CausalConv1d, ResidualUnit, run_layers

    torch.manual_seed(channels)
    units = nn.ModuleList(ResidualUnit(channels, d) for d in (1, 3, 9)).cuda().half().eval()
    for u in units:
        for snake in (u.block[0], u.block[2]):
            snake.alpha.data = torch.rand_like(snake.alpha) * 2 + 0.2
    for m in units.modules():
        if isinstance(m, CausalConv1d):
            m.prepare_2d()
    fused = FusedUnits(list(units), torch.float16).cuda()
    keys = [u.block[1] for u in units]

    def run(module):
        def step(x, contexts):
            state = dict(zip(keys, contexts))
            return module(x, state), [state[k] for k in keys]
        return torch.compile(step, dynamic=False)

    return run(lambda x, state: run_layers(units, x, state)), run(fused), fused


def time_shape(channels: int, rows: int, frames: int, grid: bool) -> dict:
    from fish_sm.kernels import codec_units

    t = frames * SAMPLES_PER_FRAME[channels]

    def layout(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)

    x = layout(rows, channels, 1, t)
    contexts = [layout(rows, channels, 1, 6 * d) for d in (1, 3, 9)]
    unfused, fused, module = units_pair(channels)
    with torch.inference_mode():
        want, got = unfused(x, contexts)[0], fused(x, contexts)[0]
        row = {"channels": channels, "rows": rows, "frames": frames, "samples": t,
               "compiled_us": graphed_us(lambda: unfused(x, contexts), calls=10, replays=3),
               "fused_us": graphed_us(lambda: fused(x, contexts), calls=10, replays=3),
               "fused_max_diff": (got.float() - want.float()).abs().max().item(),
               "shipped": codec_units.launch_config(channels)}
        if grid:  # the middle unit's kernel alone (dilation 3, handing on to the next)
            u, following = module.units[1], module.units[2]
            s = layout(rows, channels, 1, t + 18)
            args = dict(w7=u.w7, b7=u.b7, alpha2=u.alpha2, w1=u.w1, b1=u.b1, dilation=3,
                        next_alpha=following.alpha1, next_context=contexts[2])
            timings = {}
            for config in GRID:
                if channels % config[1] or channels % config[2] or config[0] * u.w1.shape[0] > 32768:
                    continue
                try:
                    timings[config] = graphed_us(lambda: codec_units.launch(s, x, config=config, **args), calls=10, replays=3)
                except Exception as e:  # a config past the GPU's shared memory or registers
                    timings[config] = float("inf")
                    row.setdefault("failed", []).append([list(config), type(e).__name__])
            best = min(timings, key=timings.get)
            row.update(best=list(best), best_us=timings[best], shipped_us=timings.get(tuple(row["shipped"])),
                       grid={",".join(map(str, k)): v for k, v in timings.items()})
    print(json.dumps({k: v for k, v in row.items() if k != "grid"}), flush=True)
    torch._dynamo.reset()
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", default="96,192")
    p.add_argument("--shapes", default="8x64,128x4", help="pieces x frames, comma-separated")
    p.add_argument("--grid", action="store_true", help="also time every launch config of the grid")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where codec_units.json goes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("codec_units: needs CUDA")
    result = {"environment": environment(), "units": []}
    for channels, shape in itertools.product(map(int, a.channels.split(",")), a.shapes.split(",")):
        rows, frames = map(int, shape.split("x"))
        result["units"].append(time_shape(channels, rows, frames, a.grid))
        with open(os.path.join(a.out, "codec_units.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

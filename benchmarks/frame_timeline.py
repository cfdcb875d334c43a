"""Where one replayed decode frame (one row, ~1,100 cache slots) spends its time, kernel by kernel,
per weight mode (bf16 against INT8), or (`--adapter-rank`) with a LoRA adapter against without
one: torch.profiler over replays of the engine's captured one-row step (its one-slot batching
engine's, after `Engine.compile`), its inputs set to one row at `--live` slots. With
programmatic dependent launch a kernel starts before the one before it ends, so each kernel's
share is its *marginal* time: its end minus the previous kernel's end (they add up to the
frame). Kernels are matched across modes by their place in the frame. CUDA only.

    python benchmarks/frame_timeline.py CHECKPOINT [--modes bf16,int8] [--adapter-rank 8] [--live 1100] [--replays 30] [--out DIR]

With `--adapter-rank R`, each mode's engine serves one random adapter of rank R, and its frame is
profiled twice: the row without an adapter (the step's graph without the adapters' products)
and the row with it, compared as two modes are. Prints, per variant, the replay's wall time,
kernels a frame and their span, then the marginal µs a frame by part (slow/fast wqkv, attn,
combine, wo, w13, w2, picks...); with two variants of the same kernel count, the parts where
they differ most. Writes DIR/frame_timeline.json (DIR: --out, else $OUT, else .) with every
kernel's row.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from benchmarks.engine import environment, load, release, timed  # noqa: E402
from fish_sm.engine.generate import attention_bucket  # noqa: E402


class RandomAdapters:
    """An adapter source of random adapters (`random_adapter`), one per name."""

    def __init__(self, config, rank: int):
        self.config, self.rank = config, rank

    def load(self, name: str):
        from fish_sm.model.lora import random_adapter

        return random_adapter(self.config, name, rank=self.rank, seed=0)


def timeline(engine, live: int, replays: int, adapter_slot: int = 0) -> dict:
    """Every kernel of `replays` replays of the one-row step, its row at `live` cache slots
    (with the adapter in `adapter_slot`, if not 0), matched by place: its name, grid, median
    duration and median marginal time."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.batching().runner
    step = runner.captured
    bucket = attention_bucket(runner.max_seq_len, live)
    ints, _ = step.inputs(1)  # the last request's row and sampling parameters, at another position
    ints[1, 0] = 0
    ints[2, 0] = live - 1
    ints[4, 0] = adapter_slot

    def replay():
        return step.replay(1, bucket, adapters=adapter_slot > 0)

    with torch.inference_mode():
        for _ in range(5):
            replay()
        wall = statistics.median(timed(replay, engine.device) * 1e6 for _ in range(50))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per = len(kernels) // replays
    frames = [kernels[i * per:(i + 1) * per] for i in range(replays)]
    rows = []
    for k in range(per):
        at = [f[k] for f in frames]
        marginal = ([f[k]["ts"] + f[k]["dur"] - (f[k - 1]["ts"] + f[k - 1]["dur"]) for f in frames] if k
                    else [f[0]["dur"] for f in frames])
        rows.append({"name": at[0]["name"][:60], "grid": at[0].get("args", {}).get("grid"),
                     "dur_us": statistics.median(e["dur"] for e in at), "marginal_us": statistics.median(marginal)})
    span = statistics.median(f[-1]["ts"] + f[-1]["dur"] - f[0]["ts"] for f in frames)
    return {"replay_wall_us": wall, "kernels": per, "frames_seen": len(kernels) / max(per, 1), "span_us": span,
            "rows": rows}


def groups(rows: list[dict]) -> dict:
    """Marginal and summed µs a frame by kernel name and grid."""
    g = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        key = f'{r["name"]} {r["grid"]}'
        g[key][0] += 1
        g[key][1] += r["marginal_us"]
        g[key][2] += r["dur_us"]
    return {k: {"count": v[0], "marginal_us": round(v[1], 1), "dur_us": round(v[2], 1)}
            for k, v in sorted(g.items(), key=lambda kv: -kv[1][1])}


def roles(rows: list[dict]) -> list[str]:
    """Each kernel's part of the frame, by its place around the attention kernels (the slow
    layers' attend over several pieces of slots, the fast layers' over one): slow or fast
    wqkv, attn, combine, wo, w13, w2; anything else by its name and grid."""
    names = [r["name"] for r in rows]
    slow = [i for i, r in enumerate(rows) if names[i].startswith("_attend") and r["grid"] and r["grid"][1] > 1]
    fast = [i for i in range(len(rows)) if names[i].startswith("_attend") and i not in slow]
    out = [f'{n[:24]} {r["grid"][0] if r["grid"] else ""}' for n, r in zip(names, rows)]
    for transformer, at in (("slow", slow), ("fast", fast)):
        for a in at:
            if a > 0:
                out[a - 1] = f"{transformer} wqkv"
            out[a] = f"{transformer} attn"
            o = a + 1
            if o < len(rows) and names[o].startswith("_combine"):
                out[o], o = f"{transformer} combine", o + 1
            for j, part in enumerate(("wo", "w13", "w2")):
                if o + j < len(rows) and names[o + j] == "_product":
                    out[o + j] = f"{transformer} {part}"
    return out


def role_sums(rows: list[dict]) -> dict:
    """Marginal µs a frame by part (`roles`)."""
    sums = collections.defaultdict(float)
    for role, r in zip(roles(rows), rows):
        sums[role] += r["marginal_us"]
    return {k: round(v, 1) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--modes", default="bf16,int8", help="weights, comma-separated: bf16, int8")
    p.add_argument("--adapter-rank", type=int, default=0,
                   help="profile each mode's frame without and with a random LoRA adapter of this rank")
    p.add_argument("--live", type=int, default=1100, help="cache slots in use (the attention's length)")
    p.add_argument("--replays", type=int, default=30, help="replays profiled")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where frame_timeline.json goes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it profiles the captured frame)")
    out = {"environment": environment(), "live": a.live, "modes": {}}
    path = os.path.join(a.out, "frame_timeline.json")

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    for mode in a.modes.split(","):
        engine = load(a.checkpoint, mode, torch.device("cuda"))
        variants = {mode: 0}
        if a.adapter_rank:
            engine.enable_adapters(RandomAdapters(engine.config, a.adapter_rank), 2**30, rank=a.adapter_rank)
            engine.compile()
            variants = {f"{mode} no adapter": 0, f"{mode} adapter": engine.adapters.acquire("voice")}
        else:
            engine.compile()
        for name, slot in variants.items():
            t = timeline(engine, a.live, a.replays, slot)
            t["groups"] = groups(t["rows"])
            t["parts"] = role_sums(t["rows"])
            out["modes"][name] = t
            print(name, json.dumps({k: t[k] for k in ("replay_wall_us", "kernels", "span_us")}), flush=True)
            for k, v in t["parts"].items():
                print(f"  {v:8.1f}  {k}", flush=True)
            save()
        del engine
        release(torch.device("cuda"))
    if len(out["modes"]) == 2:
        (a_mode, ta), (b_mode, tb) = out["modes"].items()
        if ta["kernels"] == tb["kernels"]:
            diff = collections.defaultdict(float)
            for role, ra, rb in zip(roles(ta["rows"]), ta["rows"], tb["rows"]):
                diff[role] += ra["marginal_us"] - rb["marginal_us"]
            out["saved_by_" + b_mode] = {k: round(v, 1) for k, v in sorted(diff.items(), key=lambda kv: -kv[1])}
            print(f"marginal µs a frame by part, {a_mode} minus {b_mode}:", flush=True)
            for k, v in list(out["saved_by_" + b_mode].items())[:30]:
                print(f"  {v:8.1f}  {k}", flush=True)
        else:
            print(f"{a_mode} and {b_mode} run {ta['kernels']} and {tb['kernels']} kernels a frame: not matched", flush=True)
        save()
    return out


if __name__ == "__main__":
    main()

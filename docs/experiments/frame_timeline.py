"""Where a replayed decode frame (one row, ~1,100 cache slots) spends its time, kernel by kernel,
bf16 against INT8: torch.profiler over replays of the captured frame. With programmatic
dependent launch a kernel starts before the one before it ends, so each kernel's share is
its *marginal* time: its end minus the previous kernel's end (they add up to the frame).
Kernels are matched across modes by their place in the frame. Not part of the package.

    python docs/experiments/frame_timeline.py CHECKPOINT_DIR [MODES]   # $OUT/frame_timeline.json
        MODES: comma-separated, default bf16,int8
"""
import collections, json, os, statistics, sys, tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from fish_sm.engine.benchmark import _timed, decode_step_inputs
from fish_sm.engine.engine import Engine

OUT = os.environ.get("OUT", ".")
LIVE, REPLAYS = 1100, 30


def timeline(engine) -> dict:
    args, key_pos = decode_step_inputs(engine, 1, LIVE)
    replay = lambda: engine._step(*args, key_pos=key_pos)
    with torch.inference_mode():
        for _ in range(5):
            replay()
        wall = statistics.median(_timed(replay, engine.device) * 1e6 for _ in range(50))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                replay()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    kernels = sorted((e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    per = len(kernels) // REPLAYS
    frames = [kernels[i * per:(i + 1) * per] for i in range(REPLAYS)]
    rows = []
    for k in range(per):
        at = [f[k] for f in frames]
        marginal = [f[k]["ts"] + f[k]["dur"] - (f[k - 1]["ts"] + f[k - 1]["dur"]) for f in frames] if k else \
            [f[0]["dur"] for f in frames]
        rows.append({"name": at[0]["name"][:60], "grid": at[0].get("args", {}).get("grid"),
                     "dur_us": statistics.median(e["dur"] for e in at), "marginal_us": statistics.median(marginal)})
    span = statistics.median(f[-1]["ts"] + f[-1]["dur"] - f[0]["ts"] for f in frames)
    return {"replay_wall_us": wall, "kernels": per, "frames_seen": len(kernels) / per, "span_us": span, "rows": rows}


def groups(rows) -> dict:
    """Marginal µs a frame by kernel name and grid."""
    g = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        key = f'{r["name"]} {r["grid"]}'
        g[key][0] += 1
        g[key][1] += r["marginal_us"]
        g[key][2] += r["dur_us"]
    return {k: {"count": v[0], "marginal_us": round(v[1], 1), "dur_us": round(v[2], 1)}
            for k, v in sorted(g.items(), key=lambda kv: -kv[1][1])}


def roles(rows) -> list[str]:
    """Each kernel's part of the frame, by its place around the attention kernels: slow or fast
    wqkv, attn, combine, wo, w13, w2; anything else by its name and grid."""
    names = [r["name"] for r in rows]
    slow = [i for i, r in enumerate(rows) if names[i].startswith("_attend") and r["grid"] and r["grid"][1] > 1]
    fast = [i for i in range(len(rows)) if names[i].startswith("_attend") and i not in slow]
    out = [f'{n[:24]} {r["grid"][0] if r["grid"] else ""}' for n, r in zip(names, rows)]
    for transformer, at in (("slow", slow), ("fast", fast)):
        for a in at:
            out[a - 1], out[a] = f"{transformer} wqkv", f"{transformer} attn"
            o = a + 1
            if o < len(rows) and names[o].startswith("_combine"):
                out[o], o = f"{transformer} combine", o + 1
            for j, part in enumerate(("wo", "w13", "w2")):
                if o + j < len(rows) and names[o + j] == "_product":
                    out[o + j] = f"{transformer} {part}"
    return out


def role_sums(rows) -> dict:
    """Marginal µs a frame by part (`roles`)."""
    sums = collections.defaultdict(float)
    for role, r in zip(roles(rows), rows):
        sums[role] += r["marginal_us"]
    return {k: round(v, 1) for k, v in sums.items()}


def main(checkpoint: str, modes: list[str]) -> dict:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "live": LIVE, "modes": {}}
    for mode in modes:
        engine = Engine.from_pretrained(checkpoint, device="cuda")
        if mode == "int8":
            engine.quantize_int8()
        engine.compile()
        t = timeline(engine)
        t["groups"] = groups(t["rows"])
        t["parts"] = role_sums(t["rows"])
        out["modes"][mode] = t
        print(mode, json.dumps({k: t[k] for k in ("replay_wall_us", "kernels", "span_us")}), flush=True)
        for k, v in t["parts"].items():
            print(f"  {v:8.1f}  {k}", flush=True)
        del engine
        torch.cuda.empty_cache()
        json.dump(out, open(os.path.join(OUT, "frame_timeline.json"), "w"), indent=1)
    if len(out["modes"]) == 2:
        (a, ta), (b, tb) = out["modes"].items()
        if ta["kernels"] == tb["kernels"]:
            diff = collections.defaultdict(float)
            for ra, rb in zip(ta["rows"], tb["rows"]):
                diff[f'{ra["name"]} {ra["grid"]} | {rb["grid"]}'] += ra["marginal_us"] - rb["marginal_us"]
            out["saved_by_" + b] = dict(sorted(diff.items(), key=lambda kv: -kv[1]))
            print(f"marginal µs a frame, {a} minus {b}:", flush=True)
            for k, v in list(out["saved_by_" + b].items())[:30]:
                print(f"  {v:8.1f}  {k}", flush=True)
        json.dump(out, open(os.path.join(OUT, "frame_timeline.json"), "w"), indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "bf16,int8").split(","))

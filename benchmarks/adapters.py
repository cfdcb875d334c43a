"""LoRA adapters in the batching engine (issue 37's targets), on random weights:

- adapters registered: N packaged adapters (our .safetensors form on local disk) known to one
  engine, all of them served in turn, how many stay resident under the memory budget;
- GPU memory per adapter: the slot size, and the memory enable_adapters took over its slots;
- the first request of an adapter not yet in GPU memory: time to first audio against the same
  request once the adapter is resident (the read from local disk and the copy are the difference);
- aggregate frames/s of S streams with no adapter on an engine without adapters (the baseline),
  then S streams with no adapter and S streams over D different adapters (each D-th stream the
  same one) on an engine with them, for each level S (and its D) given;
- one stream alone, without an adapter on the engine without adapters and with one on the
  engine with them (a step of one row: the row-product kernels).

    python benchmarks/adapters.py CHECKPOINT [--adapters 128] [--rank 8] [--streams 32[,256]] [--distinct 32[,64]] [--frames 300]

Prints one JSON object (also written to --out/adapters.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file
from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine, Job
from fish_sm.contract import SamplingParams
from fish_sm.model.lora import random_adapter, read_packaged, write_packaged

TEXT = "A benchmark sentence that the engine speaks for as many frames as it is asked to."


class Directory:
    """Packaged adapters in a directory, read as the server reads a package's."""

    def __init__(self, path: Path, config):
        self.path, self.config = path, config

    def load(self, name):
        return read_packaged(self.path / f"{name}.safetensors", name, self.config)


def throughput(batcher: BatchEngine, names: list[str | None], frames: int) -> float:
    """Aggregate frames/s of one job per name, all submitted at once, each `frames` long."""
    jobs = [Job(TEXT, params=SamplingParams(seed=i, max_new_tokens=frames), adapter=n) for i, n in enumerate(names)]
    t0 = time.perf_counter()
    tickets = [batcher.submit(j) for j in jobs]
    total = sum(t.result().frames for t in tickets)
    return total / (time.perf_counter() - t0)


def first_audio(batcher: BatchEngine, adapter: str | None, seed: int = 0) -> float:
    """Seconds from submit to the first streamed audio of a short request."""
    t0 = time.perf_counter()
    ticket = batcher.submit(Job(TEXT, params=SamplingParams(seed=seed, max_new_tokens=16), adapter=adapter, stream=True))
    seen = None
    for kind, payload in ticket.events():
        if kind == "audio" and seen is None:
            seen = time.perf_counter() - t0
        if kind == "error":
            raise payload
    return seen


def engine_for(checkpoint: str, max_seq_len: int, device: str) -> Engine:
    return Engine.from_pretrained(checkpoint, device=device, max_seq_len=max_seq_len)


def allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def save(out: dict, directory: str) -> str:
    """Write what is measured so far (a call cut short keeps it); returns it as text."""
    text = json.dumps(out, indent=1)
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "adapters.json").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--streams", default="32", help="levels, comma-separated: the engines hold the largest")
    ap.add_argument("--distinct", default="", help="different adapters over the streams of each level (default: one each)")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--memory-gib", type=float, default=2.0)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script on a tiny checkpoint")
    args = ap.parse_args()
    out: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "rank": args.rank, "frames": args.frames}
    levels = [int(v) for v in args.streams.split(",")]
    distinct = [int(v) for v in args.distinct.split(",")] if args.distinct else levels
    if len(distinct) != len(levels) or max(distinct) > args.adapters or any(d > s for d, s in zip(distinct, levels)):
        ap.error("--distinct: one count per level, each at most its streams and --adapters")
    slots = max(levels)
    out["levels"] = {s: {"distinct": d} for s, d in zip(levels, distinct)}

    # The baseline: an engine without adapters.
    t0 = time.perf_counter()
    plain = BatchEngine(engine_for(args.checkpoint, args.max_seq_len, args.device), max_batch=slots, forced_lengths=True, horizon_s=0)
    plain.compile(capture_all=True)
    out["plain_compile_s"] = round(time.perf_counter() - t0, 1)
    with plain:
        throughput(plain, [None] * slots, 40)
        for s in levels:
            out["levels"][s]["plain_frames_per_s"] = round(throughput(plain, [None] * s, args.frames), 1)
        out["plain_one_stream_frames_per_s"] = round(throughput(plain, [None], args.frames), 1)
    save(out, args.out)
    config = plain.engine.config
    del plain
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    # The adapters, in our packaged form on local disk.
    directory = Path(tempfile.mkdtemp(prefix="adapters-"))
    names = [f"voice{i:03d}" for i in range(args.adapters)]
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        write_packaged(random_adapter(config, name, rank=args.rank, seed=i), directory / f"{name}.safetensors")
    out["adapter_file_bytes"] = (directory / f"{names[0]}.safetensors").stat().st_size
    out["write_s"] = round(time.perf_counter() - t0, 1)

    engine = engine_for(args.checkpoint, args.max_seq_len, args.device)
    before = allocated(args.device)
    cache = engine.enable_adapters(Directory(directory, config), int(args.memory_gib * 2**30), rank=args.rank)
    taken = allocated(args.device) - before
    out["adapter_slots"] = cache.slots.slots
    out["bytes_per_adapter"] = cache.slots.bytes_per_slot
    out["measured_bytes_per_adapter"] = round(taken / (cache.slots.slots + 1))
    t0 = time.perf_counter()
    batcher = BatchEngine(engine, max_batch=slots, forced_lengths=True, horizon_s=0)
    batcher.compile(capture_all=True)
    out["adapters_compile_s"] = round(time.perf_counter() - t0, 1)
    with batcher:
        throughput(batcher, [None] * slots, 40)
        # First requests of adapters not yet resident, against the same once resident.
        cold, warm = [], []
        for i, name in enumerate(names[:8]):
            cold.append(first_audio(batcher, name, seed=i))
            warm.append(first_audio(batcher, name, seed=i))
        none = [first_audio(batcher, None, seed=i) for i in range(8)]
        out["first_audio_ms"] = {"adapter_not_resident_p50": round(1e3 * statistics.median(cold), 1),
                                 "adapter_not_resident_max": round(1e3 * max(cold), 1),
                                 "adapter_resident_p50": round(1e3 * statistics.median(warm), 1),
                                 "no_adapter_p50": round(1e3 * statistics.median(none), 1)}
        out["added_ms_p50"] = round(1e3 * (statistics.median(cold) - statistics.median(warm)), 1)
        out["load_ms"] = {n: round(1e3 * s, 1) for n, s in list(cache.load_seconds.items())[:8]}
        # Throughput: no adapter, then one adapter per stream (all resident after a first pass).
        for s, d in zip(levels, distinct):
            level, mixed = out["levels"][s], [names[i % d] for i in range(s)]
            throughput(batcher, mixed, 40)
            level["no_adapter_frames_per_s"] = round(throughput(batcher, [None] * s, args.frames), 1)
            level["adapters_frames_per_s"] = round(throughput(batcher, mixed, args.frames), 1)
            level["ratio_adapters_vs_plain"] = round(level["adapters_frames_per_s"] / level["plain_frames_per_s"], 3)
            level["ratio_no_adapter_vs_plain"] = round(level["no_adapter_frames_per_s"] / level["plain_frames_per_s"], 3)
            save(out, args.out)
        out["one_stream_with_adapter_frames_per_s"] = round(throughput(batcher, names[:1], args.frames), 1)
        out["ratio_one_stream_adapter_vs_plain"] = round(out["one_stream_with_adapter_frames_per_s"]
                                                         / out["plain_one_stream_frames_per_s"], 3)
        save(out, args.out)
        # Every registered adapter served, a batch of streams at a time.
        t0 = time.perf_counter()
        for start in range(0, len(names), slots):
            throughput(batcher, names[start : start + slots], 8)
        out["served_all_s"] = round(time.perf_counter() - t0, 1)
        stats = engine.adapter_stats()
        out["registered"] = len(names)
        out["resident_after"] = len(stats["resident"])
        out["loads"] = stats["loads"]
    print(save(out, args.out))


if __name__ == "__main__":
    main()

"""Engine micro-benchmark: load time, prefill, decode frames/s, codec decode, peak memory.

    python -m fish_sm.engine.benchmark CHECKPOINT [--frames 300] [--repeats 2] [--json out.json]

Each figure is measured `--repeats` times and the median reported. Decode speed counts
frames after the prefill, with a stop token never taken into account (the run is cut at
`--frames`), so random weights give a steady figure. Use a GPU for figures you report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date

import torch

from fish_sm.engine import Engine, SamplingParams
from fish_sm.engine.generate import generate_frames
from fish_sm.engine.prompt import build_prompt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run(checkpoint: str, frames: int, repeats: int, prompt_tokens: int, device: str, dtype: str) -> dict:
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(checkpoint, device=device, dtype=dtype)
    _sync(engine.device)
    load_s = time.perf_counter() - t0
    dev, model = engine.device, engine.model
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    params = SamplingParams(max_new_tokens=frames, seed=0)

    # A reference voice's worth of prompt: random semantic codes plus their transcript.
    ref_frames = max(1, prompt_tokens - 40)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1024, (model.config.num_codebooks, ref_frames), generator=g)
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks,
                          [("This is the transcript of the reference recording.", codes)],
                          "The quick brown fox jumps over the lazy dog, twice.")

    def prefill():
        with torch.inference_mode():
            model.forward_slow(prompt.to(dev)[None], torch.arange(prompt.shape[1], device=dev), prompt.shape[1])

    def decode():
        n = 0
        t = time.perf_counter()
        for i, _ in enumerate(generate_frames(model, prompt, params)):
            if i == 0:
                _sync(dev)
                t = time.perf_counter()  # the first frame comes from the prefill
            n = i
        _sync(dev)
        return n / (time.perf_counter() - t)

    ten_seconds = torch.randint(0, 1024, (1, model.config.num_codebooks, round(10 * engine.sample_rate / engine.frame_length)),
                                generator=g).to(dev)

    def codec_decode():
        with torch.inference_mode():
            engine.codec.decode(ten_seconds)

    prefill()  # warm-up
    codec_decode()
    results = {
        "prefill_ms": statistics.median(_timed(prefill, dev) * 1e3 for _ in range(repeats)),
        "decode_frames_per_s": statistics.median(decode() for _ in range(repeats)),
        "codec_decode_10s_ms": statistics.median(_timed(codec_decode, dev) * 1e3 for _ in range(repeats)),
    }
    return {
        "checkpoint": checkpoint,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "prompt_tokens": prompt.shape[1],
        "frames": frames,
        "repeats": repeats,
        "load_s": load_s,
        **results,
        "realtime_x": results["decode_frames_per_s"] * engine.frame_length / engine.sample_rate,
        "peak_memory_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    report = run(a.checkpoint, a.frames, a.repeats, a.prompt_tokens, a.device, a.dtype)
    width = max(map(len, report))
    for k, v in report.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

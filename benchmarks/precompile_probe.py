"""Can torch's ahead-of-time compiled functions take dynamo's tracing out of a warm start?
Issue 44's next step, probed on the codec's back (the conv decoder as served: one compiled
function for every batch size and piece length, the largest single trace of a start): each
phase in a fresh process, all sharing one inductor cache directory as a packaged start does.

1. jit, cold: `torch.compile` as `ConvBack.run` uses it, into an empty cache;
2. jit, warm: the same from the filled cache (dynamo traces again; inductor's graphs are cache
   hits): what a start from a package pays today;
3. save: `torch.compile(...).aot_compile(example inputs)` and `save_compiled_function`;
4. load: `torch.compiler.load_compiled_function` beside the filled cache (a package carries
   both), its first calls at the served shapes, its outputs against the eager back's and
   against jit's, and on CUDA a graph captured over it replaying its own output bit for bit;
5. load-empty: the same with an empty inductor cache: whether the artifact holds everything
   (on a CPU it does not: inductor's C++ is compiled again, ~20 s on the tiny checkpoint).

    python benchmarks/precompile_probe.py CHECKPOINT [--work DIR] [--out DIR]

One JSON line per phase; DIR/precompile_probe.json. On a CPU it runs on a tiny checkpoint (a
C++ compiler compiles inductor's CPU code), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("jit-cold", "jit-warm", "save", "load", "load-empty")


def served_back(checkpoint: str):
    """The codec's back as `StreamingCodec` builds it (its dtype and layout: on CUDA float16,
    channels-last), and the batch shapes `StreamingCodec.working_bytes` runs first: the largest
    piece at its rows, then the first piece at its rows (on a CPU, two rows each)."""
    import torch

    from fish_sm.engine.codec_stream import StreamingCodec
    from fish_sm.model.codec import load_codec

    cuda = torch.cuda.is_available()
    codec = load_codec(Path(checkpoint) / "codec.pth", device="cuda" if cuda else "cpu")
    pieces = StreamingCodec(codec, 4, 64)
    rows = {n: pieces.rows_for(n) if cuda else 2 for n in (pieces.schedule.largest, pieces.schedule.first)}
    return pieces.back, rows


def inputs(back, rows: int, frames: int, seed: int, mark: str | None = "maybe"):
    """Random latents and contexts, inference tensors, their dynamic dims marked as `ConvBack.run`
    marks them ("maybe"), as dynamic for an ahead-of-time compile ("strict"), or not at all
    (None: what an ahead-of-time compiled function is called with; a marked tensor fails its
    guards)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = back.decoder.model[0].conv.weight.device
    latents = torch.randn(rows, back.latent_dim, frames * back.steps, generator=g).to(dev)
    contexts = [torch.randn(c.shape, generator=g).to(dev, c.dtype).contiguous(memory_format=torch.channels_last)
                if back.channels_last else torch.randn(c.shape, generator=g).to(dev, c.dtype)
                for c in back.initial(rows)]
    if mark is not None:
        marked = torch._dynamo.maybe_mark_dynamic if mark == "maybe" else torch._dynamo.mark_dynamic
        for t in (latents, *contexts):
            marked(t, 0)
        marked(latents, 2)
    return latents, contexts


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phase(name: str, checkpoint: str, work: Path) -> dict:
    """One phase in this process (see the module's doc)."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        back, rows = served_back(checkpoint)
        shapes = [(r, n) for n, r in rows.items()]
        out: dict = {"phase": name, "build_s": time.perf_counter() - t0, "shapes": shapes}
        artifact = work / "back.aot"
        if name.startswith("jit"):
            fn = torch.compile(back._step)
            for i, (r, n) in enumerate(shapes):
                t = time.perf_counter()
                fn(*inputs(back, r, n, i))
                sync()
                out[f"first_call_{r}x{n}_s"] = time.perf_counter() - t
            reference = [fn(*inputs(back, r, n, 10 + i))[0].float().cpu() for i, (r, n) in enumerate(shapes)]
            torch.save(reference, work / "jit_outputs.pt")  # (this script's own file, read back below)
            return out
        if name == "save":
            r, n = shapes[0]
            t = time.perf_counter()
            example = inputs(back, r, n, 0, mark="strict")
            compiled = torch.compile(back._step, fullgraph=True, dynamic=True).aot_compile((example, {}))
            out["aot_compile_s"] = time.perf_counter() - t
            t = time.perf_counter()
            compiled.save_compiled_function(str(artifact))
            out["save_s"], out["artifact_bytes"] = time.perf_counter() - t, artifact.stat().st_size
            return out
        t = time.perf_counter()
        with open(artifact, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        out["load_s"] = time.perf_counter() - t
        for i, (r, n) in enumerate(shapes):
            t = time.perf_counter()
            fn(back, *inputs(back, r, n, i, mark=None))
            sync()
            out[f"first_call_{r}x{n}_s"] = time.perf_counter() - t
        jit = torch.load(work / "jit_outputs.pt")
        for i, (r, n) in enumerate(shapes):
            x = inputs(back, r, n, 10 + i, mark=None)
            loaded = fn(back, *x)[0].float().cpu()
            out[f"vs_jit_{r}x{n}_max_abs"] = (loaded - jit[i]).abs().max().item()
            out[f"vs_eager_{r}x{n}_max_abs"] = (loaded - back._step(*x)[0].float().cpu()).abs().max().item()
        if torch.cuda.is_available():  # a graph over the loaded function, as the codec captures one
            r, n = shapes[-1]
            x = inputs(back, r, n, 20, mark=None)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                expected = fn(back, *x)[0].clone()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = fn(back, *x)[0]
            graph.replay()
            sync()
            out["graph_replay_equal"] = bool(torch.equal(captured, expected))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--work", type=Path, default=Path("/tmp/precompile-probe"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one phase, in this process
    a = ap.parse_args()
    if a.phase:
        print("RESULT " + json.dumps(phase(a.phase, a.checkpoint, a.work)), flush=True)
        return
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    results = []
    for name in PHASES:
        cache = a.work / ("cache-empty" if name == "load-empty" else "cache")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
        t = time.perf_counter()
        run = subprocess.run([sys.executable, __file__, a.checkpoint, "--work", str(a.work), "--phase", name],
                             env=env, capture_output=True, text=True)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {"phase": name, "error": run.stderr.strip().splitlines()[-3:]}
        result["process_s"] = time.perf_counter() - t
        print(json.dumps(result), flush=True)
        results.append(result)
        if line is None:
            break
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "precompile_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

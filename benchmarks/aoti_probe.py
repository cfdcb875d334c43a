"""Can the codec's back (ConvBack._step, as StreamingCodec serves it) be compiled ahead of time
with torch.export + AOTInductor, one artifact for a dynamic batch and a dynamic piece length,
and loaded in a fresh process without dynamo? And how does that load compare with torch.compile
from a warm inductor cache?

Each phase runs in a fresh process (a subprocess of this script), in this order:

  export     torch.export.export (non-strict; --strict for dynamo) of a wrapper over
             ConvBack._step, forward(latents, *contexts) -> (audio, *new_contexts), batch and
             frames dynamic (T = steps * frames), then torch._inductor.aoti_compile_and_package
             -> WORK/back.pt2 (in its own empty inductor cache); the .pt2's files; the size
             bounds inductor's generated input checks hold latents to
  jit-cold   ConvBack(compiled=True).run (maybe_mark_dynamic, torch.compile) at --shapes, into
             an empty inductor cache WORK/cache-jit; saves its outputs
  jit-warm   the same, from the cache jit-cold filled
  load       import torch._inductor + aoti_load_package with an EMPTY inductor cache, first calls
             at --shapes (fish_sm not yet imported), then: outputs against eager _step and jit,
             the range's edges, an out-of-range batch, a non-contiguous latents view; on CUDA a
             CUDA graph captured over the loaded model
  load-warm  the same, from the cache `load` left (its CPU-ISA probe programs); with --steady
             also per-call times of the package, jit and eager
  load-raw   the C++ loader alone (torch._C._aoti.AOTIModelPackageLoader + boxed_run): no
             torch._inductor/_dynamo import, no ISA probes; EMPTY inductor cache

    python benchmarks/aoti_probe.py CHECKPOINT [--device cpu|cuda]
        [--work DIR] [--shapes 2x4,3x16] [--example 3x8] [--max-batch 64] [--max-frames 64]
        [--phases export,jit-cold,...] [--steady]

--device cuda builds the back as StreamingCodec does on CUDA: float16 (for a float32 codec),
channels-last [B, C, 1, T] activations and contexts (served batches reach
max_batch_frames // first = 128 rows: pass --max-batch 128 or more there, and --shapes
128x4,8x64 for the shapes working_bytes runs first). One JSON line per phase; WORK/results.json,
WORK/<phase>.stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file

PHASES = ("export", "jit-cold", "jit-warm", "load", "load-warm", "load-raw")
T_START = time.perf_counter()


LAYOUT = {"channels_last": "auto", "dtype": "auto"}  # --channels-last / --dtype overrides


def build_back(checkpoint: str, device: str, compiled: bool):
    """The back as StreamingCodec builds it on `device` (ConvBack's own arguments there), unless
    --channels-last / --dtype say otherwise (e.g. the CUDA layout tried on a CPU)."""
    import torch

    from fish_sm.engine.codec_stream import ConvBack
    from fish_sm.model.codec import load_codec

    codec = load_codec(Path(checkpoint) / "codec.pth", device=device)
    cuda = device.startswith("cuda")
    half = cuda and codec.dtype == torch.float32  # StreamingCodec: float16 back on CUDA
    dtype = torch.float16 if half else codec.dtype
    if LAYOUT["dtype"] != "auto":
        dtype = getattr(torch, LAYOUT["dtype"])
    channels_last = cuda if LAYOUT["channels_last"] == "auto" else LAYOUT["channels_last"] == "on"
    return ConvBack(codec, compiled=compiled, channels_last=channels_last, dtype=dtype)


def meta_of(back) -> dict:
    return {
        "latent_dim": back.latent_dim,
        "steps": back.steps,
        "channels_last": back.channels_last,
        "shapes": [list(s) for s in back.shapes],
        "dtypes": [str(d).removeprefix("torch.") for d in back.dtypes],
        "latent_dtype": str(back.dtype).removeprefix("torch."),  # the front hands the back its own dtype
    }


def make_inputs(meta: dict, rows: int, frames: int, seed: int, device: str):
    """Random latents [rows, latent_dim, frames*steps] and contexts [rows, ...] laid out as the
    engine passes them (channels-last contexts on CUDA). Needs only torch and `meta`."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    latents = torch.randn(rows, meta["latent_dim"], frames * meta["steps"], generator=g)
    latents = latents.to(device, getattr(torch, meta["latent_dtype"]))
    contexts = []
    for shape, dt in zip(meta["shapes"], meta["dtypes"]):
        c = torch.randn(rows, *shape, generator=g).to(device, getattr(torch, dt))
        if meta["channels_last"]:
            c = c.contiguous(memory_format=torch.channels_last)
        contexts.append(c)
    return latents, contexts


def check_bounds(pt2: str) -> list[str]:
    """The size bounds the package's own input checks (run only with AOTI_RUNTIME_CHECK_INPUTS=1)
    hold latents to: where inductor narrowed export's ranges while it compiled."""
    import re

    with zipfile.ZipFile(pt2) as z:
        name = next(n for n in z.namelist() if n.endswith(".wrapper.cpp"))
        cpp = z.read(name).decode()
    block = cpp[cpp.find("static void check_input_0("):]
    block = block[: block.find("static void check_input_1(")]
    return re.findall(r"dim value is too (small|large) at (\d+), \"\s*<< \"expected (?:it )?(?:to be )?([<>]= \d+)", block)


def sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_shapes(s: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split("x")) for p in s.split(",")]


def dynamo_frames() -> dict | str:
    """Dynamo's stats in this process (calls_captured, unique_graphs, ...), or that it was never imported."""
    if "torch._dynamo" not in sys.modules:
        return "dynamo not imported"
    import torch

    return dict(torch._dynamo.utils.counters["stats"])


def cache_files(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def phase(name: str, a) -> dict:
    import torch

    out: dict = {"phase": name, "import_torch_s": time.perf_counter() - T_START}
    work, dev = a.work, a.device
    pt2, meta_path = work / "back.pt2", work / "back_meta.json"
    shapes = parse_shapes(a.shapes)

    if name == "export":
        from torch import nn
        from torch.export import Dim

        t = time.perf_counter()
        back = build_back(a.checkpoint, dev, compiled=False)
        meta = meta_of(back)
        out["build_back_s"] = time.perf_counter() - t
        n_ctx = len(back.stateful)

        class Step(nn.Module):
            """ConvBack._step with flat tensor arguments and results (the dict-of-modules state
            is built inside from the positional contexts, so export sees only tensors)."""

            def __init__(self, back):
                super().__init__()
                self.back = back

            def forward(self, latents, *contexts):
                audio, new = self.back._step(latents, list(contexts))
                return (audio, *new)

        batch = Dim("batch", min=a.min_batch, max=a.max_batch)
        frames = Dim("frames", min=1, max=a.max_frames)
        lat_dyn = {0: batch, 2: back.steps * frames}  # T = steps * frames: only whole code frames
        dynamic_shapes = (lat_dyn, tuple({0: batch} for _ in range(n_ctx)))  # (varargs: one tuple)
        er, ef = parse_shapes(a.example)[0]
        latents, contexts = make_inputs(meta, er, ef, 0, dev)  # example: avoid 0/1 and max values
        step = Step(back).eval()
        with torch.no_grad():
            t = time.perf_counter()
            ep = torch.export.export(step, (latents, *contexts), dynamic_shapes=dynamic_shapes, strict=a.strict)
            out["export_s"] = time.perf_counter() - t
            out["export_strict"] = a.strict
            out["range_constraints"] = {str(k): str(v) for k, v in ep.range_constraints.items()}
            out["graph_nodes"] = len(ep.graph.nodes)
            t = time.perf_counter()
            path = torch._inductor.aoti_compile_and_package(ep, package_path=str(pt2),
                                                            inductor_configs=json.loads(a.aoti_config))
            out["aoti_compile_and_package_s"] = time.perf_counter() - t
        meta_path.write_text(json.dumps(meta))
        out["pt2_bytes"] = Path(path).stat().st_size
        with zipfile.ZipFile(path) as z:
            out["pt2_files"] = [f"{i.filename} ({i.file_size} B)" for i in z.infolist()]
        out["dynamo_frames"] = dynamo_frames()
        out["runtime_check_bounds_input0"] = check_bounds(path)
        return out

    meta = json.loads(meta_path.read_text())

    if name in ("load", "load-warm", "load-raw"):
        # Everything up to the first calls with torch alone: no fish_sm import, no model build.
        # run_single_threaded: no runner-pool locking, which the docs advise under CUDA graphs.
        single = dev.startswith("cuda") if a.single_threaded == "auto" else a.single_threaded == "on"
        out["run_single_threaded"] = single
        if name != "load-raw":  # the documented way
            t = time.perf_counter()
            import torch._inductor  # noqa: F401  (imports dynamo too, ~1-4 s)

            out["import_inductor_s"] = time.perf_counter() - t
            t = time.perf_counter()
            model = torch._inductor.aoti_load_package(str(pt2), run_single_threaded=single)
            sync(dev)
            out["aoti_load_package_s"] = time.perf_counter() - t
        else:  # the C++ loader alone: what aoti_load_package wraps, less its device-information
            # check (which compiles CPU-ISA probe programs into the inductor cache, with g++, on
            # any device) and less any import of torch._inductor / torch._dynamo
            t = time.perf_counter()
            loader = torch._C._aoti.AOTIModelPackageLoader(str(pt2), "model", single, 1, -1)
            sync(dev)
            out["raw_loader_s"] = time.perf_counter() - t
            out["inductor_imported_by_load"] = "torch._inductor" in sys.modules

            def model(latents, *contexts):
                return loader.boxed_run([latents, *contexts])  # (boxed: takes the list's tensors)
        results = []
        with torch.inference_mode():
            for i, (r, n) in enumerate(shapes):
                x = make_inputs(meta, r, n, 10 + i, dev)
                t = time.perf_counter()
                y = model(x[0], *x[1])
                sync(dev)
                out[f"first_call_{r}x{n}_s"] = time.perf_counter() - t
                results.append((x, y))
            out["load_to_first_calls_done_s"] = time.perf_counter() - T_START
            out["fish_sm_imported_before_calls"] = "fish_sm" in sys.modules
            out["dynamo_frames"] = dynamo_frames()
            out["inductor_cache_files_after"] = cache_files(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
            # Out of range: should be refused by the package's own size checks, not run wrongly.
            try:
                x = make_inputs(meta, a.max_batch + 1, 4, 99, dev)
                model(x[0], *x[1])
                out["out_of_range_batch"] = "ran"
            except Exception as e:  # noqa: BLE001
                out["out_of_range_batch"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            # Against eager _step on the same inputs.
            back = build_back(a.checkpoint, dev, compiled=False)
            for (x, y), (r, n) in zip(results, shapes):
                audio, new = back._step(x[0], x[1])
                out[f"audio_{r}x{n}_shape"] = list(y[0].shape)
                out[f"vs_eager_audio_{r}x{n}_max_abs"] = (y[0].float() - audio.float()).abs().max().item()
                out[f"vs_eager_ctx_{r}x{n}_max_abs"] = max((p.float() - q.float()).abs().max().item()
                                                          for p, q in zip(y[1:], new))
                out[f"ctx_strides_match_{r}x{n}"] = all(p.stride() == q.stride() for p, q in zip(y[1:], new))
            # The range's edges (not timed): smallest batch and piece, largest batch and piece.
            for r, n in ((a.min_batch, 1), (1, a.max_frames), (a.max_batch, 1), (a.max_batch, a.max_frames)):
                x = make_inputs(meta, r, n, 40, dev)
                try:
                    y = model(x[0], *x[1])
                    audio, new = back._step(x[0], x[1])
                    out[f"edge_{r}x{n}_vs_eager_max_abs"] = max((p.float() - q.float()).abs().max().item()
                                                               for p, q in zip(y, [audio, *new]))
                except Exception as e:  # noqa: BLE001
                    out[f"edge_{r}x{n}"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            # A latents view that is not contiguous (the engine slices z[..., :n * steps]): the
            # package bakes in contiguous strides and, its input checks off, reads it wrongly.
            r, n = shapes[0]
            big, x = make_inputs(meta, r, 2 * n, 50, dev)
            lat = big[..., : n * meta["steps"]]
            y = model(lat, *x)
            audio, _ = back._step(lat, x)
            out["noncontiguous_latents_vs_eager_max_abs"] = (y[0].float() - audio.float()).abs().max().item()
            jit_ref = work / "jit_outputs.pt"
            if jit_ref.exists():
                jit = torch.load(jit_ref, weights_only=True)  # tensors only: nothing else is unpickled
                for (x, y), (r, n), ref in zip(results, shapes, jit):
                    out[f"vs_jit_audio_{r}x{n}_max_abs"] = (y[0].float().cpu() - ref).abs().max().item()
            if dev.startswith("cuda"):  # a CUDA graph over the loaded model, as the engine captures one
                r, n = shapes[-1]
                x = make_inputs(meta, r, n, 20, dev)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    expected = model(x[0], *x[1])[0].clone()
                torch.cuda.current_stream().wait_stream(side)
                try:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        captured = model(x[0], *x[1])[0]
                    graph.replay()
                    sync(dev)
                    out["graph_replay_equal"] = bool(torch.equal(captured, expected))
                except Exception as e:  # noqa: BLE001
                    out["graph_replay_equal"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            if a.steady and name == "load-warm":
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "cache-jit")  # jit's from its warm cache
                out.update(steady(model, back, meta, shapes, dev))
        return out

    # jit-cold / jit-warm: as ConvBack.run compiles and calls it
    t = time.perf_counter()
    back = build_back(a.checkpoint, dev, compiled=True)
    out["build_back_s"] = time.perf_counter() - t
    with torch.inference_mode():
        for i, (r, n) in enumerate(shapes):
            x = make_inputs(meta, r, n, 10 + i, dev)
            t = time.perf_counter()
            back.run(x[0], x[1])
            sync(dev)
            out[f"first_call_{r}x{n}_s"] = time.perf_counter() - t
        out["to_first_calls_done_s"] = time.perf_counter() - T_START
        out["dynamo_frames"] = dynamo_frames()
        ref = []
        for i, (r, n) in enumerate(shapes):
            x = make_inputs(meta, r, n, 10 + i, dev)
            y = back.run(x[0], x[1])
            audio, _ = back._step(x[0], x[1])
            out[f"vs_eager_audio_{r}x{n}_max_abs"] = (y[0].float() - audio.float()).abs().max().item()
            ref.append(y[0].float().cpu())
        torch.save(ref, work / "jit_outputs.pt")
    return out


def steady(model, back, meta, shapes, dev, reps: int = 20) -> dict:
    """Median per-call seconds of the loaded package, a jit-compiled back (from the warm cache)
    and eager _step, each shape."""
    import statistics

    import torch

    jit = torch.compile(back._step)
    out = {}
    for i, (r, n) in enumerate(shapes):
        x = make_inputs(meta, r, n, 30 + i, dev)
        for t in (x[0], *x[1]):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(x[0], 2)
        for label, fn in (("aoti", lambda: model(x[0], *x[1])), ("jit", lambda: jit(x[0], x[1])),
                          ("eager", lambda: back._step(x[0], x[1]))):
            fn()
            times = []
            for _ in range(reps):
                sync(dev)
                t = time.perf_counter()
                fn()
                sync(dev)
                times.append(time.perf_counter() - t)
            out[f"steady_{label}_{r}x{n}_ms"] = 1000 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=Path("/tmp/aoti_probe/work"))
    ap.add_argument("--shapes", default="2x4,3x16", help="ROWSxFRAMES,... for the first calls")
    ap.add_argument("--example", default="3x8", help="ROWSxFRAMES of export's example inputs")
    ap.add_argument("--min-batch", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64, help="served CUDA batches reach max_batch_frames // first = 128")
    ap.add_argument("--max-frames", type=int, default=64)
    ap.add_argument("--strict", action="store_true", help="torch.export strict mode (dynamo); default non-strict")
    ap.add_argument("--steady", action="store_true", help="also time steady per-call aoti vs jit vs eager")
    ap.add_argument("--channels-last", choices=("auto", "on", "off"), default="auto",
                    help="auto: as StreamingCodec (on for CUDA); on: the CUDA layout on any device")
    ap.add_argument("--dtype", default="auto", help="the back's dtype; auto: as StreamingCodec")
    ap.add_argument("--single-threaded", choices=("auto", "on", "off"), default="auto",
                    help="the loaders' run_single_threaded; auto: on for CUDA (CUDA graphs)")
    ap.add_argument("--aoti-config", default="{}", help='JSON inductor_configs for aoti_compile_and_package, '
                    'e.g. \'{"max_autotune": true}\'')
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    a = ap.parse_args()
    LAYOUT.update(channels_last=a.channels_last, dtype=a.dtype)
    if a.phase:
        print("RESULT " + json.dumps(phase(a.phase, a)), flush=True)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    results = []
    # jit runs before load so that load can compare with jit's outputs too
    order = [p for p in PHASES if p in a.phases.split(",")]
    root = str(Path(__file__).resolve().parents[1])  # fish_sm, for the phases' processes
    for name in order:
        cache = a.work / {"export": "cache-export", "load": "cache-load", "load-warm": "cache-load",
                          "load-raw": "cache-load-raw"}.get(name, "cache-jit")
        if name not in ("jit-warm", "load-warm"):  # the others start from an empty inductor cache
            shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", name]
        t = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {"phase": name, "error": run.stderr.strip().splitlines()[-15:]}
        result["process_s"] = time.perf_counter() - t
        (a.work / f"{name}.stderr").write_text(run.stderr)
        print(json.dumps(result), flush=True)
        results.append(result)
        if line is None and name == "export":
            break
    (a.work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

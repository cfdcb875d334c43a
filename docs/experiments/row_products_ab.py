"""The one-row products as `fish_sm.model.row_products` kernels against inductor's, in one
process. Not part of the package.

    [PRODUCTS="slow wo,w2"] python docs/experiments/row_products_ab.py - sweep
        each product of S1-mini's layers (bf16 and int8 weights) at every launch config of a
        grid, weights rotating through 16 copies as a frame reads them from memory: the best
        configs against `launch_config`'s ($OUT/row_products_sweep.json)
    python docs/experiments/row_products_ab.py CHECKPOINT_DIR frames bf16:inductor,bf16:rows,int8:inductor,int8:rows [ROUNDS]
        whole engines (also `rows_torch_pickers`, `rows_residual_kernels`: see `frames`): decode speed in turns, the kernel profile and graph replay at 1,100
        slots, the compiled-against-eager check ($OUT/row_products_frames.json)
"""
import json, os, sys, time

import torch

from fish_sm.engine import generate, sampling_kernels
from fish_sm.model import dual_ar, row_products

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from experiment_tools import decode_in_turns, graphed_us  # noqa: E402

OUT = os.environ.get("OUT", ".")
# (name, N, K, prologue, residual): a slow layer's four products, then the fast layers' two other shapes
PRODUCTS = [("slow wqkv", 4096, 1024, row_products.NORM, False), ("slow wo", 1024, 2048, row_products.PLAIN, True),
            ("w13", 6144, 1024, row_products.NORM, False), ("w2", 1024, 3072, row_products.SWIGLU, True),
            ("fast wqkv", 2048, 1024, row_products.NORM, False), ("fast wo", 1024, 1024, row_products.PLAIN, True)]


def sweep() -> dict:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "products": {}}
    default = row_products.launch_config
    grid = [(n, k, w) for n in (2, 4, 8, 16) for k in (512, 1024, 2048, 4096) for w in (2, 4, 8)]
    copies = 16
    g = torch.Generator().manual_seed(0)
    only = os.environ.get("PRODUCTS")  # e.g. "slow wo,w2"
    for name, n, k, prologue, residual in PRODUCTS:
        if only and name not in only.split(","):
            continue
        width = 2 * k if prologue == row_products.SWIGLU else k
        x = (torch.randn(1, 1, width, generator=g) * 2).to("cuda", torch.bfloat16)
        norm = torch.ones(k, device="cuda", dtype=torch.bfloat16) if prologue == row_products.NORM else None
        res = torch.randn(1, 1, n, generator=g).to("cuda", torch.bfloat16) if residual else None
        for kind in ("bf16", "int8"):
            sets = []
            for _ in range(copies):
                w = (torch.randn(n, k, generator=g) * 0.03).to("cuda", torch.bfloat16)
                if kind == "int8":
                    scale = w.float().abs().amax(1) / 127
                    sets.append((torch.round(w.float() / scale[:, None]).to(torch.int8), scale))
                else:
                    sets.append((w, None))
            turn = iter(range(10**9))
            call = lambda: row_products.row_product(x, *sets[next(turn) % copies], norm, res, prologue, 1e-6)
            times = {}
            for config in grid:
                if config[1] > row_products.triton.next_power_of_2(k):
                    continue
                row_products.launch_config = lambda *_a, c=config: c
                try:
                    times[str(config)] = graphed_us(call)
                except Exception as e:  # a config that does not compile (registers, shared memory)
                    times[str(config)] = repr(e)[:200]
            row_products.launch_config = default
            shipped = default(n, k, kind == "int8")
            numeric = {c: t for c, t in times.items() if isinstance(t, float)}
            best = min(numeric, key=numeric.get)
            megabytes = n * k * (1 if kind == "int8" else 2) / 1e6
            entry = {"shipped": str(shipped), "shipped_us": numeric.get(str(shipped)), "best": best,
                     "best_us": numeric[best], "weight_mb": megabytes,
                     "best_tb_per_s": megabytes / numeric[best], "all": times}
            out["products"][f"{name} {kind}"] = entry
            print(name, kind, json.dumps({k: v for k, v in entry.items() if k != "all"}), flush=True)
            json.dump(out, open(os.path.join(OUT, "row_products_sweep.json"), "w"), indent=1)
    return out


def frames(checkpoint: str, variants: list[str], rounds: int) -> dict:
    from fish_sm.engine.benchmark import SENTENCE, compare_compiled_to_eager, profile_decode
    from fish_sm.engine.engine import Engine
    from fish_sm.engine.prompt import build_prompt

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}, "rounds": []}
    save = lambda: json.dump(out, open(os.path.join(OUT, "row_products_frames.json"), "w"), indent=1)
    auto = dual_ar.DualARTransformer.uses_row_products
    kernels_usable, head_kernels = sampling_kernels.usable, generate.pick_head_kernels
    engines = {}
    for variant in variants:
        mode, products = variant.split(":")
        dual_ar.DualARTransformer.uses_row_products = auto if products.startswith("rows") else (lambda self: False)
        # rows_torch_pickers: the products' kernels with inductor's sampling; rows_residual_kernels:
        # with the sampling kernels for the residual codes only
        sampling_kernels.usable = (lambda device: False) if products == "rows_torch_pickers" else kernels_usable
        generate.pick_head_kernels = None if products == "rows_residual_kernels" else head_kernels
        try:
            engine = Engine.from_pretrained(checkpoint, device="cuda")
            if mode == "int8":
                engine.quantize_int8()
            t0 = time.perf_counter()
            engine.compile()
            info = {"compile_s": time.perf_counter() - t0, "row_products": hasattr(engine.model.layers[0], "rows_wqkv")}
            prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
            info["compiled_vs_eager"] = compare_compiled_to_eager(engine, prompt)
            info["profile"] = profile_decode(engine, 1, 1100, top=int(os.environ.get("TOP", 12)))
            engines[variant] = engine
        except Exception:  # a variant that does not build: recorded, the others go on
            import traceback
            info = {"error": traceback.format_exc()[-3000:]}
        dual_ar.DualARTransformer.uses_row_products = auto
        sampling_kernels.usable, generate.pick_head_kernels = kernels_usable, head_kernels
        out["variants"][variant] = info
        print(variant, json.dumps({k: v for k, v in info.items() if k != "profile"}),
              json.dumps({k: v for k, v in info.get("profile", {}).items() if k != "top"}), flush=True)
        save()
    decode_in_turns(engines, rounds, out, save)
    return out


if __name__ == "__main__":
    if sys.argv[2] == "sweep":
        sweep()
    else:
        frames(sys.argv[1], sys.argv[3].split(","), int(sys.argv[4]) if len(sys.argv) > 4 else 2)

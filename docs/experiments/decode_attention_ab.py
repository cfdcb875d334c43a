"""The decode step's attention as fish_sm.model.decode_attention (as shipped) or as SDPA
(cuDNN, reading the whole bucket), in one process, the variants in turns. Not part of the package.

    python docs/experiments/decode_attention_ab.py CHECKPOINT_DIR sequential [ROUNDS]
        # one row: decode speed, kernel profile, compiled against eager; then each attention
        # alone, timed in CUDA graphs of 100 calls; writes $OUT/decode_attention_sequential.json
    python docs/experiments/decode_attention_ab.py - sweep
        # the kernel alone over launch configs (programs, slots per block, warps) at the
        # engine's shapes, against SDPA; writes $OUT/decode_attention_sweep.json
    python docs/experiments/decode_attention_ab.py CHECKPOINT_DIR batching [ROUNDS] [STREAMS=1,32,64]
        # the batching engine (KV 2,048), streamed requests of 200 frames; writes $OUT/decode_attention_batching.json
"""
import json, os, sys, time

import torch
import torch.nn.functional as F

from fish_sm.engine.benchmark import SENTENCE, compare_compiled_to_eager, profile_decode
from fish_sm.engine.engine import Engine, freeze_start_up_objects
from fish_sm.engine.prompt import build_prompt
from fish_sm.model import decode_attention
from experiment_tools import decode_in_turns, graphed_us, levels_in_turns

checkpoint, what = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}, "rounds": []}
usable = decode_attention.usable


def variant(name: str):
    decode_attention.usable = usable if name == "kernel" else (lambda q, k, v: False)


def save():
    with open(os.path.join(os.environ.get("OUT", "."), f"decode_attention_{what}.json"), "w") as f:
        json.dump(out, f, indent=1)


SHAPES = ((1, 16, 8, 128, 1280, False), (1, 16, 8, 128, 4096, False), (32, 16, 8, 128, 512, False),
          (32, 16, 8, 128, 512, True), (8, 16, 8, 128, 256, True), (1, 16, 8, 64, 10, False))


def attention_alone(bsz, heads, kv, dim, live, per_row, configs):
    """SDPA (cuDNN, with the decode step's mask) and the kernel under each config, in us a call."""
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(bsz, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (torch.randn(bsz, kv, live, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    pos = (torch.randint(live // 2, live, (bsz, 1), device="cuda", generator=g) if per_row
           else torch.tensor([live - 1], device="cuda"))
    p = pos.reshape(-1).expand(bsz) if pos.numel() == 1 else pos.reshape(-1)
    bias = torch.zeros(bsz, 1, 1, live, device="cuda", dtype=torch.bfloat16).masked_fill_(
        (torch.arange(live, device="cuda")[None, :] > p[:, None])[:, None, None], float("-inf"))
    result = {"sdpa_us": graphed_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))}
    shipped = decode_attention.launch_config
    for config in configs:
        decode_attention.launch_config = (lambda b, n, s, c=config: shipped(b, n, s, *c)) if config else shipped
        result[str(config) if config else "kernel_us"] = graphed_us(lambda: decode_attention.decode_attention(q, k, v, pos))
    decode_attention.launch_config = shipped
    return result


if what == "sweep":
    configs = [None] + [(t, b, w) for t in (256, 512, 1024, 2048) for b in (32, 64, 128) for w in (2, 4, 8)]
    for shape in SHAPES:
        key = "{}x{}{} d{}".format(shape[0], shape[4], " per-row" if shape[5] else "", shape[3])
        r = attention_alone(*shape, configs)
        best = min((k for k in r if k.startswith("(")), key=r.get)
        out[key] = {"sdpa_us": r["sdpa_us"], "shipped_us": r["kernel_us"], "best": best, "best_us": r[best], "all": r}
        print(key, json.dumps({k: v for k, v in out[key].items() if k != "all"}), flush=True)
        save()
elif what == "sequential":
    engines = {}
    for name in ("sdpa", "kernel"):
        variant(name)  # read when the graphs are captured
        engine = Engine.from_pretrained(checkpoint, device="cuda")
        t0 = time.perf_counter()
        engine.compile()
        info = {"compile_s": time.perf_counter() - t0}
        prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
        info["compiled_vs_eager"] = compare_compiled_to_eager(engine, prompt, steps=32)
        info["profile"] = profile_decode(engine, 1, 1100, top=8)
        out["variants"][name] = info
        engines[name] = engine
        print(name, json.dumps(info["compiled_vs_eager"]), json.dumps({k: v for k, v in info["profile"].items()
                                                                        if k != "top"}), flush=True)
        save()
    variant("kernel")
    decode_in_turns(engines, rounds, out, save)
    alone = {}
    for shape in SHAPES:
        alone["{}x{}{} d{}".format(shape[0], shape[4], " per-row" if shape[5] else "", shape[3])] = attention_alone(*shape, [None])
        print("alone", json.dumps(alone), flush=True)
    out["attention_alone"] = alone
    save()
else:
    from fish_sm.engine.batching import BatchEngine

    streams = [int(n) for n in (sys.argv[4] if len(sys.argv) > 4 else "1,32,64").split(",")]
    batchers = {}
    for name in ("sdpa", "kernel"):
        variant(name)
        engine = Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048)
        batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0)
        t0 = time.perf_counter()
        batcher.compile()
        engine._step = batcher._step
        out["variants"][name] = {"compile_s": time.perf_counter() - t0, "profile_32": profile_decode(engine, 32, 300, top=8)}
        engine._step = None
        print(name, json.dumps({k: v for k, v in out["variants"][name]["profile_32"].items() if k != "top"}), flush=True)
        batchers[name] = batcher
    variant("kernel")
    freeze_start_up_objects()
    out["levels"] = levels_in_turns(batchers, streams, rounds, "variant")
    save()

"""Whole decode frames with hand-written INT8 products (the Triton kernels of
docs/experiments/int8_gemv.py) in every layer's one-row halves, against bf16 and torchao's
INT8 as shipped, in one process: what int8_gemv.py's per-layer estimate (~1.14x bf16) comes
to in a frame. Not part of the package.

The hand-written halves do what `TransformerBlock._pre_attention_writing` and
`_post_attention` do, with the products as one custom op (RMSNorm, SwiGLU and residual adds
fused into them) and the rest (QK-norm, RoPE, the cache write) compiled as before. The
weights are torchao's own int8 data and scales, taken from its quantized linear layers.
The slow and fast heads stay with torchao. Prefills run the torchao layers.

    python docs/experiments/int8_frame.py CHECKPOINT_DIR     # GPU: writes $OUT/int8_frame.json
    DEV=cpu python docs/experiments/int8_frame.py CHECKPOINT_DIR   # CPU: checks the halves against the model's (reference op)
"""
import json, os, statistics, sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fish_sm.engine import Engine  # noqa: E402
from fish_sm.engine.benchmark import SENTENCE, measure  # noqa: E402
from fish_sm.engine.generate import GraphedStep, generate_frames  # noqa: E402
from fish_sm.engine.prompt import build_prompt  # noqa: E402
from fish_sm.engine.sampling import SamplingParams  # noqa: E402
from fish_sm.model.dual_ar import TransformerBlock, compile_decode  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
PRODUCTS = {"wqkv": ("attention", "wqkv"), "wo": ("attention", "wo"), "w13": ("feed_forward", "w13"),
            "w2": ("feed_forward", "w2")}


@torch.library.custom_op("fish_sm_experiment::int8_gemv", mutates_args=())
def int8_product(x: Tensor, w: Tensor, scale: Tensor, norm: Optional[Tensor], res: Optional[Tensor],
                 prologue: int, eps: float) -> Tensor:
    """One row's x [1, 1, K] (or [1, 1, 2K] for SwiGLU) times int8 w [N, K], scale [N]: [1, 1, N]."""
    if x.is_cuda:
        from int8_gemv import int8_gemv
        import triton

        n, k = w.shape
        out = torch.empty(n, dtype=x.dtype, device=x.device)
        flat = x.reshape(-1).contiguous()
        args = (flat, norm if norm is not None else flat, w, scale, res.reshape(-1).contiguous() if res is not None else flat,
                out, n, eps)
        int8_gemv[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, K=k, PROLOGUE=prologue,
                                                                    RESIDUAL=res is not None)
        return out.view(*x.shape[:-1], n)
    return reference(x, w, scale, norm, res, prologue, eps)


@int8_product.register_fake
def _(x, w, scale, norm, res, prologue, eps):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def reference(x, w, scale, norm, res, prologue, eps):
    """The kernel's arithmetic in torch, rounding where it rounds."""
    bf16 = lambda t: t.to(torch.bfloat16).float()
    xf = x.reshape(-1).float()
    if prologue == 1:
        a = bf16(bf16(xf * torch.rsqrt(xf.pow(2).mean() + eps)) * norm.float())
    elif prologue == 2:
        gate, up = xf.chunk(2)
        a = bf16(bf16(F.silu(gate)) * up)
    else:
        a = xf
    y = bf16((w.float() @ a) * scale.float())
    if res is not None:
        y = bf16(y + res.reshape(-1).float())
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def pre_hand(block: TransformerBlock, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
    """`_pre_attention_writing` with norm and wqkv as one product."""
    a = block.attention
    qkv = int8_product(x, block.int8_wqkv, block.int8_wqkv_scale, block.attention_norm.weight, None, 1,
                       block.attention_norm.eps)
    q, k, v = a.heads(qkv, rope)
    a.kv_cache.write(input_pos.view(-1, x.shape[1]), k, v, torch.arange(x.shape[0], device=x.device))
    return q


def post_hand(block: TransformerBlock, x: Tensor, y: Tensor) -> Tensor:
    """`_post_attention` as three products: wo + x; ffn_norm then w13; SwiGLU then w2 + h."""
    h = int8_product(y, block.int8_wo, block.int8_wo_scale, None, x, 0, 0.0)
    gate_up = int8_product(h, block.int8_w13, block.int8_w13_scale, block.ffn_norm.weight, None, 1, block.ffn_norm.eps)
    return int8_product(gate_up, block.int8_w2, block.int8_w2_scale, None, h, 2, 0.0)


def attach(block: TransformerBlock) -> None:
    """torchao's int8 data and scales of the block's four products, as buffers (compiled
    code takes module buffers as inputs: one graph for every block)."""
    for name, (part, attr) in PRODUCTS.items():
        weight = getattr(getattr(block, part), attr).weight
        block.register_buffer(f"int8_{name}", weight.qdata, persistent=False)
        block.register_buffer(f"int8_{name}_scale", weight.scale.reshape(-1).float().contiguous(), persistent=False)


def hand_written(engine: Engine) -> None:
    """Compile and capture `engine` (INT8) with the hand-written halves for one row."""
    model = engine.model
    step = GraphedStep(model)
    halves = compile_decode(pre_hand, one_row=True), compile_decode(post_hand, one_row=True)
    for block in [*model.layers, *model.fast_layers]:
        attach(block)
        block.compiled = (halves, block.compiled[1])
    step.capture_all(prefill=True)
    engine._step = step


def cpu_check(checkpoint: str) -> dict:
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype="bfloat16")
    engine.quantize_int8()
    model, worst = engine.model, {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for kind, blocks in (("slow", model.layers), ("fast", model.fast_layers)):
            for block in blocks:
                attach(block)
                dim = block.attention_norm.weight.shape[0]
                x = torch.randn(1, 1, dim, generator=g).to(torch.bfloat16)
                y = torch.randn(1, 1, block.attention.n_head * block.attention.head_dim, generator=g).to(torch.bfloat16)
                rope = (model.rope if kind == "slow" else model.fast_rope)[3:4]
                pos = torch.tensor([3])
                q_want = TransformerBlock._pre_attention_writing(block, x, rope, pos)
                k_want = block.attention.kv_cache.k[0, :, 3].clone()
                q_got = pre_hand(block, x, rope, pos)
                k_got = block.attention.kv_cache.k[0, :, 3].clone()
                post_want, post_got = TransformerBlock._post_attention(block, x, y), post_hand(block, x, y)
                for name, a, b in (("q", q_want, q_got), ("k", k_want, k_got), ("post", post_want, post_got)):
                    key = f"{kind}_{name}"
                    worst[key] = max(worst.get(key, 0.0), (a.float() - b.float()).abs().max().item() /
                                     max(a.float().abs().max().item(), 1e-6))
    return {"largest_relative_diff_against_torchao_halves": worst}


def main():
    checkpoint = sys.argv[1]
    if DEV != "cuda":
        print(json.dumps(cpu_check(checkpoint)))
        return
    engines = {}
    for name in ("bf16", "int8_torchao", "int8_hand_written"):
        engine = Engine.from_pretrained(checkpoint, device="cuda")
        if name != "bf16":
            engine.quantize_int8()
        if name == "int8_hand_written":
            hand_written(engine)
        else:
            engine.compile()
        engines[name] = engine
        print(f"{name} compiled", flush=True)
    out = {"rounds": []}
    for round_ in range(2):  # in turns, so that drift between the variants shows
        for name, engine in engines.items():
            result = {"variant": name, "round": round_, **measure(engine, 400, 2, 1000)}
            out["rounds"].append(result)
            print(json.dumps(result), flush=True)
    out["decode_frames_per_s_median"] = {
        name: statistics.median(r["decode_frames_per_s"] for r in out["rounds"] if r["variant"] == name) for name in engines}
    base = out["decode_frames_per_s_median"]["bf16"]
    out["against_bf16"] = {name: v / base for name, v in out["decode_frames_per_s_median"].items()}
    # The same request through torchao's INT8 and the hand-written one: how many codes agree.
    prompt = build_prompt(engines["bf16"].tokenizer, engines["bf16"].config.num_codebooks, [], SENTENCE)
    codes = {}
    for name in ("int8_torchao", "int8_hand_written"):
        e = engines[name]
        codes[name] = torch.stack(list(generate_frames(e.model, prompt, SamplingParams(seed=3, max_new_tokens=100),
                                                       torch.Generator("cuda").manual_seed(3), step=e._step)))
    a, b = codes["int8_torchao"], codes["int8_hand_written"]
    n = min(len(a), len(b))
    out["codes_agree_first_frames"] = int((a[:n] == b[:n]).all(dim=1).long().cumprod(0).sum())
    out["codes_agree_share"] = (a[:n] == b[:n]).float().mean().item()
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "int8_frame.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Hand-written INT8 weight-only matrix-vector products (Triton) against inductor's kernels,
on one S1-mini layer at one row: what INT8 could gain at batch 1 if its products ran at
bf16's efficiency per byte. Not part of the package.

Each product reads int8 weights with one scale per output row and fuses what inductor fuses
around the same product in the decode step: the RMSNorm before qkv and w13, SwiGLU before
w2, the residual add after wo and w2. Timed in CUDA graphs of 100 calls each:
- "norm + wqkv": `wqkv(attention_norm(x))`;
- "post-attention": `_post_attention(x, y)` (wo, residual, ffn_norm, w13, SwiGLU, w2, residual);
each as inductor compiles it for the decode step (bf16, and torchao INT8), and as three (one)
hand-written kernels; first on one set of weights (which then sits in the L2 cache), then
with the weights rotating through 32 copies (bf16 and hand-written), as a decode step reads
them. The hand-written results are checked against the same int8 weights dequantized and
run in torch.

    python docs/experiments/int8_gemv.py              # GPU: writes $OUT/int8_gemv.json
    TRITON_INTERPRET=1 python docs/experiments/int8_gemv.py   # CPU: the correctness check only, small shapes
"""
import json, os, statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
           for n in (4, 8, 16, 32) for k in (128, 256, 512) for w in (2, 4, 8)]
if os.environ.get("INT8_GEMV_CONFIGS") == "few":  # the winners of the full sweep on an H100 (eighth pass, call 9)
    CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": 512}, num_warps=w) for n, w in ((8, 8), (4, 4), (4, 8))]


@triton.autotune(configs=CONFIGS, key=["N", "K", "PROLOGUE", "RESIDUAL"])
@triton.jit
def int8_gemv(x_ptr, norm_ptr, w_ptr, scale_ptr, res_ptr, out_ptr, N, eps,
              K: tl.constexpr, PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n] = scale[n] * sum_k a[k] w[n, k] (+ res[n]), bf16 out; a = x (PROLOGUE 0),
    RMSNorm(x) * norm (1, as the model rounds it), silu(x[:K]) * x[K:] (2, SwiGLU)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    if PROLOGUE == 1:
        whole = tl.load(x_ptr + tl.arange(0, K)).to(tl.float32)
        inv = tl.rsqrt(tl.sum(whole * whole, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if PROLOGUE == 0:
            a = tl.load(x_ptr + ks).to(tl.float32)
        elif PROLOGUE == 1:
            a = (tl.load(x_ptr + ks).to(tl.float32) * inv).to(tl.bfloat16).to(tl.float32)
            a = (a * tl.load(norm_ptr + ks).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        else:
            g = tl.load(x_ptr + ks).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
            a = (a * tl.load(x_ptr + K + ks).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=live[:, None], other=0).to(tl.float32)
        acc += w * a[None, :]
    y = (tl.sum(acc, 1) * tl.load(scale_ptr + rows, mask=live, other=0).to(tl.float32)).to(tl.bfloat16)
    if RESIDUAL:
        y = (y.to(tl.float32) + tl.load(res_ptr + rows, mask=live, other=0).to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + rows, y, mask=live)


def quantize(w: torch.Tensor):
    """Symmetric int8 per output row (as torchao's weight-only INT8)."""
    scale = w.float().abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(w.dtype)


def gemv(x, q, norm=None, swiglu=False, res=None, eps=1e-6):
    w, scale = q
    n, k = w.shape
    out = torch.empty(n, dtype=torch.bfloat16, device=x.device)
    prologue = 2 if swiglu else 1 if norm is not None else 0
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)
    args = (x, norm if norm is not None else x, w, scale, res if res is not None else x, out, n, eps)
    if x.is_cuda:
        int8_gemv[grid](*args, K=k, PROLOGUE=prologue, RESIDUAL=res is not None)
    else:  # Triton's interpreter: one configuration, no tuning
        int8_gemv.fn[grid](*args, K=k, PROLOGUE=prologue, RESIDUAL=res is not None, BLOCK_N=4, BLOCK_K=32)
    return out


def rms(x, weight, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def reference(x, y, g_attn, g_ffn, qs):
    """The same products in torch with the int8 weights dequantized (bf16)."""
    deq = {name: (w.to(torch.bfloat16) * s[:, None]) for name, (w, s) in qs.items()}
    qkv = F.linear(rms(x, g_attn), deq["wqkv"])
    h = x + F.linear(y, deq["wo"])
    gate, up = F.linear(rms(h, g_ffn), deq["w13"]).chunk(2)
    return qkv, h + F.linear(F.silu(gate) * up, deq["w2"])


def post_custom(x, y, g_ffn, qs):
    h = gemv(y, qs["wo"], res=x)
    return gemv(gemv(h, qs["w13"], norm=g_ffn), qs["w2"], swiglu=True, res=h)


def custom(x, y, g_attn, g_ffn, qs):
    return gemv(x, qs["wqkv"], norm=g_attn), post_custom(x, y, g_ffn, qs)


def graphed_us(fn, calls=100) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `calls` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main():
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dim, heads, kv_heads, head_dim, hidden = (1024, 16, 8, 128, 3072) if cuda else (64, 4, 2, 16, 96)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    weights = {"wqkv": rnd((heads + 2 * kv_heads) * head_dim, dim), "wo": rnd(dim, heads * head_dim),
               "w13": rnd(2 * hidden, dim), "w2": rnd(dim, hidden)}
    g_attn, g_ffn = (1 + rnd(dim)).contiguous(), (1 + rnd(dim)).contiguous()
    qs = {name: quantize(w) for name, w in weights.items()}
    x, y = rnd(dim) * 50, rnd(heads * head_dim) * 50
    with torch.inference_mode():
        want, got = reference(x, y, g_attn, g_ffn, qs), custom(x, y, g_attn, g_ffn, qs)
    out = {"max_abs_diff": {name: (a.float() - b.float()).abs().max().item() for name, a, b in
                            zip(("qkv", "post_attention"), want, got)},
           "max_abs": {name: a.float().abs().max().item() for name, a in zip(("qkv", "post_attention"), want)}}
    print(json.dumps(out), flush=True)
    if not cuda:
        return
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from fish_sm.model.dual_ar import TransformerBlock, compile_decode

    def block(quantized: bool) -> TransformerBlock:
        b = TransformerBlock(dim, heads, kv_heads, head_dim, hidden, False, False, True, 1e-6).to(dev, torch.bfloat16)
        b.attention.wqkv.weight.data, b.attention.wo.weight.data = weights["wqkv"], weights["wo"]
        b.feed_forward.w13.weight.data, b.feed_forward.w2.weight.data = weights["w13"], weights["w2"]
        b.attention_norm.weight.data, b.ffn_norm.weight.data = g_attn, g_ffn
        if quantized:
            quantize_(b, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
        return b.eval()

    xs, ys = x.view(1, 1, dim), y.view(1, 1, -1)
    blocks = (("bf16", block(False)), ("int8_torchao", block(True)))  # (torchao quantizes outside inference mode)
    with torch.inference_mode():
        for name, b in blocks:
            qkv = compile_decode(lambda x, b=b: b.attention.wqkv(b.attention_norm(x)), one_row=True)
            post = compile_decode(lambda x, y, b=b: TransformerBlock._post_attention(b, x, y), one_row=True)
            out[name] = {"norm_wqkv_us": graphed_us(lambda: qkv(xs)), "post_attention_us": graphed_us(lambda: post(xs, ys))}
            print(json.dumps({name: out[name]}), flush=True)
        gate_up = torch.randn(2 * hidden, generator=g).to(torch.bfloat16).to(dev)
        out["int8_hand_written"] = {
            "norm_wqkv_us": graphed_us(lambda: gemv(x, qs["wqkv"], norm=g_attn)),
            "post_attention_us": graphed_us(lambda: post_custom(x, y, g_ffn, qs)),
            "wo_us": graphed_us(lambda: gemv(y, qs["wo"], res=x)),
            "w13_us": graphed_us(lambda: gemv(x, qs["w13"], norm=g_ffn)),
            "w2_us": graphed_us(lambda: gemv(gate_up, qs["w2"], swiglu=True, res=x)),
            "configs": {str(key): str(config) for key, config in int8_gemv.cache.items()},
        }
        print(json.dumps({"int8_hand_written": out["int8_hand_written"]}), flush=True)
        # The same products with the weights rotating through 32 copies (1 GB in bf16, far more than
        # the 50 MB L2), as a decode step reads 68 layers' weights from memory, not from L2.
        copies = 32
        sets = [{name: rnd(*w.shape) for name, w in weights.items()} for _ in range(copies)]
        qsets = [{name: quantize(w) for name, w in ws.items()} for ws in sets]

        def post_bf16(x, y, wo, w13, w2):
            h = x + F.linear(y, wo)
            gate, up = F.linear(rms(h, g_ffn), w13).chunk(2, dim=-1)
            return h + F.linear(F.silu(gate) * up, w2)

        qkv_bf16 = compile_decode(lambda x, w: F.linear(rms(x, g_attn), w), one_row=True)
        post = compile_decode(post_bf16, one_row=True)
        turn = iter(range(10**9))
        out["rotating_32_copies"] = {
            "bf16_norm_wqkv_us": graphed_us(lambda: qkv_bf16(xs, sets[next(turn) % copies]["wqkv"])),
            "bf16_post_attention_us": graphed_us(lambda: post(xs, ys, *(sets[next(turn) % copies][n] for n in ("wo", "w13", "w2")))),
            "int8_hand_written_norm_wqkv_us": graphed_us(lambda: gemv(x, qsets[next(turn) % copies]["wqkv"], norm=g_attn)),
            "int8_hand_written_post_attention_us": graphed_us(lambda: post_custom(x, y, g_ffn, qsets[next(turn) % copies])),
        }
        print(json.dumps({"rotating_32_copies": out["rotating_32_copies"]}), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "int8_gemv.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

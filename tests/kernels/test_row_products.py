"""The one-row product kernels (`fish_sm.kernels.row_products`): on the CPU, the layer halves
built on them against the model's own halves (their torch arithmetic, which is the
kernels'); on a GPU, the kernels against that arithmetic."""
import pytest
import torch

from fish_sm.engine import Engine
from fish_sm.kernels import SEQUENTIAL, AdapterSlots, decode_attention, install, lora_products, row_products
from fish_sm.kernels.lora import LoraLinear
from fish_sm.kernels.modules import KernelBlock
from fish_sm.model.dual_ar import TransformerBlock
from fish_sm.model.lora import random_adapter

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and row_products.triton is not None),
                               reason="needs CUDA and Triton")


def both_steps(model, block, rope, seed=0):
    """(output, the cache's new k and v) of a decode step at position 3 over a cache with
    earlier slots filled: the layer's own (eager) step, then `_decode_row`'s."""
    g = torch.Generator().manual_seed(seed)
    dim = block.attention_norm.weight.shape[0]
    x = torch.randn(1, 1, dim, generator=g).to(model.dtype) * 3
    cache = block.attention.kv_cache
    earlier = torch.randn(2, *cache.k[0, :, :3].shape, generator=g).to(model.dtype)
    pos = torch.tensor([3])
    out = []
    for step in (lambda: block(x, rope[3:4], pos, 4), lambda: block._decode_row(x, rope[3:4], pos, 4, None)):
        cache.k.zero_(), cache.v.zero_()
        cache.k[0, :, :3], cache.v[0, :, :3] = earlier
        out.append((step(), cache.k[0, :, 3].clone(), cache.v[0, :, 3].clone()))
    return out


def each_layer_both_ways(model):
    """(block, its own step's results, `_decode_row`'s) for every slow and fast layer, the
    kernels' weights attached (each layer must be readable by them)."""
    model.setup_caches(1, 16)
    for blocks, rope in ((model.layers, model.rope), (model.fast_layers, model.fast_rope)):
        for block in blocks:
            block = KernelBlock(block, rows=True)
            assert block.row_products_readable()
            yield (block, *both_steps(model, block, rope))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_step_computes_what_the_layer_computes(tiny_checkpoint, dtype):
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype=dtype).model
    with torch.inference_mode():
        for block, want, got in each_layer_both_ways(model):
            assert block.rows_wqkv_scale is None and block.rows_w2.data_ptr() == block.feed_forward.w2.weight.data_ptr()
            for a, b in zip(want, got):
                assert torch.equal(a, b)


def test_a_row_step_reads_torchao_int8_data(tiny_checkpoint):
    pytest.importorskip("torchao")
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="bfloat16")
    engine.quantize_int8()
    with torch.inference_mode():
        for block, want, got in each_layer_both_ways(engine.model):
            assert block.rows_wqkv.dtype == torch.int8 and block.rows_wqkv_scale.shape == (block.rows_wqkv.shape[0],)
            for a, b in zip(want, got):  # torchao's dequantized bf16 product against int8 times scale in float32
                assert (a.float() - b.float()).abs().max() <= 0.03 * a.float().abs().max()


def test_a_row_step_of_an_adapted_model_adds_the_rows_adapter(tiny_checkpoint):
    """With adapters, a one-row step stays on the row products (over the base weights) and each
    adapted product gets the row's adapter part from the same normed or gated input: what the
    adapted layer computes, up to where the residual is added; the heads too. A row without
    an adapter (slot 0) computes the plain layer's step exactly."""
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    slots = AdapterSlots(model, 2, 8)
    slots.load(2, random_adapter(model.config, "alto", rank=8, seed=3, scale=0.05))
    with torch.inference_mode():
        for slot in (2, 0):
            slots.set_rows(torch.tensor([slot]))
            for block, want, got in each_layer_both_ways(model):
                assert isinstance(block.attention.wqkv, LoraLinear) and block.rows_wqkv.data_ptr() == \
                    block.attention.wqkv.base.weight.data_ptr()
                for a, b in zip(want, got):
                    if slot:
                        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                    else:
                        assert torch.equal(a, b)
        install(model, SEQUENTIAL, rows=True)
        slots.set_rows(torch.tensor([2]))
        x = torch.randn(1, model.norm.weight.shape[0], generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(model.head_logits(x), model.head(model.norm(x)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.fast_logits(x), model.fast_output(model.fast_norm(x)), rtol=1e-5, atol=1e-5)
        assert model.head.delta(model.norm(x)).abs().max() > 0  # the adapter does change the logits


def test_a_projection_with_a_bias_is_not_for_the_kernels():
    assert row_products.readable(torch.nn.Linear(8, 4, bias=False))
    assert not row_products.readable(torch.nn.Linear(8, 4, bias=True))


def test_rows_are_used_only_where_the_kernels_run(tiny_checkpoint):
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    assert not model.uses_row_products()  # the CPU: the compiled halves stay inductor's


def quantized(w):
    scale = w.float().abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def product_inputs(n: int, k: int, prologue: int, residual: bool, int8: bool, g: torch.Generator) -> tuple:
    """`row_product`'s arguments for a random [n, k] product on the GPU (bf16, or int8 with scales)."""
    width = 2 * k if prologue == row_products.SWIGLU else k
    x = (torch.randn(1, 1, width, generator=g) * 3).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.03).to("cuda", torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to("cuda", torch.bfloat16) if prologue == row_products.NORM else None
    res = torch.randn(1, 1, n, generator=g).to("cuda", torch.bfloat16) if residual else None
    w, scale = quantized(w) if int8 else (w, None)
    return x, w, scale, norm, res, prologue, 1e-6


@needs_gpu
@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (2048, 1024), (100, 96)])
@pytest.mark.parametrize("prologue, residual", [(row_products.PLAIN, True), (row_products.NORM, False),
                                                (row_products.SWIGLU, True)])
@pytest.mark.parametrize("int8", [False, True])
def test_kernel_matches_its_torch_arithmetic(n, k, prologue, residual, int8):
    args = product_inputs(n, k, prologue, residual, int8, torch.Generator().manual_seed(n + k))
    got, want = row_products.row_product(*args).float(), row_products.reference(*args).float()
    # float32 sums in another order, each rounded to bf16 once: a unit in the last place at most
    assert got.shape == (1, 1, n)
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


def test_an_adapted_product_launches_the_config_measured_for_it():
    """bf16 weights with an adapter launch the table's config (measured at rank 8: the adapter's
    constraint leaves each as it is), larger programs than without one where that measured
    faster; a larger rank takes fewer inputs a block, so A's block still fits; INT8 keeps the
    configs without an adapter."""
    for (n, k), config in row_products.ADAPTER_CONFIGS.items():
        parts = 2 if n == 6144 else 1  # w13: w1's and w3's halves
        assert row_products.launch_config(n, k, False, lora=(8, parts)) == config
        assert (n // parts) % config[0] == 0
        block_n, block_k, _ = row_products.launch_config(n, k, False, lora=(64, parts))
        assert block_n == config[0] and block_k * 64 <= lora_products.BLOCK_A
        plain = row_products.launch_config(n, k, True)
        assert row_products.launch_config(n, k, True, lora=(8, parts)) == row_products.with_adapter(plain, n, 8, parts)
    assert row_products.ADAPTER_CONFIGS[(6144, 1024)][0] > row_products.LAUNCH_CONFIGS[(6144, 1024, False)][0]


def _adapter_weights(n: int, k: int, rank: int, parts: int, g: torch.Generator, slots: int = 3):
    """lora_a [slots + 1, parts·rank, k], lora_b [slots + 1, n, rank] on the GPU in bf16, slot 0 zeros."""
    a = torch.randn(slots + 1, parts * rank, k, generator=g) * 0.05
    b = torch.randn(slots + 1, n, rank, generator=g) * 0.05
    a[0], b[0] = 0, 0
    return a.to("cuda", torch.bfloat16), b.to("cuda", torch.bfloat16)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n, k, prologue, residual, parts", [
    (6144, 1024, row_products.NORM, False, 2), (4096, 1024, row_products.NORM, False, 1),
    (1024, 3072, row_products.SWIGLU, True, 1), (1024, 2048, row_products.PLAIN, True, 1), (100, 96, row_products.NORM, False, 2)])
@pytest.mark.parametrize("rank", [4, 8, 16, 64])
@pytest.mark.parametrize("int8", [False, True])
def test_a_product_with_an_adapter_matches_its_torch_arithmetic(n, k, prologue, residual, parts, rank, int8):
    """The adapter's part summed in the product's kernel against the product, then
    `lora_delta`'s torch arithmetic; slot 0 gives the product without it (to its rounding: a
    large rank makes the kernel take fewer inputs a block, so its sums run in another order)."""
    g = torch.Generator().manual_seed(n + k + rank)
    args = product_inputs(n, k, prologue, residual, int8, g)
    a, b = _adapter_weights(n, k, rank, parts, g)
    for slot in (2, 0):
        lora = dict(lora_a=a, lora_b=b, lora_ids=torch.tensor([slot, 1], device="cuda"), parts=parts)
        got = row_products.row_product(*args, **lora).float()
        want = row_products.reference(*args, **lora).float()
        assert (got - want).abs().max() <= 2 ** -5 * want.abs().max() + 2e-3  # a rounding more than the product
        if slot == 0:
            plain = row_products.row_product(*args).float()
            assert (got - plain).abs().max() <= 2 ** -7 * plain.abs().max()
        else:
            assert (want - row_products.reference(*args).float()).abs().max() > 1e-2  # the adapter's part is there


@needs_gpu
@pytest.mark.parametrize("int8", [False, True])
def test_prefetching_the_next_weights_changes_nothing(int8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 3072, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(1024, 3072, generator=g) * 0.03).to("cuda", torch.bfloat16)
    w, scale = quantized(w) if int8 else (w, None)
    res = torch.randn(1, 1, 1024, generator=g).to("cuda", torch.bfloat16)
    ahead = torch.zeros(6144, 1008, device="cuda", dtype=w.dtype)
    args = (x, w, scale, None, res, row_products.PLAIN, 0.0)
    assert torch.equal(row_products.row_product(*args, ahead), row_products.row_product(*args))


if row_products.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _both_conversions(w_ptr, permuted_ptr, converted_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        w = tl.load(w_ptr + i)
        tl.store(permuted_ptr + i, row_products._as_float(w, True))
        tl.store(converted_ptr + i, w.to(tl.float32))


@needs_gpu
def test_int8_weights_through_the_mantissa_are_exact():
    """Every int8 value at each of the four places of a packed word, turned into floats by byte
    permutes (`_as_float`): the same floats as the conversion instruction's, bit for bit."""
    w = ((torch.arange(1024)[:, None] + torch.arange(4)[None, :]) % 256 - 128).to(torch.int8).flatten().cuda()
    permuted, converted = (torch.empty(w.numel(), device="cuda") for _ in range(2))
    _both_conversions[(1,)](w, permuted, converted, N=w.numel())
    assert torch.equal(permuted, converted) and torch.equal(converted, w.float())


def test_bulk_prefetch_takes_aligned_sizes_in_whole_shares():
    if not torch.cuda.is_available():
        assert not row_products._bulk_prefetchable(torch.zeros(4096, dtype=torch.int8), 8)
        return
    big = torch.zeros(4096, dtype=torch.int8, device="cuda")
    assert row_products._bulk_prefetchable(big, 8) == (torch.cuda.get_device_capability()[0] >= 9)
    assert not row_products._bulk_prefetchable(big[1:], 8)  # unaligned
    assert not row_products._bulk_prefetchable(big[:24], 1)  # not a multiple of 16
    assert not row_products._bulk_prefetchable(big[:64], 8)  # shares under 16 bytes


def test_each_product_is_told_the_weights_of_the_next(tiny_checkpoint):
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    install(model, SEQUENTIAL, rows=True)
    model.chain_row_weights(1)
    first, last = model.layers[0], model.layers[-1]
    assert first.rows_ahead["wqkv"] is first.rows_wo and first.rows_ahead["w2"] is model.layers[1].rows_wqkv
    assert last.rows_ahead["w2"] is model.rows_head and model.rows_ahead["head"] is model.fast_layers[0].rows_wqkv
    assert model.fast_layers[-1].rows_ahead["w2"] is model.rows_fast_head
    assert model.rows_ahead["fast_head"] is model.fast_layers[0].rows_wqkv  # the next fast step
    model.chain_row_weights(0)
    assert first.rows_ahead == {} and model.rows_ahead == {}


@needs_gpu
def test_kernels_replay_in_a_cuda_graph():
    x = torch.randn(1, 1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
    norm = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    want = row_products.row_product(x, w, None, norm, None, row_products.NORM, 1e-6)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = row_products.row_product(x, w, None, norm, None, row_products.NORM, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@needs_gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, qk_norm, slots, pos", [
    (16, 8, 128, True, 2048, 1099),  # S1-mini's slow layers: several pieces and their combine
    (16, 8, 128, True, 256, 0),  # the first position
    (16, 8, 128, True, 2048, 64),  # the new position first in its piece: no cached slots there
    (16, 8, 128, True, 2048, 33),  # the new position in its piece's second block
    (16, 8, 64, False, 10, 6),  # the fast layers: one piece
])
def test_attention_from_the_projection_matches_the_model(heads, kv_heads, head_dim, qk_norm, slots, pos):
    """QK-norm, RoPE, the cache write and attention in one kernel (and the combine), against
    the model's torch: `Attention.heads`, the cache write, SDPA over the live slots."""
    from fish_sm.model.dual_ar import Attention, KVCache
    from fish_sm.model.layers import rope_table

    torch.manual_seed(0)
    a = Attention(1024, heads, kv_heads, head_dim, False, False, qk_norm, 1e-6).to("cuda", torch.bfloat16)
    if qk_norm:
        a.q_norm.weight.data, a.k_norm.weight.data = (1 + 0.1 * torch.randn(2, head_dim, device="cuda")).bfloat16()
    qkv = torch.randn(1, 1, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16) * 2
    rope = rope_table(slots, head_dim, 1e6).cuda()[pos : pos + 1]
    at = torch.tensor([pos], device="cuda")
    caches = [KVCache(2, slots, kv_heads, head_dim, torch.bfloat16, "cuda") for _ in range(2)]
    earlier = torch.randn(2, kv_heads, pos, head_dim, device="cuda").bfloat16()
    for c in caches:
        c.k[0, :, :pos], c.v[0, :, :pos] = earlier
    q, k, v = a.heads(qkv, rope)
    a.kv_cache = caches[0]
    want = a.attend(q, k, v, at, pos + 1, None).float()
    norms = (a.q_norm.weight, a.k_norm.weight) if qk_norm else (None, None)
    got = decode_attention.attend_new_token(qkv, heads, kv_heads, *norms, 1e-6, rope, caches[1].k, caches[1].v, at, slots)
    assert got.shape == want.shape
    assert (got.float() - want).abs().max() <= 0.01 * want.abs().max()
    for x, y in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert (x.float() - y.float()).abs().max() <= 2 ** -7 * x.float().abs().max()
        assert y[:, :, pos + 1:].abs().sum() == 0 and y[1].abs().sum() == 0  # nothing else written
    # The batching engine's one-row steps name their cache row: row 1 gets what row 0 got.
    for c in caches[1:]:
        c.k[1], c.v[1] = c.k[0].clone(), c.v[0].clone()
        c.k[1, :, pos], c.v[1, :, pos] = 0, 0
    row = torch.tensor([1], device="cuda")
    again = decode_attention.attend_new_token(qkv, heads, kv_heads, *norms, 1e-6, rope, caches[1].k, caches[1].v, at,
                                              slots, row=row)
    assert torch.equal(again, got)
    assert torch.equal(caches[1].k[1], caches[1].k[0]) and torch.equal(caches[1].v[1], caches[1].v[0])


@needs_gpu
def test_a_row_step_on_the_kernels_matches_torch():
    """A whole S1-mini-shaped slow layer's decode step: kernels against the torch arithmetic."""
    from fish_sm.model.dual_ar import KVCache
    from fish_sm.model.layers import rope_table

    torch.manual_seed(0)
    block = TransformerBlock(1024, 16, 8, 128, 3072, False, False, True, 1e-6).to("cuda", torch.bfloat16)
    for p in block.parameters():
        p.data = p.data.normal_(0, 0.03) + (1 if p.dim() == 1 else 0)
    block.attention.kv_cache = KVCache(1, 2048, 8, 128, torch.bfloat16, "cuda")
    block = KernelBlock(block, rows=True)
    cache = block.attention.kv_cache
    cache.k[0, :, :1000].normal_(), cache.v[0, :, :1000].normal_()
    x = torch.randn(1, 1, 1024, device="cuda", dtype=torch.bfloat16)
    rope, pos = rope_table(2048, 128, 1e6).cuda()[1000:1001], torch.tensor([1000], device="cuda")
    got = block._decode_row(x, rope, pos, 1024, None)
    k_got = cache.k[0, :, 1000].clone()
    want = block(x, rope, pos, 1001)  # the eager layer (exact live length, SDPA)
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    assert (k_got.float() - cache.k[0, :, 1000].float()).abs().max() <= 2 ** -7 * k_got.float().abs().max()

"""The decode-attention kernel against SDPA with the mask the decode step builds (GPU only:
the kernel is Triton's, and CPU builds of torch have no Triton)."""
import pytest
import torch
import torch.nn.functional as F

from fish_sm.kernels import decode_attention

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and decode_attention.triton is not None),
                               reason="needs CUDA and Triton")


def sdpa(q, k, v, input_pos):
    """What `Attention.over` computes for a decode step with forward_slow's mask."""
    bsz, live = q.shape[0], k.shape[2]
    pos = input_pos.reshape(-1).expand(bsz) if input_pos.numel() == 1 else input_pos.reshape(-1)
    visible = torch.arange(live, device=q.device)[None, :] <= pos[:, None]
    y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible[:, None, None], enable_gqa=True)
    return y.transpose(1, 2).reshape(bsz, 1, -1)


@needs_gpu
@pytest.mark.parametrize("bsz, heads, kv_heads, head_dim, live, slots", [
    (1, 16, 8, 128, 1280, 8192),  # S1-mini's slow layers, one row, a bucket of an 8,192-slot cache
    (1, 16, 8, 128, 256, 2048),
    (32, 16, 8, 128, 512, 2048),  # the batching engine
    (1, 16, 8, 64, 7, 10),  # the fast layers' shapes
    (3, 4, 4, 32, 100, 128),  # no GQA, a small head
])
def test_decode_attention_matches_sdpa(bsz, heads, kv_heads, head_dim, live, slots):
    g = torch.Generator("cuda").manual_seed(live)
    cache = [torch.randn(bsz + 2, kv_heads, slots, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
             for _ in range(2)]
    k, v = (c[:bsz, :, :live] for c in cache)  # views of a cache, as KVCache.read gives them
    q = torch.randn(bsz, 1, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    assert decode_attention.usable(q, k, v)
    for input_pos in (torch.tensor([live - 1], device="cuda"),  # one row, or rows sharing a position
                      torch.randint(0, live, (bsz, 1), device="cuda", generator=g)):  # each row its own
        got = decode_attention.decode_attention(q, k, v, input_pos)
        want = sdpa(q, k, v, input_pos)
        assert got.shape == (bsz, 1, heads * head_dim) and got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max().item() < 2e-2


def test_decode_attention_is_not_used_without_triton_on_cuda():
    q = torch.zeros(1, 16, 1, 128, dtype=torch.bfloat16)
    assert not decode_attention.usable(q, q, q)  # CPU: SDPA computes the same sum


@needs_gpu
def test_decode_attention_reads_the_cache_rows_it_is_given():
    """The batching engine's steps name their sequences' cache rows: any rows, in any order,
    one repeated (padding), give what the same rows gathered first give."""
    g = torch.Generator("cuda").manual_seed(0)
    cache = [torch.randn(9, 8, 512, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]
    rows = torch.tensor([7, 2, 5, 8, 8], device="cuda")
    q = torch.randn(5, 16, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    input_pos = torch.tensor([[300], [17], [511], [0], [0]], device="cuda")
    got = decode_attention.decode_attention(q, cache[0][:, :, :512], cache[1][:, :, :512], input_pos, rows=rows)
    want = decode_attention.decode_attention(q, cache[0][rows], cache[1][rows], input_pos)
    assert torch.equal(got, want)


@needs_gpu
@pytest.mark.parametrize("bsz", [1, 64, 512])
def test_a_fast_layer_s_unmasked_token_takes_the_kernel(bsz):
    """A batched step's fast layers attend one new token over their first live codebook
    positions without a mask: `KernelAttention.over` gives it to the kernel, with SDPA's result."""
    from fish_sm.kernels.modules import KernelAttention
    from fish_sm.model.dual_ar import Attention

    attention = KernelAttention(Attention(1024, 16, 8, 64, False, False, False, 1e-6))
    g = torch.Generator("cuda").manual_seed(bsz)
    for live in (1, 2, 10):
        q = torch.randn(bsz, 1, 16, 64, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
        cache = [torch.randn(bsz, 8, 10, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]
        k, v = (c[:, :, :live] for c in cache)
        input_pos = torch.tensor([live - 1], device="cuda")
        got = attention.over(q, k, v, input_pos, live, None)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        assert got.shape == (bsz, 1, 16 * 64)
        assert (got.float() - want.transpose(1, 2).reshape(bsz, 1, -1)).abs().max().item() < 2e-2

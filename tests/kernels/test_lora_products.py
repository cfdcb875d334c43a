"""The adapters' shrink and expand (`fish_sm.kernels.lora_products`): their torch path against the
plain per-row definition on the CPU, exactly in float32; on a GPU, the Triton kernels against
that path for the ranks served and mixed batches, and replayed from a CUDA graph with a new
mix of slots."""
import pytest
import torch

from fish_sm.kernels import lora_products
from fish_sm.kernels.lora_products import lora_expand, lora_shrink

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and lora_products.triton is not None),
                               reason="needs CUDA and Triton")

# Slot mixes of seven rows: slot 0 (no adapter) among them, slots repeated, one row each.
MIXES = ([0, 3, 3, 1, 0, 5, 2], [4, 4, 4, 4, 4, 4, 4], [0, 0, 0, 0, 0, 0, 0])


def _weights(slots: int, rank: int, parts: int, width: int, out: int, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots + 1, parts * rank, width, generator=g)
    b = torch.randn(slots + 1, out, rank, generator=g)
    a[0], b[0] = 0, 0  # slot 0 holds zeros, as `AdapterSlots` keeps it
    return a.to(device, dtype), b.to(device, dtype)


def _per_row(x, a, b, ids, per_id, parts):
    """Each row on its own: v = x·A[slot]ᵀ, then each half of the outputs from its R numbers of v."""
    rank = b.shape[-1]
    out = []
    for n in range(x.shape[0]):
        slot = int(ids[n // per_id])
        v = (a[slot].float() @ x[n].float()).view(parts, rank)
        w = b[slot].float().view(parts, -1, rank)
        out.append(torch.cat([w[k] @ v[k] for k in range(parts)]))
    return torch.stack(out)


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("per_id", [1, 3])
@pytest.mark.parametrize("mix", MIXES)
def test_the_torch_path_is_the_per_row_definition(mix, per_id, parts):
    ids = torch.tensor(mix)
    a, b = _weights(5, 8, parts, 200, 2 * 150)
    x = torch.randn(len(mix) * per_id, 200, generator=torch.Generator().manual_seed(1))
    v = lora_shrink(x, a, ids, per_id)
    assert v.dtype == torch.float32 and v.shape == (x.shape[0], parts * 8)
    y = lora_expand(v, b, ids, per_id, parts)
    torch.testing.assert_close(y, _per_row(x, a, b, ids, per_id, parts), rtol=1e-5, atol=1e-5)
    rows_without = torch.tensor(mix).repeat_interleave(per_id) == 0
    assert not y[rows_without].any()


def test_no_rows_give_an_empty_product():
    a, b = _weights(2, 4, 1, 16, 8)
    v = lora_shrink(torch.zeros(0, 16), a, torch.zeros(0, dtype=torch.long), 1)
    assert v.shape == (0, 4) and lora_expand(v, b, torch.zeros(0, dtype=torch.long), 1, 1).shape == (0, 8)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rank", [4, 8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_give_the_torch_paths_products_on_cuda(rank, dtype):
    for parts in (1, 2):
        for per_id in (1, 5):
            for mix in MIXES:
                ids = torch.tensor(mix, device="cuda")
                a, b = _weights(6, rank, parts, 1024, 2 * 1536, dtype, "cuda", seed=rank)
                x = torch.randn(len(mix) * per_id, 1024, device="cuda").to(dtype)
                v = lora_products.launch_shrink(x, a, ids, per_id)
                v_ref = torch.einsum("ni,nri->nr", x.float(), a[ids.repeat_interleave(per_id)].float())
                torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-3)
                y = lora_products.launch_expand(v_ref, b, ids, per_id, parts)
                w = b[ids.repeat_interleave(per_id)].float().view(len(x), parts, -1, rank)
                y_ref = torch.einsum("nkr,nkor->nko", v_ref.view(len(x), parts, rank), w).reshape(len(x), -1).to(dtype)
                tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-1}
                torch.testing.assert_close(y, y_ref, **tol)


@needs_gpu
@pytest.mark.gpu
def test_a_graph_of_the_kernels_replays_a_new_mix_of_slots_bit_for_bit():
    """One captured graph serves any mix of adapters: the slots are an input it reads."""
    a, b = _weights(6, 8, 2, 1024, 2 * 1536, torch.bfloat16, "cuda")
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([1, 0, 2, 2, 0, 6, 5, 3], device="cuda")
    lora_expand(lora_shrink(x, a, ids, 1), b, ids, 1, 2)  # (Triton compiles outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_expand(lora_shrink(x, a, ids, 1), b, ids, 1, 2)
    ids.copy_(torch.tensor([0, 4, 4, 1, 0, 0, 6, 2], device="cuda"))
    graph.replay()
    assert torch.equal(y, lora_expand(lora_shrink(x, a, ids, 1), b, ids, 1, 2))
    assert not y[ids == 0].any()

"""The adapters' products (`fish_sm.kernels.lora_products`: the shrink and expand as one kernel,
and an embedding's lookup): their torch path against the plain per-row definition on the CPU, exactly
in float32; on a GPU, the Triton kernels against that path for the ranks served and mixed
batches, and replayed from a CUDA graph with a new mix of slots."""
import pytest
import torch

from fish_sm.kernels import lora_products
from fish_sm.kernels.lora_products import expand_reference, lora_delta, lora_lookup, shrink_reference

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
    v = shrink_reference(x, a, ids, per_id)
    assert v.dtype == torch.float32 and v.shape == (x.shape[0], parts * 8)
    want = _per_row(x, a, b, ids, per_id, parts)
    for y in (expand_reference(v, b, ids, per_id, parts), lora_delta(x, a, b, ids, per_id, parts)):
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        rows_without = torch.tensor(mix).repeat_interleave(per_id) == 0
        assert not y[rows_without].any()


def _per_lookup(index, a_t, b, ids, per_id):
    """Each row on its own: its slot's B against A's column for its index."""
    return torch.stack([b[int(ids[n // per_id])].float() @ a_t[int(ids[n // per_id]), int(index[n])].float()
                        for n in range(index.shape[0])])


@pytest.mark.parametrize("per_id", [1, 3])
@pytest.mark.parametrize("mix", MIXES)
def test_a_lookups_torch_path_is_the_per_row_definition(mix, per_id):
    ids = torch.tensor(mix)
    a, b = _weights(5, 8, 1, 40, 64)
    a_t = a.transpose(1, 2).contiguous()  # [slots, num, r], as `LoraEmbedding` keeps A
    index = torch.randint(0, 40, (len(mix) * per_id,), generator=torch.Generator().manual_seed(2))
    y = lora_lookup(index, a_t, b, ids, per_id)
    torch.testing.assert_close(y, _per_lookup(index, a_t, b, ids, per_id), rtol=1e-5, atol=1e-5)
    assert not y[torch.tensor(mix).repeat_interleave(per_id) == 0].any()


def test_no_rows_give_an_empty_product():
    a, b = _weights(2, 4, 1, 16, 8)
    none = torch.zeros(0, dtype=torch.long)
    assert lora_delta(torch.zeros(0, 16), a, b, none, 1, 1).shape == (0, 8)
    assert lora_lookup(torch.zeros(0, dtype=torch.long), a.transpose(1, 2), b, none, 1).shape == (0, 8)


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
                v_ref = shrink_reference(x, a, ids, per_id)
                y_ref = expand_reference(v_ref, b, ids, per_id, parts)
                tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-1}
                torch.testing.assert_close(lora_products.launch_delta(x, a, b, ids, per_id, parts), y_ref, **tol)
                if parts == 1:
                    a_t = a.transpose(1, 2).contiguous()
                    index = torch.randint(0, 1024, (len(mix) * per_id,), device="cuda")
                    want = expand_reference(a_t[ids.repeat_interleave(per_id), index].float(), b, ids, per_id, 1)
                    torch.testing.assert_close(lora_products.launch_lookup(index, a_t, b, ids, per_id), want, **tol)


@needs_gpu
@pytest.mark.gpu
def test_a_graph_of_the_kernels_replays_a_new_mix_of_slots_bit_for_bit():
    """One captured graph serves any mix of adapters: the slots are an input it reads."""
    a, b = _weights(6, 8, 2, 1024, 2 * 1536, torch.bfloat16, "cuda")
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([1, 0, 2, 2, 0, 6, 5, 3], device="cuda")
    lora_delta(x, a, b, ids, 1, 2)  # (Triton compiles outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_delta(x, a, b, ids, 1, 2)
    ids.copy_(torch.tensor([0, 4, 4, 1, 0, 0, 6, 2], device="cuda"))
    graph.replay()
    assert torch.equal(y, lora_delta(x, a, b, ids, 1, 2))
    assert not y[ids == 0].any()


@pytest.mark.parametrize("with_res", [False, True])
def test_a_product_and_its_delta_are_the_product_and_lora_delta(with_res):
    """`product_and_delta`: the model's product (with a residual: as `split_product` makes it)
    and `lora_delta`'s part, per row's slot, for x of [B, S, in]."""
    from fish_sm.kernels.lora_products import product_and_delta

    g = torch.Generator().manual_seed(3)
    a, b = _weights(5, 8, 2, 64, 2 * 48)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(4, 3, 64, generator=g)
    ids = torch.tensor([2, 0, 5, 2])
    res = torch.randn(4, 3, 96, generator=g) if with_res else None
    y, delta = product_and_delta(x, w, a, b, ids, 3, 2, res=res, counts=torch.zeros(8, dtype=torch.int32))
    want = torch.nn.functional.linear(x, w) if res is None else res + torch.nn.functional.linear(x, w)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(delta, lora_delta(x.reshape(-1, 64), a, b, ids, 3, 2).view(4, 3, 96), rtol=0, atol=0)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 256])
def test_a_product_beside_its_delta_is_the_two_one_after_the_other_and_replays_bit_for_bit(rows):
    """On CUDA the delta's kernel runs on a side stream beside the product: the same values as
    the product then `lora_delta`, eagerly and replayed from a graph with a new mix of slots."""
    from fish_sm.kernels import split_products
    from fish_sm.kernels.lora_products import product_and_delta

    a, b = _weights(6, 8, 1, 2048, 1024, torch.bfloat16, "cuda")
    w = (torch.randn(1024, 2048, device="cuda") * 0.03).to(torch.bfloat16)
    x = torch.randn(rows, 1, 2048, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(rows, 1, 1024, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(split_products.COUNTERS, dtype=torch.int32, device="cuda")
    ids = (torch.arange(rows, device="cuda") % 7)

    def both():
        return [product_and_delta(x, w, a, b, ids, 1, 1), product_and_delta(x, w, a, b, ids, 1, 1, res=res, counts=counts)]

    def one_after_the_other():
        delta = lora_delta(x.view(rows, -1), a, b, ids, 1, 1).view(rows, 1, -1)
        return [(torch.nn.functional.linear(x, w), delta), (split_products.split_product(x, w, res, counts), delta)]

    for got, want in zip(both(), one_after_the_other()):
        for g, e in zip(got, want):
            assert torch.equal(g, e)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = both()
    ids.copy_(torch.arange(rows, device="cuda").flip(0) % 5)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, one_after_the_other()):
        for g, e in zip(got, want):
            assert torch.equal(g, e)


def test_compiled_code_calls_the_product_and_its_delta_as_one_op():
    """`product_and_delta` inside compiled layers (its fake implementation gives inductor the
    shapes, for any batch): the same values as called eagerly."""
    from fish_sm.kernels.lora_products import product_and_delta

    a, b = _weights(3, 4, 1, 32, 24)
    w = torch.randn(24, 32, generator=torch.Generator().manual_seed(4))

    def layer(x, ids, res):
        y, delta = product_and_delta(x, w, a, b, ids, x.shape[1], 1, res=res, counts=torch.zeros(8, dtype=torch.int32))
        return torch.relu(y + delta)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for batch in (2, 5):
        x = torch.randn(batch, 3, 32, generator=torch.Generator().manual_seed(batch))
        res = torch.randn(batch, 3, 24, generator=torch.Generator().manual_seed(10 + batch))
        ids = torch.arange(batch) % 4
        torch.testing.assert_close(compiled(x, ids, res), layer(x, ids, res), rtol=1e-5, atol=1e-5)

"""The split products of several-row steps (`fish_sm.kernels.split_products`): on the CPU, the
layer half built on them against the model's own half, eagerly and compiled; on a GPU, the
kernel against the model's arithmetic, again and again (its tile counters back at zero), and
replayed from a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from fish_sm.engine import Engine
from fish_sm.kernels import SEQUENTIAL, install, split_products
from fish_sm.kernels.modules import KernelBlock
from fish_sm.model.dual_ar import TransformerBlock

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and split_products.triton is not None),
                               reason="needs CUDA and Triton")


def test_the_split_half_is_the_models_half(tiny_checkpoint):
    """Every slow and fast layer's `_post_attention_split` gives `_post_attention`'s output,
    exactly (float32 on the CPU: the same torch arithmetic), for one position and for two."""
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    g = torch.Generator().manual_seed(0)
    for block in [*model.layers, *model.fast_layers]:
        block = KernelBlock(block, split=True)
        assert block.split_products_readable()
        dim, width = block.attention_norm.weight.shape[0], block.attention.wo.weight.shape[1]
        for positions in (1, 2):
            x, y = torch.randn(3, positions, dim, generator=g), torch.randn(3, positions, width, generator=g)
            assert torch.equal(block._post_attention_split(x, y), block._post_attention(x, y))
        assert not block.split_counts.any()


def test_compiled_steps_of_several_rows_run_the_split_half(tiny_checkpoint):
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    install(model, SEQUENTIAL)
    block = model.layers[0]
    assert block.compiled[1][1]._torchdynamo_orig_callable is KernelBlock._post_attention_split
    dim = block.attention_norm.weight.shape[0]
    x, y = torch.randn(4, 1, dim), torch.randn(4, 1, block.attention.wo.weight.shape[1])
    with torch.inference_mode():  # as the engine runs its steps
        torch.testing.assert_close(block.compiled[1][1](block, x, y), block._post_attention(x, y))


def test_int8_weights_keep_the_models_half(tiny_checkpoint):
    pytest.importorskip("torchao")
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    engine.quantize_int8()
    install(engine.model, SEQUENTIAL)
    assert engine.model.layers[0].compiled[1][1]._torchdynamo_orig_callable is TransformerBlock._post_attention


@needs_gpu
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (1024, 1024)])
def test_the_kernel_against_the_models_arithmetic(n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
    counts = torch.zeros(split_products.COUNTERS, dtype=torch.int32, device="cuda")
    most = split_products.MOST_SPLIT_ROWS
    for rows, positions in ((1, 1), (2, 1), (32, 1), (32, 2), (most // 2, 2), (most + 1, 1), (most, 2)):
        for _ in range(3):  # again: each call leaves the counters as it found them
            x = torch.randn(rows, positions, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(rows, positions, n, device="cuda", dtype=torch.bfloat16)
            got = split_products.split_product(x, w, res, counts)
            want = res + F.linear(x, w)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            # Sums in another order: within a bf16 rounding of the result.
            torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
            assert not counts.any()
        # Beyond the most rows the kernel takes, cuBLAS's product: the model's arithmetic itself.
        assert split_products._splits(x, w) == (rows * positions <= most)
        if rows * positions > most:
            assert torch.equal(got, want)


@needs_gpu
def test_the_kernel_replays_from_a_cuda_graph():
    torch.manual_seed(1)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.03
    counts = torch.zeros(split_products.COUNTERS, dtype=torch.int32, device="cuda")
    x = torch.randn(32, 1, 3072, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(32, 1, 1024, device="cuda", dtype=torch.bfloat16)
    split_products.split_product(x, w, res, counts)  # warm-up (compiles the kernel) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_products.split_product(x, w, res, counts)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        res.copy_(torch.randn(res.shape, device="cuda", generator=g))
        graph.replay()
        torch.testing.assert_close(out.float(), (res + F.linear(x, w)).float(), atol=0.05, rtol=0.02)
    assert not counts.any()

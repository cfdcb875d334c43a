"""The residual codes' sampling kernels (`fish_sm.engine.residual_sampling`): on a GPU against
the torch sampling they replace; on the CPU, `sample_frame`'s path for a picker that also
returns the next fast step's input."""
import pytest
import torch

from fish_sm.engine import Engine, residual_sampling
from fish_sm.engine.generate import Pickers, noise_size, pick, pick_residual, sample_frame
from fish_sm.engine.sampling import PENALTY_WINDOW, SamplingParams

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and residual_sampling.triton is not None),
                               reason="needs CUDA and Triton")


def test_a_picker_with_the_next_input_samples_the_same_frame(tiny_checkpoint):
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    model.setup_caches(1, 32)
    calls = []

    def with_input(model, hidden, noise, temperature, top_p, penalty, previous, next_input):
        calls.append(next_input)
        code = pick_residual(model, hidden, noise, temperature, top_p, penalty, previous, sort_free=True)
        return code, (model.fast_embeddings(code) if next_input else None)

    g = torch.Generator().manual_seed(0)
    c = model.config
    logits = torch.randn(1, c.semantic_vocab + 1, generator=g)
    hidden = torch.randn(1, c.fast_dim, generator=g)
    window = torch.randint(0, 100, (1, 1 + c.num_codebooks, PENALTY_WINDOW), generator=g)
    noise = torch.empty(1, noise_size(model)).exponential_(1, generator=g)
    t, p, r = (x.view(1, 1) for x in SamplingParams(seed=0).tensors("cpu"))
    plain = Pickers(residual=lambda *a: pick_residual(*a, sort_free=True))
    with torch.inference_mode():
        want = sample_frame(model, logits, hidden, window, noise, t, p, r, plain)
        got = sample_frame(model, logits, hidden, window, noise, t, p, r, plain._replace(residual_with_input=with_input))
    assert torch.equal(want, got)
    assert calls == [True] * (c.num_codebooks - 2) + [False]  # no lookup after the last code


@needs_gpu
def test_kernels_sample_what_the_torch_sampling_samples():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(4096, 1024, generator=g).to("cuda", torch.bfloat16)
    trials, agree = 300, 0
    for i in range(trials):
        scale = 0.5 + 3 * torch.rand(1, generator=g).item()
        logits = (torch.randn(1, 1024, generator=g) * scale).to("cuda", torch.bfloat16)
        noise = torch.empty(1, 1024).exponential_(1, generator=g).cuda()
        params = SamplingParams(temperature=0.1 + 0.9 * torch.rand(1, generator=g).item(),
                                top_p=0.1 + 0.9 * torch.rand(1, generator=g).item(),
                                repetition_penalty=0.9 + 1.1 * torch.rand(1, generator=g).item())
        t, p, r = (x.view(1, 1) for x in params.tensors("cuda"))
        previous = torch.randint(0, 1024, (1, PENALTY_WINDOW), generator=g).cuda() if i % 2 else None
        want = pick(logits, noise, t, p, r, previous, sort_free=True)
        code, row = residual_sampling.sample_residual(logits, noise, t, p, r, previous, table)
        agree += int(code.item() == want.item())
        assert torch.equal(row[0], table[code.item()])
    # sums in another order: a code on the nucleus' boundary may differ, rarely
    assert agree >= 0.98 * trials


@needs_gpu
def test_kernels_replay_in_a_cuda_graph():
    logits = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    noise = torch.empty(1, 1024, device="cuda").exponential_(1)
    table = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    t, p, r = (x.view(1, 1) for x in SamplingParams().tensors("cuda"))
    want, _ = residual_sampling.sample_residual(logits, noise, t, p, r, None, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        code, row = residual_sampling.sample_residual(logits, noise, t, p, r, None, table)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(code, want) and torch.equal(row[0], table[want.item()])

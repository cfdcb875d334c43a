"""The sampling kernels (`fish_sm.kernels.sampling`): on a GPU against the torch
sampling they replace; on the CPU, `sample_frame`'s path for pickers that also return the
next fast step's input."""
import numpy as np
import pytest
import torch

from fish_sm.engine import Engine
from fish_sm.engine.generate import Pickers, noise_size, pick, pick_residual, sample_frame
from fish_sm.engine.sampling import PENALTY_WINDOW, SamplingParams, head_penalty_indices, sampling_tensors
from fish_sm.kernels import sampling as sampling_kernels

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and sampling_kernels.triton is not None),
                               reason="needs CUDA and Triton")


def test_noise_keys_of_a_step_equal_each_request_s_own():
    """The batching engine's keys for a whole step (numpy, uint64 arithmetic) are, bit for bit,
    each request's `noise_key` (Python integers), over the seeds' whole range."""
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(0, 2**63, 500, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                            np.array([0, 1, 2**64 - 1], np.uint64)])
    draws = np.concatenate([rng.integers(0, 10**6, 500), [0, 2**31, 7]])
    keys = sampling_kernels.noise_keys(seeds, draws)
    assert keys.dtype == np.int64 and (keys >= 0).all()
    assert [int(k) for k in keys] == [sampling_kernels.noise_key(int(s), int(d)) for s, d in zip(seeds, draws)]


def test_pickers_with_the_next_input_sample_the_same_frame(tiny_checkpoint):
    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    model.setup_caches(1, 32)
    c = model.config
    calls = []

    def head_with_input(model, logits, noise, temperature, top_p, penalty, window):
        prev = head_penalty_indices(window[:, :, 0], model.semantic_begin_id, c.semantic_vocab, model.im_end_id)
        row = pick(logits, noise, temperature, top_p, penalty, prev)
        is_end = row == c.semantic_vocab
        code = torch.where(is_end, 0, row)
        return torch.where(is_end, model.im_end_id, row + model.semantic_begin_id), code, model.fast_embeddings(code)

    def residual_with_input(model, hidden, noise, temperature, top_p, penalty, previous, next_input):
        calls.append(next_input)
        code = pick_residual(model, hidden, noise, temperature, top_p, penalty, previous, sort_free=True)
        return code, (model.fast_embeddings(code) if next_input else None)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, c.semantic_vocab + 1, generator=g)
    hidden = torch.randn(1, c.fast_dim, generator=g)
    window = torch.randint(0, 100, (1, 1 + c.num_codebooks, PENALTY_WINDOW), generator=g)
    noise = torch.empty(1, noise_size(model)).exponential_(1, generator=g)
    t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
    plain = Pickers(residual=lambda *a: pick_residual(*a, sort_free=True))
    with torch.inference_mode():
        want = sample_frame(model, logits, hidden, window, noise, t, p, r, plain)
        got = sample_frame(model, logits, hidden, window, noise, t, p, r,
                           plain._replace(head_with_input=head_with_input, residual_with_input=residual_with_input))
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
        t, p, r = (x.view(1, 1) for x in sampling_tensors(params, "cuda"))
        previous = torch.randint(0, 1024, (1, PENALTY_WINDOW), generator=g).cuda() if i % 2 else None
        want = pick(logits, noise, t, p, r, previous, sort_free=True)
        code, row = sampling_kernels.sample_residual(logits, noise, t, p, r, previous, table)
        agree += int(code.item() == want.item())
        assert torch.equal(row[0], table[code.item()])
    # sums in another order: a code on the nucleus' boundary may differ, rarely
    assert agree >= 0.98 * trials


@needs_gpu
def test_kernels_replay_in_a_cuda_graph():
    logits = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    noise = torch.empty(1, 1024, device="cuda").exponential_(1)
    table = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(), "cuda"))
    want, _ = sampling_kernels.sample_residual(logits, noise, t, p, r, None, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        code, row = sampling_kernels.sample_residual(logits, noise, t, p, r, None, table)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(code, want) and torch.equal(row[0], table[want.item()])


@needs_gpu
def test_head_kernels_pick_what_the_torch_sampling_picks():
    g = torch.Generator().manual_seed(1)
    begin, im_end, n_semantic = 1000, 900, 4096
    table = torch.randn(4096, 1024, generator=g).to("cuda", torch.bfloat16)
    trials, agree = 200, 0
    for i in range(trials):
        logits = (torch.randn(1, n_semantic + 1, generator=g) * (0.5 + 3 * torch.rand(1, generator=g).item()))
        if i % 10 == 0:
            logits[0, -1] = 30.0  # <|im_end|>
        logits = logits.to("cuda", torch.bfloat16)
        noise = torch.empty(1, n_semantic + 1).exponential_(1, generator=g).cuda()
        t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(top_p=0.1 + 0.9 * torch.rand(1, generator=g).item(),
                                                         repetition_penalty=1.5), "cuda"))
        first = torch.randint(begin - 50, begin + n_semantic + 50, (1, 11), generator=g)
        first[0, 0] = im_end if i % 3 == 0 else first[0, 0]
        window = torch.zeros(1, 11, PENALTY_WINDOW, dtype=torch.long)
        window[:, :, 0] = first
        window = window.cuda() if i % 2 else None
        prev = None if window is None else head_penalty_indices(window[:, :, 0], begin, n_semantic, im_end)
        row = pick(logits, noise, t, p, r, prev)
        token, code, x = sampling_kernels.sample_head(logits, noise, t, p, r, None if window is None else window[:, :, 0],
                                                      begin, im_end, table)
        want_code = 0 if row.item() == n_semantic else row.item()
        want_token = im_end if row.item() == n_semantic else row.item() + begin
        agree += int(token.item() == want_token and code.item() == want_code)
        assert torch.equal(x[0], table[code.item()])
    assert agree >= 0.98 * trials


def _row_params(g, rows: int, top_p: float | None = None):
    """[rows, 1] temperature, top_p and penalty, each row's own (bf16-rounded as served)."""
    params = [SamplingParams(temperature=0.1 + 0.9 * torch.rand(1, generator=g).item(),
                             top_p=top_p or 0.1 + 0.9 * torch.rand(1, generator=g).item(),
                             repetition_penalty=0.9 + 1.1 * torch.rand(1, generator=g).item()) for _ in range(rows)]
    return [torch.stack([sampling_tensors(p, "cuda")[i] for p in params]).view(rows, 1) for i in range(3)]


@needs_gpu
@pytest.mark.parametrize("top_p", [None, 1.0])
def test_row_kernels_pick_what_the_torch_sampling_picks(top_p):
    """Several rows (the batching engine's picks): each row's own parameters and penalty ids,
    bf16 logits (so ties at the nucleus' edge are common), against the sorted torch nucleus."""
    g = torch.Generator().manual_seed(2)
    rows, begin, im_end, n_semantic = 32, 1000, 900, 4096
    table = torch.randn(4096, 1024, generator=g).to("cuda", torch.bfloat16)
    picks, agree = 0, 0
    for i in range(20):
        t, p, r = _row_params(g, rows, top_p)
        scale = (0.5 + 3 * torch.rand(rows, 1, generator=g))
        # a residual code
        logits = (torch.randn(rows, 1024, generator=g) * scale).to("cuda", torch.bfloat16)
        noise = torch.empty(rows, 1024).exponential_(1, generator=g).cuda()
        previous = torch.randint(0, 1024, (rows, PENALTY_WINDOW), generator=g).cuda() if i % 2 else None
        want = pick(logits, noise, t, p, r, previous)
        code, row = sampling_kernels.sample_residual(logits, noise, t, p, r, previous, table)
        assert torch.equal(row, table[code])
        agree, picks = agree + int((code == want).sum()), picks + rows
        # the slow head, penalty ids read from a window's first frame (a strided view)
        logits = (torch.randn(rows, n_semantic + 1, generator=g) * scale)
        logits[::7, -1] = 30.0  # <|im_end|>
        logits = logits.to("cuda", torch.bfloat16)
        noise = torch.empty(rows, n_semantic + 1).exponential_(1, generator=g).cuda()
        window = torch.randint(begin - 50, begin + n_semantic + 50, (rows, 11, PENALTY_WINDOW), generator=g)
        window[::3, 0, 0] = im_end
        window = window.cuda() if i % 2 else None
        prev = None if window is None else head_penalty_indices(window[:, :, 0], begin, n_semantic, im_end)
        want = pick(logits, noise, t, p, r, prev)
        token, code, x = sampling_kernels.sample_head(logits, noise, t, p, r, None if window is None else window[:, :, 0],
                                                      begin, im_end, table)
        is_end = want == n_semantic
        agree += int(((token == torch.where(is_end, im_end, want + begin)) & (code == torch.where(is_end, 0, want))).sum())
        picks += rows
        assert torch.equal(x, table[code])
    assert agree >= 0.98 * picks


@needs_gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_picks_add_each_row_s_adapter_to_the_embedding_as_the_lookup_kernel_and_the_wrapper_do(rows):
    """With a model's adapters (`EmbeddingAdapters`), the row a pick returns is the table's row
    plus `lora_lookup`'s part for the row's slot, added as the wrapper's `y + delta` adds it, bit
    for bit; slot 0 rows get the table's row; the codes are those picked without adapters."""
    from fish_sm.kernels.lora_products import launch_lookup

    g = torch.Generator().manual_seed(3)
    slots, rank, dim = 5, 8, 1024
    table = torch.randn(4096, dim, generator=g).to("cuda", torch.bfloat16)
    a_t = (torch.randn(slots + 1, 4096, rank, generator=g) * 0.5).to("cuda", torch.bfloat16)
    b = (torch.randn(slots + 1, dim, rank, generator=g) * 0.05).to("cuda", torch.bfloat16)
    a_t[0], b[0] = 0, 0
    ids = torch.tensor(([3] if rows == 1 else [0, 1, 1, 5, 2, 0, 4, 4] * 4), device="cuda")
    adapters = sampling_kernels.EmbeddingAdapters(a_t, b, ids)
    t, p, r = _row_params(g, rows)
    for n in (1024, 4097):  # a residual code's head, the slow head's
        logits = (torch.randn(rows, n, generator=g) * 2).to("cuda", torch.bfloat16)
        noise = torch.empty(rows, n).exponential_(1, generator=g).cuda()
        if n == 1024:
            code, x = sampling_kernels.sample_residual(logits, noise, t, p, r, None, table, adapters=adapters)
            plain, _ = sampling_kernels.sample_residual(logits, noise, t, p, r, None, table)
            last, none = sampling_kernels.sample_residual(logits, noise, t, p, r, None, table, False, adapters)
            assert none is None and torch.equal(last, code)
        else:
            _, code, x = sampling_kernels.sample_head(logits, noise, t, p, r, None, 1000, 900, table, adapters)
            _, plain, _ = sampling_kernels.sample_head(logits, noise, t, p, r, None, 1000, 900, table)
        assert torch.equal(code, plain)
        want = table[code] + launch_lookup(code, a_t, b, ids, 1)
        assert torch.equal(x, want)
        assert torch.equal(x[ids == 0], table[code][ids == 0])
        assert not torch.equal(x[ids != 0], table[code][ids != 0])


def test_noise_keys_depend_on_the_seed_and_the_draw_only():
    keys = {sampling_kernels.noise_key(seed, draw) for seed in (0, 1, 2**64 - 1, -1) for draw in range(50)}
    assert len(keys) == 150  # seed -1 is 2**64 - 1, as torch.Generator.manual_seed takes it
    assert all(0 <= k < 2**63 for k in keys)
    assert sampling_kernels.noise_key(7, 3) == sampling_kernels.noise_key(7, 3)


@needs_gpu
def test_keyed_noise_is_exponential_and_repeats_for_the_same_key():
    n = 13313
    keys = torch.tensor([sampling_kernels.noise_key(seed, draw) for seed in range(8) for draw in range(4)], device="cuda")
    out = sampling_kernels.exponential_noise(keys, torch.empty(32, n, device="cuda"))
    again = sampling_kernels.exponential_noise(keys.flip(0), torch.empty(32, n, device="cuda")).flip(0)
    assert torch.equal(out, again)  # a row's draws depend on its key alone, not on its place in the batch
    assert (out > 0).all() and torch.isfinite(out).all()
    x = out.double().flatten()
    assert abs(x.mean().item() - 1) < 0.01 and abs(x.var().item() - 1) < 0.02
    # Exp(1): P(E > t) = exp(-t); and rows are not copies of each other.
    for t in (0.1, 1.0, 3.0):
        assert abs((x > t).double().mean().item() - torch.exp(torch.tensor(-t)).item()) < 0.005
    assert torch.corrcoef(out[:4]).fill_diagonal_(0).abs().max() < 0.05

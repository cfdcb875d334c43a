"""The compiled decode step and INT8 weight-only quantization, on the CPU (float32).

On a GPU the same frame is captured as CUDA graphs; `benchmarks/engine.py` runs the
same comparison there (`fish_sm.engine.checks.compare_compiled_to_eager`) in bf16.
"""

import pytest
import torch

from fish_sm.engine import Engine
from fish_sm.engine.checks import SENTENCE, compare_compiled_to_eager, weight_bytes
from fish_sm.engine.prompt import build_prompt
from fish_sm.kernels import BATCHING, SEQUENTIAL, install


def test_compiled_step_follows_the_eager_one(tiny_checkpoint):
    """`decode_frame` compiled (bucketed, masked attention) against the eager step, frame by frame
    from the same states: the same codes, logits within float32 rounding."""
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
    report = compare_compiled_to_eager(engine, prompt, steps=6)
    assert report["max_abs_logit_diff"] < 1e-4 and report["code_agreement"] == 1.0


def test_int8_weight_only_quantization(tiny_checkpoint):
    pytest.importorskip("torchao")
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    before = weight_bytes(engine.model)
    reference = engine.synthesize("Quantized speech.", seed=2, max_new_tokens=6)
    engine.quantize_int8()
    assert engine.quantized and weight_bytes(engine.model) < before
    assert type(engine.model.embeddings).__name__ == "Int8Embedding" and engine.model.dtype == torch.float32
    # The fast head stays in the model's dtype (its INT8 product was a slow kernel at one row).
    assert type(engine.model.fast_output.weight) is torch.nn.Parameter
    result = engine.synthesize("Quantized speech.", seed=2, max_new_tokens=6)
    assert result.audio.shape == reference.audio.shape and result.frames == reference.frames


@pytest.mark.parametrize("batch, rows", [(1, False), (3, False), (1, True)])
def test_compiled_layers_write_the_cache_as_eager_ones_do(tiny_checkpoint, batch, rows):
    """The GPU's compiled per-layer halves (the first writes k/v into the cache) against
    the eager layers: same logits and the same cache after a few decode steps. `rows`: the
    one-row halves on `row_products` (here their torch arithmetic; the GPU runs the kernels)."""
    from fish_sm.engine.generate import decode_frame, noise_size
    from fish_sm.engine.sampling import PENALTY_WINDOW, SamplingParams, sampling_tensors

    engines = [Engine.from_pretrained(tiny_checkpoint, device="cpu") for _ in range(2)]
    install(engines[1].model, BATCHING if batch > 1 else SEQUENTIAL, rows=rows)
    rows = 1 + engines[0].config.num_codebooks
    t, p, r = (x.view(1, 1).expand(batch, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
    outs = []
    for engine in engines:
        model = engine.model
        model.setup_caches(batch, 64)
        g = torch.Generator().manual_seed(0)
        frame = torch.zeros(batch, rows, dtype=torch.long)
        frame[:, 0] = model.semantic_begin_id
        frames = []
        with torch.inference_mode():
            for i in range(4):
                pos = torch.arange(batch) + i if batch > 1 else torch.tensor([i])
                window = torch.zeros(batch, rows, PENALTY_WINDOW, dtype=torch.long)
                noise = torch.empty(batch, noise_size(model)).exponential_(1, generator=g)
                frame = decode_frame(model, frame, pos, window, noise, t, p, r, key_pos=model.positions[:16])
                frames.append(frame)
        outs.append((torch.stack(frames), model.layers[0].attention.kv_cache.k.clone(),
                     model.fast_layers[-1].attention.kv_cache.v.clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-5)
    assert torch.allclose(outs[0][2], outs[1][2], atol=1e-5)


def test_attention_buckets_cover_every_length():
    from fish_sm.engine.generate import attention_bucket, length_buckets

    for max_seq_len in (64, 2048, 3000, 8192):
        buckets = length_buckets(max_seq_len)
        for live in range(1, max_seq_len + 1):
            bucket = attention_bucket(max_seq_len, live)
            assert bucket in buckets and live <= bucket <= max_seq_len
            assert bucket - live < (256 if live <= 2048 else 512 if live <= 4096 else 1024)
    assert length_buckets(2048) == list(range(256, 2049, 256))  # where the batching server runs: unchanged
    assert len(length_buckets(8192)) == 16


def test_int8_embedding_looks_up_scaled_rows():
    from fish_sm.kernels import Int8Embedding

    table = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    table[3] = 0.0  # an all-zero row keeps a usable scale
    emb = Int8Embedding(table)
    ids = torch.tensor([[0, 3, 49], [7, 7, 1]])
    out = emb(ids)
    assert out.shape == (2, 3, 16) and out.dtype == table.dtype and emb.qweight.dtype == torch.int8
    assert torch.equal(out[0, 1], torch.zeros(16))
    step = table.abs().amax(dim=1) / 127  # one quantization step per row
    assert ((out - table[ids]).abs() <= step[ids, None] / 2 + 1e-7).all()


def test_a_prompt_padded_to_its_prefill_bucket_decodes_as_the_prompt_alone(tiny_checkpoint):
    """What a captured prefill does (GPU): the prompt padded at its end with stale tokens, the
    head read at its last real position. The padding's keys must never be seen."""
    from fish_sm.engine.generate import decode_frame, noise_size
    from fish_sm.engine.sampling import PENALTY_WINDOW, SamplingParams, sampling_tensors

    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    model = engine.model
    prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
    n, bucket = prompt.shape[1], prompt.shape[1] + 37
    t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
    runs = []
    for padded in (False, True):
        model.setup_caches(1, 256)
        g = torch.Generator().manual_seed(4)
        with torch.inference_mode():
            if padded:
                tokens = torch.randint(0, 1000, (1 + engine.config.num_codebooks, bucket), generator=g)
                tokens[:, :n] = prompt
                logits, _ = model.forward_slow(tokens[None], model.positions[:bucket], bucket, last=torch.tensor([n - 1]))
            else:
                logits, _ = model.forward_slow(prompt[None], model.positions[:n], n)
            out = [logits]
            frame = torch.zeros(1, 1 + engine.config.num_codebooks, dtype=torch.long)
            frame[:, 0] = model.semantic_begin_id
            for i in range(6):
                window = torch.zeros(1, frame.shape[1], PENALTY_WINDOW, dtype=torch.long)
                noise = torch.empty(1, noise_size(model)).exponential_(1, generator=torch.Generator().manual_seed(i))
                frame = decode_frame(model, frame, torch.tensor([n + i]), window, noise, t, p, r,
                                     key_pos=model.positions[:128])
                out.append(frame)
        runs.append(out)
    assert torch.allclose(runs[0][0], runs[1][0], atol=1e-5)
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert torch.equal(a, b)


def test_compiled_admission_prefill_matches_eager(tiny_checkpoint):
    """The batching engine's compiled admission prefill (prompts of any batch and length, each
    at its own positions in its own cache row) against the eager layers: logits and cache."""
    engines = [Engine.from_pretrained(tiny_checkpoint, device="cpu") for _ in range(2)]
    install(engines[1].model, BATCHING)
    rows = 1 + engines[0].config.num_codebooks
    outs = []
    for engine in engines:
        model = engine.model
        model.setup_caches(4, 128)
        got = []
        with torch.inference_mode():
            for batch, width, starts in ((1, 9, [0]), (3, 14, [0, 5, 20]), (2, 6, [3, 0])):
                tokens = torch.randint(0, 1000, (batch, rows, width), generator=torch.Generator().manual_seed(width))
                positions = torch.tensor(starts)[:, None] + torch.arange(width)
                live = int(positions.max()) + 1
                slots = torch.tensor([3, 0, 2][:batch])
                logits, hidden = model.forward_slow(tokens, positions, live, key_pos=model.positions[:live], row=slots,
                                                    last=torch.tensor([width - 1 - i for i in range(batch)]))
                got += [logits, hidden]
        got += [model.layers[-1].attention.kv_cache.k.clone()]
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_pickers_pick_as_eager_ones(tiny_checkpoint, rows):
    """The graphs' compiled pickers (head and residual codes; one row with the sort-free
    nucleus and the one-row inductor options, several rows without) against eager picking."""
    import functools

    from fish_sm.engine.generate import pick, pick_residual
    from fish_sm.engine.sampling import SamplingParams, sampling_tensors
    from fish_sm.kernels import compile_decode

    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    c, g = model.config, torch.Generator().manual_seed(rows)
    t, p, r = (x.view(1, 1).expand(rows, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
    logits = torch.randn(rows, c.semantic_vocab + 1, generator=g) * 3
    hidden = torch.randn(rows, c.fast_dim, generator=g)
    previous = torch.randint(0, 1024, (rows, 16), generator=g)
    one_row = rows == 1
    with torch.inference_mode():
        for f, args in ((pick, (logits, torch.empty_like(logits).exponential_(generator=g))),
                        (pick_residual, (model, hidden, torch.empty(rows, 1024).exponential_(generator=g)))):
            eager = functools.partial(f, sort_free=one_row)
            compiled = compile_decode(eager, one_row)
            for prev in (None, previous):
                assert torch.equal(compiled(*args, t, p, r, prev), eager(*args, t, p, r, prev))


def test_several_row_pickers_compile_once_for_every_batch_size(tiny_checkpoint):
    """A several-row picker compiled with `rows_first` marks its arguments' rows dynamic: the
    compile at the first batch size serves the others, picking as eager does."""
    from torch._dynamo.utils import counters

    from fish_sm.engine.generate import pick_residual
    from fish_sm.engine.sampling import SamplingParams, sampling_tensors
    from fish_sm.kernels import compile_decode

    model = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    g, graphs = torch.Generator().manual_seed(0), []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False), torch.inference_mode():
        compiled = compile_decode(pick_residual, False, rows_first=True)
        before = counters["stats"]["unique_graphs"]
        for rows in (2, 3, 5):
            t, p, r = (x.view(1, 1).expand(rows, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
            args = (model, torch.randn(rows, model.config.fast_dim, generator=g),
                    torch.empty(rows, 1024).exponential_(generator=g), t, p, r,
                    torch.randint(0, 1024, (rows, 16), generator=g))
            assert torch.equal(compiled(*args), pick_residual(*args))
            graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [1, 1, 1]


def test_one_row_steps_use_dependent_launch_in_bf16_only(monkeypatch):
    """What `compile_decode` hands torch.compile: PDL for bf16 one-row steps, not with INT8
    weights, not for several rows; an option this torch lacks is left out."""
    from fish_sm.kernels.compile import ONE_ROW_OPTIONS, compile_decode

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw["options"]) or fn)
    for one_row, int8 in ((True, False), (True, True), (False, False)):
        compile_decode(lambda x: x, one_row, int8=int8)
    assert seen[0]["triton.enable_pdl"] is True and seen[0]["coordinate_descent_tuning"] is True
    assert "triton.enable_pdl" not in seen[1] and seen[1]["coordinate_descent_tuning"] is True
    assert "triton.enable_pdl" not in seen[2]
    compile_decode(lambda x: x, True, one_row_options={**ONE_ROW_OPTIONS, "triton.no_such_option": 1})
    assert "triton.no_such_option" not in seen[3]


def _frames_at_batch_sizes(checkpoint, batches: list[int], compiled: bool, fast_only: bool = False,
                           two_passes: bool = False, graphs: list[int] | None = None) -> list:
    """Three decode frames of each of `batches` rows in turn, on a fresh engine (its layers
    compiled as the batching engine compiles them, if `compiled`): for each batch size, the
    last frame and the (k, v) cache rows of every layer (of the fast layers, with `fast_only`).
    `two_passes`: the fast transformer's positions 0 and 1 as two passes of one position.
    `graphs`: gets the graphs dynamo has compiled in this call by the end of each batch size."""
    from torch._dynamo.utils import counters

    from fish_sm.engine.generate import decode_frame, noise_size
    from fish_sm.engine.sampling import PENALTY_WINDOW, SamplingParams, sampling_tensors

    engine = Engine.from_pretrained(checkpoint, device="cpu")
    model = engine.model
    if compiled:
        install(model, BATCHING)
    if two_passes:  # (an instance attribute: this engine's model only)
        model.forward_fast_pair = lambda hidden, x: (model.forward_fast(hidden, 0), model.forward_fast(x, 1))[1]
    model.setup_caches(max(batches), 64)
    rows = 1 + engine.config.num_codebooks
    layers = list(model.fast_layers) if fast_only else list(model.layers) + list(model.fast_layers)
    out = []
    graphs_before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for n, batch in enumerate(batches):
            t, p, r = (x.view(1, 1).expand(batch, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
            g = torch.Generator().manual_seed(n)
            frame = torch.zeros(batch, rows, dtype=torch.long)
            frame[:, 0] = model.semantic_begin_id
            for i in range(3):
                window = torch.zeros(batch, rows, PENALTY_WINDOW, dtype=torch.long)
                noise = torch.empty(batch, noise_size(model)).exponential_(1, generator=g)
                frame = decode_frame(model, frame, torch.arange(batch) + i, window, noise, t, p, r,
                                     key_pos=model.positions[:16])
            out.append((frame, [(layer.attention.kv_cache.k[:batch].clone(), layer.attention.kv_cache.v[:batch].clone())
                                for layer in layers]))
            if graphs is not None:
                graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
    return out


def test_compiled_steps_at_several_batch_sizes_in_turn_match_eager(tiny_checkpoint):
    """The several-row code is compiled once, at the first batch size, for any (as the batching
    engine captures 2, 4, ..., 64 rows): no batch size after the first compiles anything, and
    every one writes the cache and picks as the eager layers do. (Dynamo's state is reset and
    its profile of earlier runs left out: a first compile here is a cold start's.)"""
    batches = [2, 3, 5, 4]
    graphs: list[int] = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        runs = [_frames_at_batch_sizes(tiny_checkpoint, batches, compiled, graphs=graphs if compiled else None)
                for compiled in (False, True)]
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * (len(batches) - 1), graphs
    for (frame_eager, caches_eager), (frame_compiled, caches_compiled) in zip(*runs):
        assert torch.equal(frame_eager, frame_compiled)
        for (a, _), (b, _) in zip(caches_eager, caches_compiled):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("compiled", [False, True])
def test_fast_positions_0_and_1_in_one_pass_match_two(tiny_checkpoint, compiled):
    """Steps of several rows run the fast transformer's positions 0 and 1 as one pass of two
    (`forward_fast_pair`): the same codes and fast caches as two passes of one, eager and
    compiled, at batch sizes in turn (the compiled halves generalised over the batch, the
    number of positions kept static)."""
    batches = [2, 4, 8, 16, 3]
    runs = {}
    for pair in (False, True):
        runs[pair] = _frames_at_batch_sizes(tiny_checkpoint, batches, compiled, fast_only=True, two_passes=not pair)
    for (frames_two, caches_two), (frames_pair, caches_pair) in zip(runs[False], runs[True]):
        assert torch.equal(frames_two, frames_pair)
        for (k2, v2), (kp, vp) in zip(caches_two, caches_pair):
            assert torch.allclose(k2, kp, atol=1e-5) and torch.allclose(v2, vp, atol=1e-5), (k2 - kp).abs().max()

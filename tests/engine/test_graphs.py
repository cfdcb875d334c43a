"""The engine's CUDA graphs against eager runs of what they capture (GPU only): a one-slot
batching engine's decode steps and admissions, and several rows' decode steps.

Only the first capture of each kind runs its function before capturing it; the others
capture cold, loading any kernel they launch first inside the capture (CUDA 12.3 and
later). Each graph must still replay exactly what an eager call computes.
"""

import numpy as np
import pytest
import torch

from fish_sm import kernels
from fish_sm.engine import Engine, generate
from fish_sm.engine.generate import SlotState, decode_slots, length_buckets, noise_size
from fish_sm.engine.sampling import PENALTY_WINDOW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cuda")
    engine.compile()
    return engine


def _step(engine: Engine) -> generate.GraphedStep:
    return engine.batching().runner.captured


@torch.inference_mode()
def test_every_admission_graph_replays_its_eager_run(engine):
    model, step = engine.model, _step(engine)
    assert len(step.admissions) > 2
    g = torch.Generator().manual_seed(0)
    for (batch, width), (graph, x, out) in sorted(step.admissions.items()):
        x["tokens"].copy_(torch.randint(0, 1000, x["tokens"].shape, generator=g))
        x["last"].copy_(torch.randint(0, width, (batch,), generator=g))
        graph.replay()
        replayed = [t.clone() for t in out]
        eager = model.forward_slow(x["tokens"], x["positions"], width, row=x["row"], last=x["last"])
        assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(replayed, eager)), (batch, width)


@torch.inference_mode()
def test_an_admission_staged_from_host_arrays_replays_its_eager_run(engine):
    """A prefill's host arrays staged straight into its captured graph's buffer (`admit`), the
    parts of odd length included: the same outputs as the compiled layers on those arrays."""
    model, runner = engine.model, engine.batching().runner
    step, rows = runner.captured, 1 + engine.config.num_codebooks
    rng = np.random.default_rng(1)
    for batch, width in sorted(step.admissions)[:3]:
        tokens = rng.integers(0, 1000, (batch, rows, width))
        positions = np.broadcast_to(np.arange(width), (batch, width))
        slots, last = np.full(batch, step.scratch_row), rng.integers(0, width, batch)
        replayed = [t.clone() for t in step.admit(step.admissions, (batch, width), runner.staging,
                                                  (tokens, positions, slots, last))]
        on_gpu = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in (tokens, positions, slots, last)]
        eager = model.forward_slow(on_gpu[0], on_gpu[1], width, row=on_gpu[2], last=on_gpu[3])
        assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(replayed, eager)), (batch, width)


def _decode_matches_eager(model, step, batch: int, bucket: int, seed: int) -> bool:
    """One replay of the (batch, bucket) decode graph against `decode_slots` run eagerly on the
    same inputs and the same slot state (each row's last frame and history, as before the replay)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    state, (ints, floats) = step.state, step.inputs(batch)
    rows = torch.randperm(step.scratch_row, device="cuda", generator=g)[:batch]
    for t in (state.current, state.history):  # a semantic token, then residual codes
        t[rows] = torch.randint(0, 1024, (batch, *t.shape[1:]), device="cuda", generator=g)
        t[rows, 0] += model.semantic_begin_id
    ints.copy_(torch.stack([torch.randint(0, 2**62, (batch,), device="cuda", generator=g), rows,
                            bucket - 1 - torch.randint(0, 200, (batch,), device="cuda", generator=g),
                            torch.randint(0, 300, (batch,), device="cuda", generator=g), torch.zeros_like(rows)]))
    if not state.keyed:
        state.noise[:batch].exponential_(1, generator=g)
    before = [t.clone() for t in (state.current, state.history, state.noise)]
    replayed = step.replay(batch, bucket).clone()
    for t, b in zip((state.current, state.history, state.noise), before):
        t.copy_(b)
    eager = decode_slots(model, state, ints.clone(), floats.clone(), model.positions[:bucket], step.pickers_for(batch))
    return torch.equal(replayed, eager)


@torch.inference_mode()
def test_every_decode_graph_replays_its_eager_run(engine):
    model, step = engine.model, _step(engine)
    buckets = length_buckets(model.max_seq_len)
    assert len(buckets) > 2 and all((1, b) in step.graphs for b in buckets)
    for i, bucket in enumerate(buckets):
        assert _decode_matches_eager(model, step, 1, bucket, seed=i), bucket


@torch.inference_mode()
def test_several_rows_decode_graphs_replay_their_eager_runs(tiny_checkpoint):
    """Several rows (a batching server's steps): the first bucket of each batch size is
    captured warm, the rest cold."""
    engine = Engine.from_pretrained(tiny_checkpoint, device="cuda", max_seq_len=1024)
    model, rows = engine.model, 1 + engine.config.num_codebooks
    model.setup_caches(5, 1024)  # four rows and a scratch row
    state = SlotState(torch.zeros(5, rows, dtype=torch.long, device="cuda"),
                      torch.zeros(5, rows, 1024 + PENALTY_WINDOW, dtype=torch.long, device="cuda"),
                      torch.ones(4, noise_size(model), device="cuda"), kernels.sampling_usable(model.device))
    step = generate.GraphedStep(model, state, scratch_row=4, max_batch=4)
    step.capture_all((1, 2, 4))
    buckets = length_buckets(1024)
    assert len(buckets) > 2
    for batch in (1, 2, 4):
        for i, bucket in enumerate(buckets):
            assert _decode_matches_eager(engine.model, step, batch, bucket, seed=i), (batch, bucket)


@torch.inference_mode()
def test_every_first_frame_graph_replays_its_eager_run(engine):
    """The first frame after a prefill, captured with its noise, history reset and write-back
    (`first_slots`), against the same run eagerly on the same inputs and slot state."""
    model, step = engine.model, _step(engine)
    state = step.state
    sizes = step.first_sizes(1)
    assert sizes
    for seed, batch in enumerate(sizes):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ints, floats = step.first_inputs(batch)
        rows = torch.randperm(step.scratch_row, device="cuda", generator=g)[:batch]
        ints.copy_(torch.stack([torch.randint(0, 2**62, (batch,), device="cuda", generator=g), rows]))
        floats.copy_(torch.rand(floats.shape, device="cuda", generator=g) * 0.5 + 0.5)
        logits = torch.randn(batch, step.first_outputs["logits"].shape[1], device="cuda", generator=g).to(model.dtype)
        hidden = torch.randn(batch, step.first_outputs["hidden"].shape[1], device="cuda", generator=g).to(model.dtype)
        state.history[rows] = 7  # reset by the first frame
        if not state.keyed:
            state.noise[:batch].exponential_(1, generator=g)
        before = [t.clone() for t in (state.current, state.history, state.noise)]
        replayed = step.first_frame(batch, logits, hidden).clone()
        after = [t.clone() for t in (state.current, state.history)]
        for t, b in zip((state.current, state.history, state.noise), before):
            t.copy_(b)
        eager = generate.first_slots(model, state, ints.clone(), floats.clone(), logits, hidden, step.pickers_for(batch))
        assert torch.equal(replayed, eager), batch
        assert torch.equal(after[0], state.current) and torch.equal(after[1], state.history), batch
        assert torch.equal(state.current[rows], eager) and not state.history[rows].any(), batch


@pytest.mark.parametrize("cold", [True, False])
@torch.inference_mode()
def test_a_later_capture_runs_its_function_once_where_the_driver_loads_kernels_in_captures(engine, monkeypatch, cold):
    """Where kernels cannot load inside a capture (a driver before CUDA 12.3), every capture
    runs its function before capturing it, as the first of each kind always does."""
    model, step = engine.model, _step(engine)
    bucket = length_buckets(model.max_seq_len)[-1]
    forward, calls = model.forward_slow, []
    monkeypatch.setattr(generate, "kernels_load_in_captures", lambda: cold)
    monkeypatch.setattr(model, "forward_slow", lambda *a, **k: calls.append(1) or forward(*a, **k))
    step.capture(1, bucket, warm_up=False)
    assert len(calls) == (1 if cold else 2)
    step.capture(1, bucket)
    assert len(calls) == (3 if cold else 4)
    monkeypatch.undo()
    assert _decode_matches_eager(model, step, 1, bucket, seed=11)


@torch.inference_mode()
def test_a_continuation_graph_replays_its_eager_run(engine):
    """A prompt after a kept prefix, captured: against the compiled layers on the same inputs."""
    model, step = engine.model, _step(engine)
    step.capture_continuation(1, 64, 512)
    graph, x, out = step.continuations[(1, 64, 512)]
    g = torch.Generator().manual_seed(3)
    x["tokens"].copy_(torch.randint(0, 1000, x["tokens"].shape, generator=g))
    x["positions"].copy_(300 + torch.arange(64))
    x["last"].fill_(40)
    graph.replay()
    replayed = [t.clone() for t in out]
    eager = model.forward_slow(x["tokens"], x["positions"], 512, key_pos=model.positions[:512], row=x["row"],
                               last=x["last"])
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(replayed, eager))


def test_a_prompt_after_a_kept_prefix_is_captured_for_the_next_of_its_shape(engine):
    """The first prompt after a voice's prefix runs the compiled layers and queues its shape;
    the engine captures it while idle, and the next prompt of that shape replays it, giving
    the same codes."""
    from fish_sm.engine import Reference

    codes = torch.randint(0, 1024, (engine.config.num_codebooks, 40), generator=torch.Generator().manual_seed(4))
    voice = Reference("A voice to imitate.", codes)
    runner = engine.batching().runner
    before = runner.prefills[("continued", "captured")]
    first = engine.synthesize("Hello there.", voice, seed=5, max_new_tokens=6)
    second = engine.synthesize("Hello there.", voice, seed=5, max_new_tokens=6)
    assert runner.prefills[("continued", "captured")] == before + 1
    assert torch.equal(first.codes, second.codes)


def test_graphs_captured_once_serving_give_the_codes_of_graphs_captured_first(tiny_checkpoint):
    """A batching engine started with the graphs of a few rows (`compile()`, as a server starts)
    serves a burst of more: its larger steps captured as the load outgrows the captured ones,
    the codec's larger batches on the compiled back until its thread captures them. Its codes
    are those of an engine that captured every graph before serving (float32), and again once
    every graph is captured."""
    from fish_sm.engine.batching import BatchEngine, Job
    from fish_sm.engine.sampling import SamplingParams

    def burst(batcher) -> list:
        texts = ["Hello there.", "A somewhat longer sentence, so that more frames come out.", "Short.", "One more!"]
        jobs = [Job(t, params=SamplingParams(seed=i, max_new_tokens=16), stream=i % 2 == 0)
                for i, t in enumerate(texts * 3)]
        with batcher:
            return [t.result().codes for t in [batcher.submit(j) for j in jobs]]

    batchers = {}
    for capture_all in (True, False):
        engine = Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype=torch.float32)
        batchers[capture_all] = BatchEngine(engine, max_batch=16, forced_lengths=True, horizon_s=0)
        batchers[capture_all].compile(capture_all=capture_all)
    full, early = batchers[True], batchers[False]
    assert early.runner.ready_sizes == [1, 2, 4] and full.runner.ready_sizes == [1, 2, 4, 8, 16]
    assert early._codec.codec.capturing and not full._codec.codec.capturing
    want = burst(full)
    assert all(torch.equal(a, b) for a, b in zip(burst(early), want))
    while early.runner.capturing:  # what the engine's threads capture once idle
        early.runner.capture_next()
    while early._codec.codec.capturing:
        early._codec.codec.capture_next()
    assert early.runner.ready_sizes == full.runner.ready_sizes
    assert early._codec.codec.backs.keys() == full._codec.codec.backs.keys()
    assert all(torch.equal(a, b) for a, b in zip(burst(early), want))

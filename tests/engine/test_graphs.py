"""The engine's CUDA graphs against eager runs of what they capture (GPU only): a one-slot
batching engine's decode steps and admissions, and several rows' decode steps.

Only the first capture of each kind runs its function before capturing it; the others
capture cold, loading any kernel they launch first inside the capture (CUDA 12.3 and
later). Each graph must still replay exactly what an eager call computes.
"""

import pytest
import torch

from fish_sm.engine import Engine, generate
from fish_sm.engine.generate import decode_frame, length_buckets

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


def _decode_matches_eager(model, step, batch: int, bucket: int, seed: int) -> bool:
    """One replay of the (batch, bucket) decode graph against decode_frame run eagerly on the same inputs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = {k: v[:batch] for k, v in step.inputs.items()}
    for name in ("frame", "window"):  # a semantic token, then residual codes
        x[name].copy_(torch.randint(0, 1024, x[name].shape, device="cuda", generator=g))
        x[name][:, 0] += model.semantic_begin_id
    x["input_pos"].copy_(bucket - 1 - torch.randint(0, 200, (batch,), device="cuda", generator=g))
    x["noise"].copy_(torch.empty(x["noise"].shape, device="cuda").exponential_(1, generator=g))
    graph, out = step.graphs[(batch, bucket)]
    graph.replay()
    replayed = out[:batch].clone()
    eager = decode_frame(model, x["frame"], x["input_pos"], x["window"], x["noise"], x["temperature"], x["top_p"],
                         x["penalty"], key_pos=model.positions[:bucket], pickers=step.pickers_for(batch),
                         rows=x.get("rows"))
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
    engine.model.setup_caches(4, 1024)
    step = generate.GraphedStep(engine.model, max_batch=4)
    step.capture_all((1, 2, 4))
    buckets = length_buckets(1024)
    assert len(buckets) > 2
    for batch in (1, 2, 4):
        for i, bucket in enumerate(buckets):
            assert _decode_matches_eager(engine.model, step, batch, bucket, seed=i), (batch, bucket)


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

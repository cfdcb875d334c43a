"""LoRA adapters in the engines (CPU, float32, tiny checkpoint): rows of different adapters in one
batch, each as it is alone; adapter slots kept least recently used first, never one in use."""

import threading
from collections import Counter

import pytest
import torch

from fish_sm.engine import Engine
from fish_sm.engine.batching import BatchEngine, Job
from fish_sm.engine.sampling import SamplingParams
from fish_sm.errors import AdapterError
from fish_sm.kernels import AdapterSlots
from fish_sm.model.config import ModelConfig
from fish_sm.model.lora import random_adapter

NAMES = ("alto", "bass", "tenor")


class Source:
    """Adapters in memory, counting reads; `gate` (if set) holds reads until it is set."""

    def __init__(self, adapters):
        self.adapters = {a.name: a for a in adapters}
        self.reads = Counter()
        self.gate: threading.Event | None = None

    def load(self, name):
        if self.gate is not None:
            self.gate.wait(timeout=30)
        self.reads[name] += 1
        if name not in self.adapters:
            raise AdapterError(f"adapter {name!r} is broken")
        return self.adapters[name]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint):
    config = ModelConfig.from_file(tiny_checkpoint)
    return [random_adapter(config, name, rank=4 + 2 * i, seed=10 + i, scale=0.05) for i, name in enumerate(NAMES)]


def adapted_engine(tiny_checkpoint, adapters, slots: int) -> tuple[Engine, Source]:
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu")
    with torch.no_grad():  # <|im_end|> likely enough that requests end at different frames
        engine.model.head.weight[-1] *= 8
    source = Source(adapters)
    engine.enable_adapters(source, memory_bytes=slots * AdapterSlots.slot_bytes(engine.model, 8), rank=8)
    return engine, source


def jobs() -> list[Job]:
    texts = ["Hello there.", "A longer sentence, so that more frames come out of it.", "Short.",
             "One more test sentence here!", "And a fifth."]
    names = [*NAMES, None, NAMES[0]]
    return [Job(text, params=SamplingParams(seed=i, max_new_tokens=18 + 5 * i), adapter=name)
            for i, (text, name) in enumerate(zip(texts, names))]


def alone(engine: Engine, job: Job):
    return engine.synthesize(job.text, adapter=job.adapter, seed=job.params.seed,
                             max_new_tokens=job.params.max_new_tokens)


def test_a_batch_mixing_adapters_gives_each_row_its_codes_alone(tiny_checkpoint, adapters):
    engine, source = adapted_engine(tiny_checkpoint, adapters, slots=3)
    each = [alone(engine, job) for job in jobs()]
    assert len({tuple(r.codes[0, :6].tolist()) for r in each[:4]}) == 4, "each adapter should change the codes"
    batcher = BatchEngine(engine, max_batch=8)
    with batcher:
        tickets = [batcher.submit(job) for job in jobs()]
        batched = [t.result() for t in tickets]
    for job, a, b in zip(jobs(), each, batched):
        assert torch.equal(a.codes, b.codes), job.adapter
    assert batcher.steps < 0.6 * sum(r.frames for r in each), "rows of different adapters share steps"
    assert set(engine.adapter_stats()["resident"]) == set(NAMES) and sum(source.reads.values()) == 3


def test_slots_are_kept_least_recently_used_first_and_never_taken_from_a_request(tiny_checkpoint, adapters):
    engine, source = adapted_engine(tiny_checkpoint, adapters, slots=2)
    cache = engine.adapters
    first = {name: alone(engine, Job("Say it.", params=SamplingParams(seed=5, max_new_tokens=12), adapter=name)).codes
             for name in NAMES[:2]}
    assert cache.resident() == ["alto", "bass"]
    held = cache.acquire("bass")  # a request holds bass; alto was used longer ago but bass more recently
    cache.acquire("alto")
    cache.release(cache.acquire("alto"))
    with pytest.raises(AdapterError, match="every adapter slot is in use"):
        cache.acquire("tenor")  # alto and bass are both held
    cache.release(cache._resident["alto"])
    cache.acquire("tenor")  # takes alto's slot: bass is held
    assert cache.resident() == ["bass", "tenor"]
    cache.release(cache._resident["tenor"])
    cache.release(held)
    again = alone(engine, Job("Say it.", params=SamplingParams(seed=5, max_new_tokens=12), adapter="alto"))
    assert cache.resident() == ["tenor", "alto"], "bass, least recently used and free, made room"
    assert torch.equal(again.codes, first["alto"]), "a reloaded adapter gives what its first load gave"
    assert source.reads["alto"] == 2
    # Changed at its source: a request holding the old copy keeps it; the next claim reads afresh.
    held = cache.acquire("alto")
    cache.forget("alto")
    assert not cache.ready("alto") and cache.claim("alto") is None
    cache.release(held)
    assert cache.acquire("alto") and source.reads["alto"] == 3


def test_a_request_waits_for_its_adapter_while_others_decode_and_a_bad_one_fails_alone(tiny_checkpoint, adapters):
    engine, source = adapted_engine(tiny_checkpoint, adapters, slots=3)
    source.gate = threading.Event()
    batcher = BatchEngine(engine, max_batch=4)
    plain = Job("Nothing special about this one, it just speaks.", params=SamplingParams(seed=1, max_new_tokens=30))
    with batcher:
        tuned = batcher.submit(Job("Tuned.", params=SamplingParams(seed=2, max_new_tokens=10), adapter="alto"))
        broken = batcher.submit(Job("Broken.", params=SamplingParams(seed=3, max_new_tokens=10), adapter="missing"))
        other = batcher.submit(plain)
        assert other.result().frames > 0, "a request without an adapter went ahead of those waiting for one"
        assert batcher.load()["waiting"] == 2
        source.gate.set()
        assert tuned.result().frames > 0
        with pytest.raises(AdapterError, match="broken"):
            broken.result()
        assert batcher.submit(plain).result().frames > 0  # the engine carries on
    with pytest.raises(AdapterError, match="serves no adapters"):
        BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cpu"), max_batch=1).submit(
            Job("x", adapter="alto"))


def merged_checkpoint(tiny_checkpoint, adapter, out):
    """The base with `adapter` merged as upstream's merge_lora does (W + B·A·alpha/r)."""
    from fish_sm.model.weights import read_state_dict, write_safetensors
    out.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.name != "model.pth":
            (out / f.name).symlink_to(f)
    weights = {k: v.float().clone() for k, v in read_state_dict(tiny_checkpoint / "model.pth").items()}
    for target in adapter.pairs:
        weights[f"{target}.weight"] += adapter.delta(target)
    write_safetensors(weights, out / "model.safetensors")
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_unmerged_rows_equal_merged_models_and_graphs_read_each_rows_adapter(tiny_checkpoint, adapters,
                                                                                        tmp_path):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cuda")  # bf16
    engine.enable_adapters(Source(adapters), memory_bytes=3 * AdapterSlots.slot_bytes(engine.model, 8), rank=8)
    slots = [engine.adapters.acquire(name) for name in NAMES] + [0]
    prompt = torch.randint(0, 1000, (1, 1 + engine.config.num_codebooks, 24), device="cuda")
    model = engine.model
    # Row by row against the merged models (bf16 both ways), one prompt in cache row 0 each time.
    worst = 0.0
    with torch.inference_mode():
        engine.model.setup_caches(4, 64)
        engine.adapters.slots.set_rows(torch.tensor(slots))
        batched, _ = model.forward_slow(prompt.expand(4, -1, -1).contiguous(), model.positions[:24], 24)
        for i, adapter in enumerate([*adapters, None]):
            path = tiny_checkpoint if adapter is None else merged_checkpoint(tiny_checkpoint, adapter, tmp_path / f"m{i}")
            merged = Engine.from_pretrained(path, device="cuda").model
            merged.setup_caches(1, 64)
            want, _ = merged.forward_slow(prompt, merged.positions[:24], 24)
            scale = want.float().abs().max().item()
            worst = max(worst, (batched[i].float() - want[0].float()).abs().max().item() / scale)
    print(f"\nbf16 unmerged batch vs merged models: largest logit difference {worst:.3f} of the largest logit")
    assert worst < 0.05
    for slot in slots[:3]:
        engine.adapters.release(slot)
    # The captured decode steps read each row's adapter: same text and seed, rows of one adapter
    # alike, rows of different adapters apart.
    engine.model.setup_caches(1, engine.model.config.max_seq_len)
    batcher = BatchEngine(engine, max_batch=8, forced_lengths=True, horizon_s=0)
    batcher.compile()
    names = [None, "alto", "alto", "bass", "tenor", None]
    with batcher:
        tickets = [batcher.submit(Job("Same words.", params=SamplingParams(seed=7, max_new_tokens=24), adapter=n))
                   for n in names]
        codes = [t.result().codes for t in tickets]
    assert torch.equal(codes[1], codes[2]) and torch.equal(codes[0], codes[5])
    assert len({tuple(c.flatten().tolist()) for c in (codes[0], codes[1], codes[3], codes[4])}) == 4
    # Steps none of whose rows has an adapter replay the graphs without the adapters' products:
    # the codes of an engine without adapters, bit for bit.
    assert batcher.runner.captured.without_adapters.keys() == {k for k in batcher.runner.captured.graphs if k[0] != "first"}
    plain = BatchEngine(Engine.from_pretrained(tiny_checkpoint, device="cuda"), max_batch=8, forced_lengths=True,
                        horizon_s=0)
    plain.compile()
    job = lambda seed: Job("Same words.", params=SamplingParams(seed=seed, max_new_tokens=24))  # noqa: E731
    with plain:
        want = [t.result().codes for t in [plain.submit(job(s)) for s in range(3)]]
    with batcher:
        got = [t.result().codes for t in [batcher.submit(job(s)) for s in range(3)]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_the_adapters_an_adapted_model_is_its_base_model(tiny_checkpoint, adapters):
    """`AdapterSlots.without()`, as the graphs for steps without adapters are captured: the
    adapted model computes its base model's outputs exactly, whatever slots the rows name, and
    adds the adapters again after."""
    engine, _ = adapted_engine(tiny_checkpoint, adapters, slots=3)
    base = Engine.from_pretrained(tiny_checkpoint, device="cpu").model
    with torch.no_grad():
        base.head.weight[-1] *= 8
    prompt = torch.randint(0, 500, (2, 1 + engine.config.num_codebooks, 12), generator=torch.Generator().manual_seed(0))
    model, slots = engine.model, engine.adapters.slots
    with torch.inference_mode():
        for m in (model, base):
            m.setup_caches(2, 32)
        slots.set_rows(torch.tensor([engine.adapters.acquire("alto"), engine.adapters.acquire("bass")]))
        want = base.forward_slow(prompt, base.positions[:12], 12)[0]
        with slots.without():
            assert torch.equal(model.forward_slow(prompt, model.positions[:12], 12)[0], want)
        assert not torch.allclose(model.forward_slow(prompt, model.positions[:12], 12)[0], want)


def test_compiled_layers_with_rows_of_different_adapters_follow_the_eager_ones(tiny_checkpoint, adapters):
    """The decode step's layers as the GPU compiles them (inductor, here on the CPU) read each
    row's adapter as the eager ones do: a batch of three rows (two adapters, one without), a few
    decode steps: same frames, same cache."""
    from fish_sm.engine.generate import decode_frame, noise_size
    from fish_sm.engine.sampling import PENALTY_WINDOW, sampling_tensors
    from fish_sm.kernels import BATCHING, install

    batch = 3
    engines = [adapted_engine(tiny_checkpoint, adapters, slots=3)[0] for _ in range(2)]
    install(engines[1].model, BATCHING)
    t, p, r = (x.view(1, 1).expand(batch, 1) for x in sampling_tensors(SamplingParams(seed=0), "cpu"))
    outs = []
    for engine in engines:
        model = engine.model
        model.setup_caches(batch, 64)
        engine.adapters.slots.set_rows(torch.tensor([engine.adapters.acquire("bass"), 0, engine.adapters.acquire("alto")]))
        g = torch.Generator().manual_seed(0)
        rows = 1 + engine.config.num_codebooks
        frame = torch.zeros(batch, rows, dtype=torch.long)
        frame[:, 0] = model.semantic_begin_id
        frames = []
        with torch.inference_mode():
            for i in range(4):
                window = torch.zeros(batch, rows, PENALTY_WINDOW, dtype=torch.long)
                noise = torch.empty(batch, noise_size(model)).exponential_(1, generator=g)
                frame = decode_frame(model, frame, torch.full((batch,), i), window, noise, t, p, r,
                                     key_pos=model.positions[:16])
                frames.append(frame)
        outs.append((torch.stack(frames), model.layers[0].attention.kv_cache.k.clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-5)
    assert not torch.equal(outs[0][0][:, 0], outs[0][0][:, 1]), "rows of different adapters decode apart"

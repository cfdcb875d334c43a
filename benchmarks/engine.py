"""The engine benchmark: every speed figure of fish-sm's engine in one run.

    python benchmarks/engine.py CHECKPOINT [--modes bf16,int8] [--frames 500] [--repeats 2] [--profile]
        [--cold-warm] [--batching 1,4,8,16,32,64 [--batching-frames 300] [--batching-modes bf16]
        [--batching-rounds 3] [--max-seq-len 2048]] [--json out.json]

Per mode (`eager`: bf16 uncompiled; `bf16`: compiled; `int8`: compiled, INT8 weight-only):
load, quantize and compile time, decode frames/s at one stream after a ~1,000-token prompt
(and after a short one), the prefill of that prompt, the codec's decode of 10 s of audio (whole,
in the codec's own float32, and as served: the streaming codec's pieces), time
to first audio streaming a 20-word sentence with a reference voice, weight and peak memory,
and how closely the compiled step follows the eager one (`fish_sm.engine.checks`).
`--cold-warm` times `model_fn` in fresh processes, per measured mode: a first start into an
empty compile cache, then three warm starts from it. `--batching` measures the batching
engine at each number of concurrent requests (`batching_curve`). Each figure is the median of
`--repeats` runs. Random weights seldom choose <|im_end|>, so runs are mostly as long as
asked (the batching levels count those that stopped early).

It prints each part's JSON as it finishes, then tables of the figures with the device, the
versions and the date (no targets: those are in docs/benchmarks.md). Use a GPU for figures
you report; on a CPU it runs end to end on a tiny checkpoint, to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from typing import Callable

import numpy as np
import torch

import fish_sm
from fish_sm.engine import Engine, Reference, SamplingParams
from fish_sm.engine.checks import SENTENCE, compare_compiled_to_eager, weight_bytes
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.generate import attention_bucket, decode_frame, noise_size, sample_frame
from fish_sm.engine.prompt import build_prompt
from fish_sm.engine.sampling import PENALTY_WINDOW, sampling_tensors

MODES = ("eager", "bf16", "int8")
REFERENCE_TEXT = "This is the transcript of the reference recording, spoken clearly and at an even pace."
# Short texts for the batching levels (and the short-prompt decode they are compared with).
BATCH_TEXTS = [
    "Hello, and welcome to the show.",
    "The weather today is sunny with a light breeze from the west.",
    "Please remember to bring your badge to the front desk before the meeting starts.",
    "Numbers like 42 and 1,024 are read out loud, one after another.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "In the beginning there was silence, and then, slowly, a voice.",
]


# -- helpers (the experiments in benchmarks/ use them too) ---------------------------------


@contextlib.contextmanager
def start_up_frozen():
    """What runs inside sees the collector as the servers leave it (`freeze_start_up_objects`):
    no full collection's pause inside a measurement. Unfrozen after, so that the engine measured
    can be collected (frozen objects never are)."""
    freeze_start_up_objects()
    try:
        yield
    finally:
        gc.unfreeze()


def resolve(device: str) -> torch.device:
    return torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds of `fn()`, the GPU synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def graphed_us(fn, calls: int = 100, replays: int = 5) -> float:
    """Microseconds a call of `fn` (CUDA), replayed from one CUDA graph of `calls` calls: the
    kernels back to back, as in a captured frame, without launch costs."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * calls) * 1e6


def time_configs(shipped, grid, call: Callable) -> tuple[dict, dict, object]:
    """A kernel's launch configs timed (`graphed_us`): the shipped one and each of `grid`, as
    `call(config, i)` for the i-th call of a graph (to rotate through copies of its weights). A
    config that does not compile (registers, shared memory) gets its error instead of a time.
    Returns every config's result, those timed, and the fastest."""
    times: dict = {}
    for config in dict.fromkeys([shipped, *grid]):
        turn = iter(range(10**9))
        try:
            times[config] = graphed_us(lambda c=config: call(c, next(turn)))
        except Exception as exc:
            times[config] = repr(exc)[:200]
    timed = {c: t for c, t in times.items() if isinstance(t, float)}
    return times, timed, min(timed, key=timed.get)


def record(out: dict, entry: dict, path: str) -> None:
    """One product's entry (`time_configs`'s): into out["products"], printed as a line without its
    every-config times ("all"), and the whole of `out` written to `path` (a call cut short keeps it)."""
    out["products"].append(entry)
    print(json.dumps({key: v for key, v in entry.items() if key != "all"}), flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def run_prefill(model, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slow transformer over a whole prompt [1 + C, T] from position 0, in cache row 0,
    launched from Python: the head's logits and the fast transformer's input at its end."""
    length = prompt.shape[1]
    return model.forward_slow(prompt.to(model.device)[None], model.positions[:length], length)


def release(device: torch.device) -> None:
    """Hand back what dropped objects held (CUDA graphs' pools included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load(checkpoint: str, mode: str, device: torch.device, max_seq_len: int | None = None) -> Engine:
    """An engine of `mode`'s weights (int8: quantized), not compiled."""
    engine = Engine.from_pretrained(checkpoint, device=device, max_seq_len=max_seq_len)
    if mode == "int8":
        engine.quantize_int8()
    return engine


def reference_voice(engine: Engine, frames: int) -> Reference:
    """A reference voice of `frames` random frames (what an encoded recording gives)."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 1024, (engine.config.num_codebooks, frames), generator=g)
    codes[0] = torch.randint(0, engine.config.codebook_size, (frames,), generator=g)
    return Reference(REFERENCE_TEXT, codes)


def kernel_profile(run, calls: int, device: torch.device, top: int = 25) -> dict:
    """What the GPU runs for `calls` calls of `run`: kernels per call, their summed time per
    call, and the kernels that take most of it (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        sync(device)
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in kernels.values()) or 1.0
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels_per_call": sum(len(v) for v in kernels.values()) / calls,
            "kernel_ms_per_call": total / calls / 1e3,
            "top": [{"name": n[:90], "per_call": len(v) / calls, "us_per_call": sum(v) / calls,
                     "share": sum(v) / total} for n, v in ranked]}


def decode_step_inputs(model, batch: int, live: int) -> tuple[tuple, torch.Tensor]:
    """`decode_frame`'s arguments for a step of `batch` rows at `live` cache slots (model, frame,
    positions, penalty window, noise, temperature, top_p, penalty), and its `key_pos`."""
    dev = model.device
    rows = 1 + model.config.num_codebooks
    t, p, r = (x.view(1, 1).expand(batch, 1).contiguous() for x in sampling_tensors(SamplingParams(seed=0), dev))
    frame = torch.zeros(batch, rows, dtype=torch.long, device=dev)
    frame[:, 0] = model.semantic_begin_id
    pos = torch.full((batch,), live - 1, device=dev)
    window = torch.zeros(batch, rows, PENALTY_WINDOW, dtype=torch.long, device=dev)
    noise = torch.empty(batch, noise_size(model), device=dev).exponential_(1)
    return (model, frame, pos, window, noise, t, p, r), model.positions[: attention_bucket(model.max_seq_len, live)]


def profile_decode(model, step, batch: int, live: int, calls: int = 20, top: int = 25) -> dict:
    """One decode step of `batch` rows at `live` cache slots: its kernels (`kernel_profile` of the
    step launched from Python, the same kernels as its graph) and the time of `step`'s replay
    (a batching engine's `runner.captured`, a `GraphedStep`, its batch size captured)."""
    dev = model.device
    args, key_pos = decode_step_inputs(model, batch, live)
    with torch.inference_mode():
        out = kernel_profile(lambda: decode_frame(*args, key_pos=key_pos, pickers=step.pickers_for(batch)), calls, dev,
                             top)

        def replay():  # (on whatever inputs its buffer holds: the same kernels)
            return step.replay(batch, key_pos.shape[0])

        replay()
        out["graph_ms_per_call"] = statistics.median(timed(replay, dev) * 1e3 for _ in range(calls))
    out.update(batch=batch, live=live)
    return out


def profile_prefill(engine: Engine, prompt_tokens: int, calls: int = 5) -> dict:
    """The prefill of a ~`prompt_tokens` prompt (a reference voice and a sentence), launched from Python."""
    model, dev = engine.model, engine.device
    voice = reference_voice(engine, max(1, prompt_tokens - 60))
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks, [(voice.text, voice.codes)], SENTENCE).to(dev)
    with torch.inference_mode():
        return kernel_profile(lambda: run_prefill(model, prompt), calls, dev)


def profile_admission(engine: Engine, calls: int = 5) -> dict:
    """One request's admission as the batching engine's compiled layers run it (not captured):
    the prefill of a short prompt, then its first frame."""
    model, dev = engine.model, engine.device
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks, [], BATCH_TEXTS[1]).to(dev)
    t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(seed=0), dev))
    noise = torch.empty(1, noise_size(model), device=dev).exponential_(1)

    def admit():
        return sample_frame(model, *run_prefill(model, prompt), None, noise, t, p, r)

    with torch.inference_mode():
        out = kernel_profile(admit, calls, dev)
        out["wall_ms_per_call"] = statistics.median(timed(admit, dev) * 1e3 for _ in range(calls))
    out["prompt_tokens"] = prompt.shape[1]
    return out


# -- one stream (the engine's one-slot batching engine) -----------------------------------------


def measure(engine: Engine, frames: int, repeats: int, prompt_tokens: int) -> dict:
    """One stream on the engine's batching engine as it is (compiled or not; every request to
    its full length): decode rate after a ~`prompt_tokens` prompt (a reference voice, whose
    prompt prefix the engine keeps after its first request, and a sentence) and after a short
    one, the first frame and the first audio with the voice, the codec's whole decode of 10 s."""
    from fish_sm.engine.batching import Job

    dev, model = engine.device, engine.model
    voice = reference_voice(engine, max(1, prompt_tokens - 60))
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks, [(voice.text, voice.codes)], SENTENCE)
    batcher = engine.batching()

    def request(text: str, references: tuple, n: int) -> tuple[dict, int]:
        ticket = batcher.submit(Job(text, references=references, params=SamplingParams(max_new_tokens=n, seed=0)),
                                bounded=False)
        return ticket.timings, ticket.result().frames

    def decode(text: str = SENTENCE, references: tuple = (voice,)) -> float:
        timings, n = request(text, references, frames)  # from its first frame (the prefill's) to its last
        return (n - 1) / (timings["queue"] + timings["generate"] - timings["first_frame"])

    def first_frame() -> float:
        timings, _ = request(SENTENCE, (voice,), 2)
        return timings["first_frame"]

    ten_seconds = torch.randint(0, 1024, (1, model.config.num_codebooks, round(10 * engine.sample_rate / engine.frame_length)),
                                generator=torch.Generator().manual_seed(2)).to(dev)

    def codec_decode():
        with torch.inference_mode():
            engine.codec.decode(ten_seconds)

    served_codec = served_codec_decode(engine, ten_seconds)

    def first_audio() -> float:
        t0 = time.perf_counter()
        stream = engine.stream(SENTENCE, voice, seed=0, max_new_tokens=64)
        next(stream)
        elapsed = time.perf_counter() - t0
        stream.close()
        return elapsed

    first_frame(), codec_decode(), first_audio()  # warm-up (the voice's prefix computed and kept)
    return {
        "prompt_tokens": prompt.shape[1],
        "first_frame_ms": statistics.median(first_frame() * 1e3 for _ in range(repeats)),
        "decode_frames_per_s": statistics.median(decode() for _ in range(repeats)),
        "decode_short_prompt_frames_per_s": statistics.median(decode(BATCH_TEXTS[1], ()) for _ in range(repeats)),
        "codec_decode_10s_ms": statistics.median(timed(codec_decode, dev) * 1e3 for _ in range(repeats)),
        "served_codec_10s_ms": statistics.median(timed(served_codec, dev) * 1e3 for _ in range(repeats)),
        "time_to_first_audio_ms": statistics.median(first_audio() * 1e3 for _ in range(repeats)),
        "reference_frames": voice.codes.shape[1],
    }


def served_codec_decode(engine: Engine, codes: torch.Tensor) -> Callable[[], None]:
    """A function that decodes `codes` [1, C, n] as a served stream's audio is decoded: the
    batching engine's streaming codec (its precision and piece schedule, graphs captured), one
    lane, piece after piece. Warmed up once here."""
    from fish_sm.engine.batching import CodecWorker
    from fish_sm.engine.codec_stream import decode_in_pieces

    worker = CodecWorker(engine, 4, 64, lanes=1)
    worker.capture()

    def decode() -> None:
        with torch.inference_mode():
            decode_in_pieces(worker.codec, codes)

    decode()
    return decode


def run_mode(checkpoint: str, mode: str, frames: int, repeats: int, prompt_tokens: int, device: str,
             profile: bool = False) -> dict:
    dev = resolve(device)
    release(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(checkpoint, device=dev)
    sync(dev)
    out = {"mode": mode, "dtype": str(engine.model.dtype).removeprefix("torch."), "load_s": time.perf_counter() - t0}
    if mode == "int8":
        out["quantize_s"] = timed(engine.quantize_int8, dev)
    out["weight_gb"] = weight_bytes(engine.model) / 1e9
    # Every request to its full length (random weights' <|im_end|> would end some early).
    if mode != "eager":
        out["compile_s"] = timed(functools.partial(engine.compile, forced_lengths=True), dev)
    else:
        engine.batching(forced_lengths=True)
    with start_up_frozen():
        out.update(measure(engine, frames if mode != "eager" else min(frames, 100), repeats, prompt_tokens))
        out["realtime_x"] = out["decode_frames_per_s"] * engine.frame_length / engine.sample_rate
        if profile and engine.compiled and dev.type == "cuda":
            out["profile"] = profile_decode(engine.model, engine.batching().runner.captured, 1, 1100)
            out["prefill_profile"] = profile_prefill(engine, prompt_tokens)
        if engine.compiled:
            prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
            out["compiled_vs_eager"] = compare_compiled_to_eager(engine, prompt)
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    engine.batching().stop()
    del engine
    release(dev)
    return out


# -- many streams (the batching engine) -------------------------------------------------------


def batching_curve(checkpoint: str, mode: str, streams: list[int], frames: int, max_seq_len: int, device: str,
                   profile: bool = False, rounds: int = 3) -> dict:
    """The batching engine at each number of concurrent requests, each `frames` long:
    aggregate frames/s, each request's decode rate (first to last frame), time to first audio
    p50/p95 when streaming. All submitted at once, streamed and whole; then, with `rounds`
    above 1, streamed in a closed loop of that many rounds (`batching_level`). Before the
    levels: the streaming codec alone (`codec_pieces_check`); the captured admissions against
    each prompt's eager prefill (`admission_check`)."""
    from fish_sm.engine.batching import BatchEngine, Job

    dev = resolve(device)
    engine = load(checkpoint, mode, dev, max_seq_len)
    prompts, reference = admission_reference(engine, max(streams))
    codec = codec_pieces_check(engine)
    release(dev)  # the check's codec graphs, before the slots are sized
    batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0, horizon_s=0)  # decode as fast as it can
    out = {"mode": mode, "slots": batcher.slots, "max_seq_len": batcher.max_seq_len, "frames_per_request": frames,
           "codec_pieces": codec}
    out["compile_s"] = timed(lambda: batcher.compile(capture_all=True), dev)
    out["admission_graph_vs_compiled"] = admission_check(batcher, prompts, reference)
    if profile and dev.type == "cuda":
        step = batcher.runner.captured
        out["profile"] = [profile_decode(engine.model, step, b, 300) for b in batcher.batch_sizes]
        out["admission_profile"] = profile_admission(engine)
        for level in out["profile"]:
            print(json.dumps({k: v for k, v in level.items() if k != "top"}), flush=True)
    levels = []
    with start_up_frozen(), batcher:
        batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()  # warm-up
        for stream, r in ((True, 1), (False, 1), (True, rounds))[: 3 if rounds > 1 else 2]:
            for n in streams:
                levels.append(batching_level(batcher, n, frames, stream, r))
                print(json.dumps(levels[-1]), flush=True)
    out["levels"] = levels
    del batcher, engine
    release(dev)
    return out


def batching_level(batcher, n: int, frames: int, stream: bool, rounds: int = 1) -> dict:
    """`n` clients, each sending `rounds` requests of `frames` frames to a running
    `BatchEngine`, its next as soon as its last has all its audio (a closed loop, as
    `fish-sm bench` runs its concurrency levels; one round: `n` requests submitted at once):
    aggregate frames/s, each request's decode rate (first to last frame; those that stopped
    early excluded) and its rate from submission to last audio, and where the wait goes.

    One round is a burst: all `n` admitted together, then a tail after the last frame while
    the codec finishes; and each request that stops early leaves fewer than `n` running. More
    rounds keep `n` requests in flight, as an endpoint with `n` callers has them."""
    from fish_sm.engine.batching import Job

    rate = batcher.engine.sample_rate / batcher.engine.frame_length

    def submit(i: int):
        return batcher.submit(Job(BATCH_TEXTS[i % len(BATCH_TEXTS)], stream=stream,
                                  params=SamplingParams(seed=i, max_new_tokens=frames)))

    def client(c: int) -> list:
        done = []
        for r in range(1, rounds):  # rounds after the first, one request at a time
            ticket = submit(r * n + c)
            done.append((ticket, ticket.result()))
        return done

    t0 = time.perf_counter()
    opening = [submit(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        clients = list(pool.map(lambda c: [(opening[c], opening[c].result())] + client(c), range(n)))
        pairs = [pair for done in clients for pair in done]
    wall = time.perf_counter() - t0
    tickets, results = [t for t, _ in pairs], [r for _, r in pairs]
    decode = [(r.frames - 1) / (t.timings["queue"] + t.timings["generate"] - t.timings["first_frame"])
              for t, r in zip(tickets, results) if r.frames >= frames // 2] or [0.0]
    # The decode loop's span: from the level's first first frame to its last last frame.
    first_at, last_at = _frame_times(tickets)
    span = max(last_at) - min(first_at)
    level = {"streams": n, "stream": stream, "rounds": rounds,
             "aggregate_frames_per_s": sum(r.frames for r in results) / wall,
             # Frames after each request's first, over that span: the transformer's aggregate
             # decode rate with the codec running beside it (no admission before, no codec tail after).
             "aggregate_decode_frames_per_s": sum(r.frames - 1 for r in results) / span if span > 0 else 0.0,
             "decode_span_s": span,
             "per_request_decode_frames_per_s_min": min(decode),
             "per_request_decode_frames_per_s_median": statistics.median(decode),
             "stopped_early": sum(r.frames < frames // 2 for r in results),
             "per_request_realtime_x_min": min(decode) / rate, "wall_s": wall,
             # submission to the last audio
             "end_to_end_frames_per_s_median": statistics.median(r.frames / t.timings["total"]
                                                                 for t, r in zip(tickets, results))}
    if rounds > 1:
        # While every client is still in the loop: from the first first frame until the first
        # client's last frame. After it fewer than `n` streams run (clients whose requests
        # stopped early finish first), which is a tail of the benchmark, not `n` concurrent streams.
        start, end = min(first_at), min(max(_frame_times([t for t, _ in done])[1]) for done in clients)
        inside = sum((r.frames - 1) * _overlap(f, l, start, end)
                     for r, f, l in zip(results, first_at, last_at))
        level["steady_decode_frames_per_s"] = inside / (end - start) if end > start else 0.0
        level["steady_window_s"] = end - start
    # Where the wait goes: until admitted (queue), until the first frame, until first audio.
    level["admitted_ms_p50"] = statistics.median(t.timings["queue"] * 1e3 for t in tickets)
    level["first_frame_ms_p50"] = statistics.median(t.timings["first_frame"] * 1e3 for t in tickets)
    if stream:
        first = sorted(t.timings["first_audio"] * 1e3 for t in tickets)
        level["first_audio_ms_p50"] = statistics.median(first)
        level["first_audio_ms_p95"] = first[min(len(first) - 1, math.ceil(0.95 * len(first)) - 1)]
    return level


def _frame_times(tickets) -> tuple[list[float], list[float]]:
    """Each request's first and last frame (time.perf_counter)."""
    return ([t.submitted + t.timings["first_frame"] for t in tickets],
            [t.submitted + t.timings["queue"] + t.timings["generate"] for t in tickets])


def _overlap(first: float, last: float, start: float, end: float) -> float:
    """The part of a request's frames decoded within [start, end], its frames taken as evenly
    spread from its first frame to its last."""
    if last <= first:
        return float(start <= first <= end)
    return max(0.0, min(last, end) - max(first, start)) / (last - first)


def admission_reference(engine: Engine, most: int) -> tuple[dict[int, list], dict[int, torch.Tensor]]:
    """Prompts to admit together (1, 3 and 8 of them, at most `most`) and each prompt's logits
    from its own eager prefill (uncompiled), taken before a batching
    engine takes the model over: {n: prompts}, {n: logits [n, vocab] in float32}."""
    model, prompts, reference = engine.model, {}, {}
    with torch.inference_mode():
        for n in sorted({min(k, most) for k in (1, 3, 8)}):
            prompts[n] = [build_prompt(engine.tokenizer, engine.config.num_codebooks, [], BATCH_TEXTS[i % len(BATCH_TEXTS)])
                          for i in range(n)]
            reference[n] = torch.stack([run_prefill(model, p)[0][0].float() for p in prompts[n]])
    return prompts, reference


def admission_check(batcher, prompts: dict[int, list], reference: dict[int, torch.Tensor]) -> list[dict]:
    """`admission_reference`'s prompts admitted together through a captured admission and
    through the compiled layers (`runner.admissions_both_ways`), against each prompt's prefill
    alone: largest logit difference, and whether each row's most likely token is the same.
    Run before serving (it writes into free cache rows)."""
    out = []
    with torch.inference_mode():
        for n, group in prompts.items():
            if n > batcher.slots:
                continue
            shape, captured, compiled = batcher.runner.admissions_both_ways(group)
            expected = reference[n].to(captured.device)
            level = {"prompts": n, "padded_shape": shape}
            for name, logits in (("captured", captured), ("compiled", compiled)):
                level[f"{name}_max_logit_diff"] = (logits - expected).abs().max().item()
                level[f"{name}_same_argmax"] = bool(torch.equal(logits.argmax(-1), expected.argmax(-1)))
            out.append(level)
    return out


def codec_pieces_check(engine: Engine, streams: int = 16, frames: int = 300) -> dict:
    """The batching engine's streaming codec as served (`CodecWorker`'s `StreamingCodec`, its
    graphs captured on the worker's stream), before the batching engine sizes its slots and
    dropped after: a `frames`-frame decode in scheduled pieces, its largest difference from the
    same codes decoded in one piece and its speed alone; `streams` different streams decoded
    side by side (`push`), their largest difference from each decoded alone in one piece,
    and their speed: the codec's ceiling on what the batching engine turns into audio. (The
    caller hands its graphs' memory back: `release`.)"""
    from fish_sm.engine.batching import CodecWorker
    from fish_sm.engine.codec_stream import decode_in_pieces

    worker = CodecWorker(engine, 4, 64, lanes=streams)
    worker.capture()
    pieces = worker.codec
    codes = torch.randint(0, 1024, (streams, engine.config.num_codebooks, frames),
                          generator=torch.Generator().manual_seed(3)).to(engine.device)
    lanes = np.arange(streams)

    def side_by_side() -> torch.Tensor:
        at, index, out = 0, 0, []
        while at < codes.shape[-1]:
            n = min(pieces.next_frames(index), codes.shape[-1] - at)
            audio = pieces.push(lanes, np.full(streams, index), codes[..., at : at + n], np.full(streams, n)).tensors()
            out.append(torch.cat(audio))
            at, index = at + n, index + 1
        return torch.cat(out, dim=-1)

    with torch.inference_mode():
        one = codes[:1]
        diff = (decode_in_pieces(pieces, one) - engine.codec.decode(one)).abs().max().item()
        together = side_by_side()
        diff_many = max((together[i] - engine.codec.decode(codes[i : i + 1])[0]).abs().max().item() for i in range(streams))
        seconds = statistics.median(timed(lambda: decode_in_pieces(pieces, one), engine.device) for _ in range(3))
        many = statistics.median(timed(side_by_side, engine.device) for _ in range(3))
    return {"pieces_vs_whole_max_abs": diff, "one_stream_frames_per_s": frames / seconds,
            "streams": streams, "streams_vs_whole_max_abs": diff_many, "streams_frames_per_s": streams * frames / many}


# -- start-up ---------------------------------------------------------------------------------

COLD_WARM = """
import json, sys, time, logging
logging.basicConfig(level=logging.WARNING)
from fish_sm.serving.mms.handler import model_fn
t0 = time.perf_counter()
model = model_fn(sys.argv[1])
total = time.perf_counter() - t0
from torch._dynamo.utils import counters  # where a warm start's compile time goes: cache hits or not
cache = {f"{group}.{k}": v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
captures = getattr(model.engine.batching().runner.captured, "timings", {})  # graph captures, by kind
print("MODEL_FN " + json.dumps({"total_s": total, **model.timings, "captures": captures, "caches": cache}))
"""


def cold_warm(checkpoint: str, quantize: str, warm_starts: int = 3) -> dict:
    """model_fn in fresh processes sharing one FISH_SM_CACHE_DIR: a first start into the
    empty cache, then `warm_starts` starts from it ("warm_start" is their median by total).
    Each start's "triton_kernels": the Triton kernels the cache holds after it (a warm start
    that adds some rebuilt what the first start had built)."""
    out: dict = {"warm_starts": []}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FISH_SM_CACHE_DIR": cache, "FISH_SM_QUANTIZE": quantize, "FISH_SM_COMPILE": "true",
               "FISH_SM_WARMUP": "2"}
        # Triton's kernels go where the compile cache puts them, as in a fresh container: inductor
        # sets TRITON_CACHE_DIR in this process once it compiles (the modes measured before), and
        # handed on, the starts would find this process's kernels there and never build their own.
        env.pop("TRITON_CACHE_DIR", None)
        for start in range(1 + warm_starts):
            proc = subprocess.run([sys.executable, "-c", COLD_WARM, checkpoint], env=env, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("MODEL_FN ")]
            if proc.returncode or not line:
                raise RuntimeError(f"model_fn failed:\n{proc.stderr[-3000:]}")
            timings = json.loads(line[-1][len("MODEL_FN "):])
            timings["triton_kernels"] = sum(len(dirs) for root, dirs, _ in os.walk(cache) if root.endswith("triton"))
            if start == 0:
                out["first_start"] = timings
            else:
                out["warm_starts"].append(timings)
    if out["warm_starts"]:
        out["warm_start"] = sorted(out["warm_starts"], key=lambda t: t["total_s"])[(len(out["warm_starts"]) - 1) // 2]
    return out


# -- the report ---------------------------------------------------------------------------------


def environment() -> dict:
    """Where the figures come from: device, driver, versions, commit, date."""
    def version(module: str) -> str | None:
        try:
            return __import__(module).__version__
        except Exception:  # not installed, or fails to import (Triton on a CPU build)
            return None

    def command(*args: str) -> str | None:
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__)))
            return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            return None

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "driver": command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") if cuda else None,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": version("triton"),
            "torchao": version("torchao"), "fish_sm": fish_sm.__version__,
            "commit": command("git", "describe", "--always", "--dirty"), "date": date.today().isoformat()}


def figures_tables(report: dict) -> str:
    """The run's figures as Markdown tables (what was measured, nothing judged): one stream and
    start-up as figure | value; the batching levels one row each."""
    rows = []

    def row(figure: str, value: str) -> None:
        rows.append(f"| {figure} | {value} |")

    modes = {m["mode"]: m for m in report["modes"]}
    for name, m in modes.items():
        label = f"{name} ({m['dtype']})" if name == "eager" or m["dtype"] != "bfloat16" else name
        row(f"decode at one stream, {label}", f"{m['decode_frames_per_s']:.1f} frames/s ({m['realtime_x']:.1f}x real "
            f"time); after a short prompt {m['decode_short_prompt_frames_per_s']:.1f}")
        row(f"first frame, {m['prompt_tokens']:,}-token prompt (its voice's prefix kept), {label}",
            f"{m['first_frame_ms']:.1f} ms")
        row(f"codec decode of 10 s of audio, {label}", f"{m['codec_decode_10s_ms']:.1f} ms")
        if "served_codec_10s_ms" in m:
            row(f"served codec (pieces) of 10 s of audio, {label}", f"{m['served_codec_10s_ms']:.1f} ms")
        row(f"time to first audio, one stream ({m['reference_frames']}-frame voice), {label}",
            f"{m['time_to_first_audio_ms']:.0f} ms")
        row(f"weights, {label}", f"{m['weight_gb']:.2f} GB" + (
            f"; peak memory {m['peak_memory_gb']:.2f} GB" if m.get("peak_memory_gb") is not None else ""))
        if "compile_s" in m:
            row(f"load / compile, {label}", f"{m['load_s']:.1f} / {m['compile_s']:.1f} s")
        if "compiled_vs_eager" in m:
            c = m["compiled_vs_eager"]
            row(f"compiled step against eager, {label}", f"logits within {c['max_abs_logit_diff']:.3g} of "
                f"{c['max_abs_logit']:.3g}; codes {c['code_agreement']:.1%} the same")
    bf16, int8 = modes.get("bf16"), modes.get("int8")
    if bf16 and int8:
        row("INT8 against bf16, decode at one stream", f"{int8['decode_frames_per_s'] / bf16['decode_frames_per_s']:.3f}x")
        row("INT8 against bf16, weight memory", f"{int8['weight_gb'] / bf16['weight_gb']:.1%}")
    for quantize, starts in report.get("model_fn", {}).items():
        row(f"first start (`model_fn`, quantize {quantize}, empty cache)", f"{starts['first_start']['total_s']:.1f} s")
        if starts.get("warm_start"):
            runs = ", ".join(f"{t['total_s']:.1f}" for t in starts["warm_starts"])
            row(f"warm start (`model_fn`, quantize {quantize}, median)", f"{starts['warm_start']['total_s']:.1f} s "
                f"(of {runs})")
    levels = []
    for curve in report.get("batching", []):
        mode = curve["mode"]
        row(f"batching {mode}: slots, KV length, compile", f"{curve['slots']} slots of {curve['max_seq_len']:,} tokens; "
            f"{curve['compile_s']:.1f} s")
        codec = curve["codec_pieces"]
        row(f"batching {mode}: streaming codec alone, {codec['streams']} streams side by side",
            f"{codec['streams_frames_per_s']:,.0f} frames/s (one stream {codec['one_stream_frames_per_s']:,.0f})")
        for check in curve.get("admission_graph_vs_compiled", []):
            row(f"batching {mode}: {check['prompts']} prompts admitted together, against each prefill alone",
                f"captured logits within {check['captured_max_logit_diff']:.3g}, compiled within "
                f"{check['compiled_max_logit_diff']:.3g}")
        one = next((lv for lv in curve["levels"] if lv["streams"] == 1 and lv["stream"] and lv["rounds"] == 1), None)
        short = modes.get(mode)
        if one and short:
            ratio = one["per_request_decode_frames_per_s_median"] / short["decode_short_prompt_frames_per_s"]
            row(f"batching {mode}: 1 stream of {curve['slots']} slots against the one-slot engine, decode",
                f"{ratio - 1:+.1%}")
        for lv in curve["levels"]:
            kind = (f"closed loop, {lv['rounds']} rounds" if lv["rounds"] > 1 else "burst") + (
                ", streamed" if lv["stream"] else ", whole")
            steady = lv.get("steady_decode_frames_per_s")
            audio = (f"{lv['first_audio_ms_p50']:.0f} / {lv['first_audio_ms_p95']:.0f}" if lv["stream"] else "")
            levels.append(f"| {mode} | {lv['streams']} | {kind} | {lv['aggregate_frames_per_s']:,.0f} | "
                          f"{lv['aggregate_decode_frames_per_s']:,.0f} | {'' if steady is None else f'{steady:,.0f}'} | "
                          f"{lv['per_request_realtime_x_min']:.2f}x | {audio} | {lv['stopped_early']} |")
    env = report["environment"]
    head = ", ".join(f"{k} {v}" for k, v in env.items() if v and k not in ("device", "date"))
    out = [f"{env['device']}; {head}; {env['date']}"]
    if rows:
        out += ["", "| figure | value |", "| --- | --- |", *rows]
    if levels:
        out += ["", "Batching levels, frames/s: text to last audio; decode span (first frame to last); steady window "
                "(closed loop, all clients in it)",
                "", "| weights | streams | requests | text to last audio | decode span | steady | slowest stream "
                "| first audio p50 / p95 ms | stopped early |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *levels]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Figures only: targets are in docs/benchmarks.md. See benchmarks/README.md.")
    p.add_argument("checkpoint", help="a checkpoint directory (`fish-sm make-checkpoint DIR --preset s1-mini`)")
    p.add_argument("--modes", default="bf16,int8",
                   help="one-stream modes, comma-separated: eager (bf16, uncompiled), bf16, int8; '' for none")
    p.add_argument("--frames", type=int, default=500, help="frames per decode run")
    p.add_argument("--repeats", type=int, default=2, help="runs per figure (the median is reported)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="about this long a prompt for decode and prefill")
    p.add_argument("--device", default="auto")
    p.add_argument("--profile", action="store_true", help="also profile the decode step's kernels (CUDA)")
    p.add_argument("--cold-warm", action="store_true", help="also time model_fn cold and from the persisted cache")
    p.add_argument("--batching", help="also measure the batching engine at these stream counts, e.g. 1,4,8,16,32,64")
    p.add_argument("--batching-frames", type=int, default=300, help="frames per request in --batching")
    p.add_argument("--batching-modes", default="bf16", help="weights for --batching: bf16, int8 or both")
    p.add_argument("--batching-rounds", type=int, default=3,
                   help="also run --batching's streamed levels as a closed loop of this many requests a client (1: not)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV length per request in --batching")
    p.add_argument("--json", help="write the report here too (after each part)")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    batching_modes = [m for m in a.batching_modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(batching_modes) - {"bf16", "int8"})
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}: --modes takes {', '.join(MODES)}; --batching-modes bf16, int8")
    streams = [int(n) for n in a.batching.split(",")] if a.batching else []
    report = {"environment": environment(), "checkpoint": a.checkpoint, "modes": []}
    print(json.dumps(report["environment"]), flush=True)

    def save(part: dict) -> None:  # as each part finishes, so a cut-off run keeps what it measured
        print(json.dumps(part, indent=2), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=2)

    for mode in modes:
        report["modes"].append(run_mode(a.checkpoint, mode, a.frames, a.repeats, a.prompt_tokens, a.device, a.profile))
        save(report["modes"][-1])
    for mode in batching_modes if streams else []:
        report.setdefault("batching", []).append(
            batching_curve(a.checkpoint, mode, streams, a.batching_frames, a.max_seq_len, a.device, a.profile,
                           a.batching_rounds))
        save(report["batching"][-1])
    if a.cold_warm:
        report["model_fn"] = {}
        for quantize in [q for mode, q in (("bf16", "none"), ("int8", "int8")) if mode in modes] or ["none"]:
            report["model_fn"][quantize] = cold_warm(a.checkpoint, quantize)
            save(report["model_fn"][quantize])
    print("\n" + figures_tables(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

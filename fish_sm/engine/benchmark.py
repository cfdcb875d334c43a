"""Engine benchmark: every speed figure of the engine in one run.

    python -m fish_sm.engine.benchmark CHECKPOINT [--modes eager,bf16,int8] [--frames 500] [--repeats 2]
        [--cold-warm] [--batching 1,4,8,16,32,64 [--batching-frames 300] [--batching-modes bf16]
        [--batching-rounds 3] [--max-seq-len 2048]] [--json out.json]

Per mode (eager bf16, compiled bf16, compiled INT8 weight-only): compile time, decode
frames/s at batch 1, prefill of a ~1,000-token prompt, codec decode of 10 s of audio,
time to first audio streaming a 20-word sentence with a reference voice, weight memory,
and how closely the compiled step's logits follow the eager ones. `--cold-warm` also
times `model_fn` in fresh processes, per measured mode: a first start compiling from
nothing, then three starts that reuse the kernel cache it wrote. `--batching` measures the batching
engine at each number of concurrent requests (see `batching_curve`). Each figure is the
median of `--repeats` runs. Random weights seldom choose <|im_end|>, so runs are mostly as
long as asked (the batching curve counts those that stopped early). Use a GPU for figures
you report. At the end it prints the speed targets' table for what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
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

import torch

from fish_sm.engine import Engine, Reference, SamplingParams
from fish_sm.engine.engine import freeze_start_up_objects
from fish_sm.engine.generate import attention_bucket, decode_frame, generate_frames, noise_size
from fish_sm.engine.generate import prefill as run_prefill
from fish_sm.engine.sampling import PENALTY_WINDOW, sampling_tensors
from fish_sm.engine.prompt import build_prompt

SENTENCE = ("The quick brown fox jumps over the lazy dog while the patient engineer measures "
            "how fast this voice can start speaking.")  # 20 words
REFERENCE_TEXT = "This is the transcript of the reference recording, spoken clearly and at an even pace."
# Short texts for the batching curve (and the short-prompt decode it is compared with).
BATCH_TEXTS = [
    "Hello, and welcome to the show.",
    "The weather today is sunny with a light breeze from the west.",
    "Please remember to bring your badge to the front desk before the meeting starts.",
    "Numbers like 42 and 1,024 are read out loud, one after another.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "In the beginning there was silence, and then, slowly, a voice.",
]


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage of a tensor, looking inside quantized tensor subclasses (data + scales)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


def reference_voice(engine: Engine, frames: int) -> Reference:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 1024, (engine.config.num_codebooks, frames), generator=g)
    codes[0] = torch.randint(0, engine.config.codebook_size, (frames,), generator=g)
    return Reference(REFERENCE_TEXT, codes)


def compare_compiled_to_eager(engine: Engine, prompt: torch.Tensor, steps: int = 8) -> dict:
    """Run the same frames through the eager step (exact attention length) and the
    compiled one (bucketed, masked attention; graphs or torch.compile) from identical
    states and inputs; report how far the slow head's logits and the sampled codes differ."""
    model, dev = engine.model, engine.device
    compiled_slow = model.forward_slow if dev.type == "cuda" else torch.compile(model.forward_slow, fullgraph=True)
    params = SamplingParams(seed=0)
    t, p, r = (x.view(1, 1) for x in sampling_tensors(params, dev))
    worst, scale, agree, total = 0.0, 0.0, 0, 0
    with torch.inference_mode():
        length = prompt.shape[1]
        model.forward_slow(prompt.to(dev)[None], torch.arange(length, device=dev), length)
        frame = torch.zeros(prompt.shape[0], dtype=torch.long, device=dev)
        frame[0] = model.semantic_begin_id
        window = torch.zeros(prompt.shape[0], PENALTY_WINDOW, dtype=torch.long, device=dev)
        g = torch.Generator(dev).manual_seed(0)
        for i in range(steps):
            pos = torch.tensor([length + i], device=dev)
            bucket = model.positions[: attention_bucket(model.max_seq_len, length + i + 1)]
            eager_logits, _ = model.forward_slow(frame.view(1, -1, 1), pos, length + i + 1)
            comp_logits, _ = compiled_slow(frame.view(1, -1, 1), pos, 0, bucket)
            worst = max(worst, (eager_logits.float() - comp_logits.float()).abs().max().item())
            scale = max(scale, eager_logits.float().abs().max().item())
            noise = torch.empty(1, noise_size(model), device=dev).exponential_(1, generator=g)
            a = decode_frame(model, frame[None], pos, window[None], noise, t, p, r, live=length + i + 1)[0]
            b = engine._step(model, frame[None], pos, window[None], noise, t, p, r, key_pos=bucket)[0].clone() if engine.compiled else a
            agree += int((a == b).sum())
            total += a.numel()
            frame = a
    return {"max_abs_logit_diff": worst, "max_abs_logit": scale, "code_agreement": agree / total}


def measure(engine: Engine, frames: int, repeats: int, prompt_tokens: int) -> dict:
    dev, model = engine.device, engine.model
    voice = reference_voice(engine, max(1, prompt_tokens - 60))
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks, [(voice.text, voice.codes)], SENTENCE)
    short = build_prompt(engine.tokenizer, model.config.num_codebooks, [], BATCH_TEXTS[1])  # as the batching curve's
    params = SamplingParams(max_new_tokens=frames, seed=0)

    def prefill():  # as the engine runs it: replayed from a captured graph when compiled on a GPU
        with torch.inference_mode():
            run_prefill(model, prompt, engine._step)

    def decode(prompt=prompt) -> float:
        t, n = time.perf_counter(), 0
        for i, _ in enumerate(generate_frames(model, prompt, params, step=engine._step)):
            if i == 0:
                _sync(dev)
                t = time.perf_counter()  # the first frame comes from the prefill
            n = i
        _sync(dev)
        return n / (time.perf_counter() - t)

    ten_seconds = torch.randint(0, 1024, (1, model.config.num_codebooks, round(10 * engine.sample_rate / engine.frame_length)),
                                generator=torch.Generator().manual_seed(2)).to(dev)

    def codec_decode():
        with torch.inference_mode():
            engine.codec.decode(ten_seconds)

    def first_audio() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        stream = engine.stream(SENTENCE, voice, seed=0, max_new_tokens=64)
        next(stream)
        _sync(dev)
        elapsed = time.perf_counter() - t0
        stream.close()
        return elapsed

    prefill(), codec_decode(), first_audio()  # warm-up
    return {
        "prompt_tokens": prompt.shape[1],
        "prefill_ms": statistics.median(_timed(prefill, dev) * 1e3 for _ in range(repeats)),
        "decode_frames_per_s": statistics.median(decode() for _ in range(repeats)),
        "decode_short_prompt_frames_per_s": statistics.median(decode(short) for _ in range(repeats)),
        "codec_decode_10s_ms": statistics.median(_timed(codec_decode, dev) * 1e3 for _ in range(repeats)),
        "time_to_first_audio_ms": statistics.median(first_audio() * 1e3 for _ in range(repeats)),
        "reference_frames": voice.codes.shape[1],
    }


def kernel_profile(run, calls: int, device: torch.device, top: int = 25) -> dict:
    """What the GPU runs for `calls` calls of `run`: kernels per call, their summed time per
    call, and the kernels that take most of it (CUDA; a profile of the same work outside
    the CUDA graphs, whose kernels are the same ones)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        _sync(device)
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels_per_call": sum(len(v) for v in kernels.values()) / calls,
            "kernel_ms_per_call": total / calls / 1e3,
            "top": [{"name": n[:90], "per_call": len(v) / calls, "us_per_call": sum(v) / calls,
                     "share": sum(v) / total} for n, v in ranked]}


def decode_step_inputs(engine: Engine, batch: int, live: int) -> tuple[tuple, torch.Tensor]:
    """`decode_frame`'s arguments for a step of `batch` rows at `live` cache slots (model, frame,
    positions, penalty window, noise, temperature, top_p, penalty), and its `key_pos`."""
    model, dev = engine.model, engine.device
    rows = 1 + model.config.num_codebooks
    t, p, r = (x.view(1, 1).expand(batch, 1).contiguous() for x in sampling_tensors(SamplingParams(seed=0), dev))
    frame = torch.zeros(batch, rows, dtype=torch.long, device=dev)
    frame[:, 0] = model.semantic_begin_id
    pos = torch.full((batch,), live - 1, device=dev)
    window = torch.zeros(batch, rows, PENALTY_WINDOW, dtype=torch.long, device=dev)
    noise = torch.empty(batch, noise_size(model), device=dev).exponential_(1)
    return (model, frame, pos, window, noise, t, p, r), model.positions[: attention_bucket(model.max_seq_len, live)]


def profile_decode(engine: Engine, batch: int, live: int, calls: int = 20, top: int = 25) -> dict:
    """One decode step of `batch` rows at `live` cache slots: its kernels (see
    `kernel_profile`) and the time of its CUDA graph replay (CUDA, compiled engines)."""
    dev, step = engine.device, engine._step
    args, key_pos = decode_step_inputs(engine, batch, live)
    with torch.inference_mode():
        out = kernel_profile(lambda: decode_frame(*args, key_pos=key_pos, pickers=step.pickers_for(batch)), calls, dev,
                             top)
        replay = lambda: step(*args, key_pos=key_pos)
        replay()
        out["graph_ms_per_call"] = statistics.median(_timed(replay, dev) * 1e3 for _ in range(calls))
    out.update(batch=batch, live=live)
    return out


def profile_prefill(engine: Engine, prompt_tokens: int, calls: int = 5) -> dict:
    """The prefill of a ~`prompt_tokens` prompt (a reference voice and a sentence)."""
    model, dev = engine.model, engine.device
    voice = reference_voice(engine, max(1, prompt_tokens - 60))
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks, [(voice.text, voice.codes)], SENTENCE).to(dev)
    with torch.inference_mode():
        return kernel_profile(lambda: run_prefill(model, prompt), calls, dev)


def profile_admission(engine: Engine, calls: int = 5) -> dict:
    """A request's admission in the batching engine: prefill of a short prompt, then its first frame."""
    from fish_sm.engine.generate import sample_frame

    model, dev = engine.model, engine.device
    prompt = build_prompt(engine.tokenizer, model.config.num_codebooks, [], BATCH_TEXTS[1]).to(dev)
    t, p, r = (x.view(1, 1) for x in sampling_tensors(SamplingParams(seed=0), dev))
    noise = torch.empty(1, noise_size(model), device=dev).exponential_(1)

    def admit():
        return sample_frame(model, *run_prefill(model, prompt), None, noise, t, p, r)

    with torch.inference_mode():
        out = kernel_profile(admit, calls, dev)
        out["wall_ms_per_call"] = statistics.median(_timed(admit, dev) * 1e3 for _ in range(calls))
    out["prompt_tokens"] = prompt.shape[1]
    return out


def run_mode(checkpoint: str, mode: str, frames: int, repeats: int, prompt_tokens: int, device: str,
             profile: bool = False) -> dict:
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(checkpoint, device=dev)
    _sync(dev)
    out = {"mode": mode, "load_s": time.perf_counter() - t0}
    if mode == "int8":
        out["quantize_s"] = _timed(engine.quantize_int8, dev)
    out["weight_gb"] = weight_bytes(engine.model) / 1e9
    if mode != "eager":
        out["compile_s"] = _timed(engine.compile, dev)
    with start_up_frozen():
        out.update(measure(engine, frames if mode != "eager" else min(frames, 100), repeats, prompt_tokens))
        out["realtime_x"] = out["decode_frames_per_s"] * engine.frame_length / engine.sample_rate
        if profile and mode != "eager" and dev.type == "cuda":
            out["profile"] = profile_decode(engine, 1, 1100)
            out["prefill_profile"] = profile_prefill(engine, prompt_tokens)
        if mode != "eager":
            prompt = build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE)
            out["compiled_vs_eager"] = compare_compiled_to_eager(engine, prompt)
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    del engine
    return out


def batching_curve(checkpoint: str, mode: str, streams: list[int], frames: int, max_seq_len: int, device: str,
                   profile: bool = False, rounds: int = 3) -> dict:
    """The batching engine at each number of concurrent requests, each `frames` long:
    aggregate frames/s, each request's decode rate (first to last frame), time to first audio
    p50/p95 when streaming. All submitted at once, streamed and whole; then, with `rounds`
    above 1, streamed in a closed loop of that many rounds (`batching_level`)."""
    from fish_sm.engine.batching import BatchEngine, Job

    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    engine = Engine.from_pretrained(checkpoint, device=dev, max_seq_len=max_seq_len)
    if mode == "int8":
        engine.quantize_int8()
    sequential = sequential_requests(engine, frames) if 1 in streams else None
    batcher = BatchEngine(engine, max_batch=max(streams), max_queue=0)
    out = {"mode": mode, "slots": batcher.slots, "max_seq_len": max_seq_len, "frames_per_request": frames,
           "sequential": sequential}
    out["compile_s"] = _timed(batcher.compile, dev)
    (out["codec_pieces_vs_whole_max_abs"], out["codec_pieces_frames_per_s"], out["codec_pieces_16_streams_max_abs"],
     out["codec_pieces_16_streams_frames_per_s"]) = _codec_pieces_check(engine, batcher._codec.codec)
    out["admission_graph_vs_compiled"] = _admission_check(batcher)
    if profile and dev.type == "cuda":
        engine._step = batcher._step
        out["profile"] = [profile_decode(engine, b, 300) for b in batcher.batch_sizes]
        out["admission_profile"] = profile_admission(engine)
        engine._step = None
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
             # submission to the last audio, as `sequential_requests` times the sequential engine
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


def sequential_requests(engine: Engine, frames: int, requests: int = 3) -> dict:
    """The sequential engine on the batching curve's requests, one at a time, compiled (what a
    single stream of the batching engine is compared with): each request from its text to
    its last audio, streamed (`Engine.stream`, audio every 16 frames) and whole
    (`Engine.synthesize`), in frames per second of that time (median)."""
    engine.compile()

    def streamed(i: int) -> float:
        t0, samples = time.perf_counter(), 0
        for piece in engine.stream(BATCH_TEXTS[i % len(BATCH_TEXTS)], seed=i, max_new_tokens=frames):
            samples += len(piece)
        return samples / engine.frame_length / (time.perf_counter() - t0)

    def whole(i: int) -> float:
        t0 = time.perf_counter()
        result = engine.synthesize(BATCH_TEXTS[i % len(BATCH_TEXTS)], seed=i, max_new_tokens=frames)
        return result.frames / (time.perf_counter() - t0)

    with start_up_frozen():
        streamed(0)  # warm-up
        out = {"stream_end_to_end_frames_per_s_median": statistics.median(streamed(i) for i in range(requests)),
               "whole_end_to_end_frames_per_s_median": statistics.median(whole(i) for i in range(requests))}
    print(json.dumps({"sequential": out}), flush=True)
    engine._step = None  # its graphs' memory back before the batching engine sizes its slots
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _admission_check(batcher) -> list[dict]:
    """Prompts admitted together (1, 3 and 8 of them, fewer with fewer slots), through a
    captured admission and through the compiled layers, against each prompt's prefill alone
    (the sequential engine's, eager): largest logit difference, and whether each row's most
    likely token is the same. Run before serving (it writes into free cache rows)."""
    engine, model, out = batcher.engine, batcher.model, []

    def alone(prompt: torch.Tensor, slot: int) -> torch.Tensor:
        compiled = [block.prefill_compiled for block in model.layers]
        for block in model.layers:
            block.prefill_compiled = None
        n = prompt.shape[1]
        logits = model.forward_slow(prompt[None].to(engine.device), model.positions[:n], n, row=slot)[0][0]
        for block, c in zip(model.layers, compiled):
            block.prefill_compiled = c
        return logits.float()

    with torch.inference_mode():
        for n in sorted({min(k, batcher.slots) for k in (1, 3, 8)}):
            prompts = [build_prompt(engine.tokenizer, engine.config.num_codebooks, [], BATCH_TEXTS[i % len(BATCH_TEXTS)])
                       for i in range(n)]
            reference = torch.stack([alone(p, i) for i, p in enumerate(prompts)])
            shape, captured, compiled = batcher._admissions_both_ways(prompts)
            level = {"prompts": n, "padded_shape": shape}
            for name, logits in (("captured", captured), ("compiled", compiled)):
                level[f"{name}_max_logit_diff"] = (logits - reference).abs().max().item()
                level[f"{name}_same_argmax"] = bool(torch.equal(logits.argmax(-1), reference.argmax(-1)))
            out.append(level)
    return out


def _codec_pieces_check(engine: Engine, pieces) -> tuple[float, float, float, float]:
    """A 300-frame decode in scheduled pieces (graphs and compiled back on CUDA): its largest
    difference from the same codes decoded in one piece, its speed in frames/s alone, 16
    different streams decoded side by side (`push_many`, fronts and backs stacked): their
    largest difference from each decoded alone in one piece, and their speed, the codec's
    ceiling on what the batching engine can turn into audio."""
    from fish_sm.engine.codec_stream import CodecStream, decode_in_pieces

    streams = 16
    codes = torch.randint(0, 1024, (streams, engine.config.num_codebooks, 300),
                          generator=torch.Generator().manual_seed(3)).to(engine.device)

    def side_by_side() -> torch.Tensor:
        states, at, out = [CodecStream() for _ in range(streams)], 0, []
        while at < codes.shape[-1]:
            n = min(pieces.next_frames(states[0]), codes.shape[-1] - at)
            out.append(torch.cat(pieces.push_many([(s, codes[i : i + 1, :, at : at + n]) for i, s in enumerate(states)])))
            at += n
        return torch.cat(out, dim=-1)

    with torch.inference_mode():
        one = codes[:1]
        diff = (decode_in_pieces(pieces, one) - engine.codec.decode(one)).abs().max().item()
        together = side_by_side()
        diff_many = max((together[i] - engine.codec.decode(codes[i : i + 1])[0]).abs().max().item() for i in range(streams))
        seconds = statistics.median(_timed(lambda: decode_in_pieces(pieces, one), engine.device) for _ in range(3))
        many = statistics.median(_timed(side_by_side, engine.device) for _ in range(3))
    return diff, codes.shape[-1] / seconds, diff_many, streams * codes.shape[-1] / many


COLD_WARM = """
import json, sys, time, logging
logging.basicConfig(level=logging.WARNING)
from fish_sm.serving.handler import model_fn
t0 = time.perf_counter()
model = model_fn(sys.argv[1])
total = time.perf_counter() - t0
from torch._dynamo.utils import counters  # where a warm start's compile time goes: cache hits or not
cache = {f"{group}.{k}": v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
captures = getattr(model.engine._step, "timings", {})  # the compile phase's graph captures, by kind
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


def targets_table(report: dict) -> str:
    """The speed and batching issues' figures against their targets (nvidia-h100-x1), as a
    Markdown table: what was measured in this run, the rest left out. The batching engine's
    first audio here is the engine's; over HTTP it is `fish-sm bench --stream`'s."""
    modes = {m["mode"]: m for m in report["modes"]}
    bf16, int8 = modes.get("bf16"), modes.get("int8")
    rows = []

    def row(figure, target, value, met):
        status = "" if met is None else "met" if met else "**not met**"
        rows.append(f"| {figure} | {target} | {value} | {status} |")

    if bf16:
        row("decode, bf16", ">= 600 frames/s", f"{bf16['decode_frames_per_s']:.1f} frames/s", bf16["decode_frames_per_s"] >= 600)
        row("prefill, 1,000-token prompt", "<= 30 ms", f"{bf16['prefill_ms']:.1f} ms", bf16["prefill_ms"] <= 30)
        row("codec decode, 10 s", "<= 50 ms", f"{bf16['codec_decode_10s_ms']:.1f} ms", bf16["codec_decode_10s_ms"] <= 50)
        row("time to first audio", "<= 120 ms", f"{bf16['time_to_first_audio_ms']:.0f} ms",
            bf16["time_to_first_audio_ms"] <= 120)
    if bf16 and int8:
        speed = int8["decode_frames_per_s"] / bf16["decode_frames_per_s"]
        share = int8["weight_gb"] / bf16["weight_gb"]
        row("decode, INT8 against bf16", ">= 1.15x", f"{speed:.2f}x", speed >= 1.15)
        row("INT8 weight memory", "<= 60% of bf16", f"{share:.1%}", share <= 0.6)
    for quantize, starts in report.get("model_fn", {}).items():
        first, warm = starts["first_start"]["total_s"], starts["warm_start"]["total_s"]
        row(f"first compile (model_fn, {quantize})", "<= 120 s", f"{first:.1f} s", first <= 120)
        runs = ", ".join(f"{t['total_s']:.1f}" for t in starts["warm_starts"])
        row(f"warm start (model_fn, {quantize})", "<= 20 s", f"{warm:.1f} s (median of {runs})", warm <= 20)
    for curve in report.get("batching", []):
        levels = {level["streams"]: level for level in curve["levels"] if level["stream"] and level.get("rounds", 1) == 1}
        loops = {level["streams"]: level for level in curve["levels"] if level["stream"] and level.get("rounds", 1) > 1}
        at32, one, seq = levels.get(32), levels.get(1), curve.get("sequential")
        label = f"batching, {curve['mode']}"
        # Two readings of the target each way: the decode loop's rate over its span (first frame
        # to last), and every frame over the whole wall (text to last audio).
        loop = loops.get(32)
        named = ([(f"32 streams, closed loop of {loop['rounds']} rounds", loop)] if loop else []) + (
            [("32 streams, one burst", at32)] if at32 else [])
        for name, level in named:
            # A closed loop is judged while all 32 clients are in it; over the whole loop, shown
            # unjudged, its end has fewer than 32 streams (clients whose requests stopped early are done).
            steady = level.get("steady_decode_frames_per_s")
            judged = steady is None
            target = ">= 6,000 frames/s" if judged else ""
            if not judged:
                row(f"{label}: {name}, decode while all 32 clients are in the loop "
                    f"({level['steady_window_s']:.2f} of {level['decode_span_s']:.2f} s)", ">= 6,000 frames/s",
                    f"{steady:,.0f} frames/s", steady >= 6000)
            if "aggregate_decode_frames_per_s" in level:
                decode = level["aggregate_decode_frames_per_s"]
                row(f"{label}: {name}, decode (first frame to last)", target, f"{decode:,.0f} frames/s",
                    decode >= 6000 if judged else None)
            total = level["aggregate_frames_per_s"]
            row(f"{label}: {name}, text to last audio", target, f"{total:,.0f} frames/s", total >= 6000 if judged else None)
        if at32:
            row(f"{label}: each of 32 streams", ">= 5x real time", f"{at32['per_request_realtime_x_min']:.2f}x (slowest)",
                at32["per_request_realtime_x_min"] >= 5)
            row(f"{label}: first audio p95 at 32 (engine, not HTTP)", "<= 300 ms", f"{at32['first_audio_ms_p95']:.0f} ms",
                at32["first_audio_ms_p95"] <= 300)
        if one and seq:  # judged against the sequential engine's faster way (whole, as its server runs)
            whole = one["end_to_end_frames_per_s_median"] / seq["whole_end_to_end_frames_per_s_median"]
            streamed = one["end_to_end_frames_per_s_median"] / seq["stream_end_to_end_frames_per_s_median"]
            row(f"{label}: 1 stream (streamed) against the sequential engine, text to last audio", "within 5%",
                f"{whole - 1:+.1%} against its whole synthesis, {streamed - 1:+.1%} against its stream", whole >= 0.95)
        if one and bf16 and curve["mode"] == "bf16":
            ratio = one["per_request_decode_frames_per_s_median"] / bf16["decode_short_prompt_frames_per_s"]
            row(f"{label}: 1 stream's decode against the sequential decode loop (no codec)", "within 5%",
                f"{ratio - 1:+.1%}", ratio >= 0.95)
    if not rows:
        return ""
    return "\n".join(["| figure | target | measured | |", "| --- | --- | --- | --- |", *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--modes", default="eager,bf16,int8")
    p.add_argument("--frames", type=int, default=500)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--device", default="auto")
    p.add_argument("--cold-warm", action="store_true", help="also time model_fn cold and from the persisted cache")
    p.add_argument("--batching", help="also measure the batching engine at these stream counts, e.g. 1,4,8,16,32,64")
    p.add_argument("--batching-frames", type=int, default=300, help="frames per request in --batching")
    p.add_argument("--batching-modes", default="bf16", help="weights for --batching: bf16, int8 or both")
    p.add_argument("--batching-rounds", type=int, default=3,
                   help="also run --batching's streamed levels as a closed loop of this many requests a client (1: not)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV length per request in --batching")
    p.add_argument("--profile", action="store_true", help="also profile the decode step's kernels (CUDA)")
    p.add_argument("--json", help="write the report here too")
    a = p.parse_args(argv)
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "date": date.today().isoformat(), "checkpoint": a.checkpoint, "modes": [],
    }

    def save(part: dict) -> None:  # as each part finishes, so a cut-off run keeps what it measured
        print(json.dumps(part, indent=2), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=2)

    for mode in filter(None, a.modes.split(",")):
        report["modes"].append(run_mode(a.checkpoint, mode, a.frames, a.repeats, a.prompt_tokens, a.device, a.profile))
        save(report["modes"][-1])
    if a.batching:
        streams = [int(n) for n in a.batching.split(",")]
        for mode in a.batching_modes.split(","):
            report.setdefault("batching", []).append(
                batching_curve(a.checkpoint, mode, streams, a.batching_frames, a.max_seq_len, a.device, a.profile,
                               a.batching_rounds))
            save(report["batching"][-1])
    if a.cold_warm:
        report["model_fn"] = {}
        for quantize in [q for mode, q in (("bf16", "none"), ("int8", "int8")) if mode in a.modes] or ["none"]:
            report["model_fn"][quantize] = cold_warm(a.checkpoint, quantize)
            save(report["model_fn"][quantize])
    table = targets_table(report)
    if table:
        print(f"\n{report['device']}, torch {report['torch']}, {report['date']}\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

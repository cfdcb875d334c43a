"""What several experiments here share. Not part of the package. Scripts run as
`python docs/experiments/NAME.py` find it on sys.path (the script's own folder)."""
import collections, json, os, statistics, time

import torch

from fish_sm.engine.batching import Job
from fish_sm.engine.benchmark import (BATCH_TEXTS, SENTENCE, batching_curve, batching_level,
                                      compare_compiled_to_eager, measure)
from fish_sm.engine.codec_stream import Captures, CodecStream
from fish_sm.engine.engine import Engine
from fish_sm.engine.prompt import build_prompt
from fish_sm.engine.sampling import SamplingParams


def graphed_us(fn, calls=100):
    """Microseconds a call, replayed from one CUDA graph of `calls` calls."""
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (5 * calls) * 1e6


def synchronised(spent: dict, name: str, fn):
    """`fn`, its wall time with the GPU synchronized before and after added to spent[name]."""
    def run(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t
    return run


def timed_calls(fn, done):
    """`fn`, calling done(start, end) (time.perf_counter) after each of its calls."""
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            done(t0, time.perf_counter())
    return run


def time_replays(done) -> None:
    """Every `GraphedStep` call (a decode step's replay) timed from now on: done(rows, start,
    end, t0, t1) after each, `start`/`end` CUDA events recorded around it on its stream, t0/t1
    `time.perf_counter` before the first and after the second."""
    from fish_sm.engine.generate import GraphedStep

    replay = GraphedStep.__call__

    def run(self, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        out = replay(self, *args, **kwargs)
        end.record()
        done(args[1].shape[0], start, end, t0, time.perf_counter())
        return out

    GraphedStep.__call__ = run


def capture_on(stream, fn) -> None:
    """`fn` with `stream` current and as the stream `torch.cuda.graph` captures on (a graph's
    kernels keep to the SMs of the green context whose stream it was captured on)."""
    before, torch.cuda.graph.default_capture_stream = torch.cuda.graph.default_capture_stream, stream
    try:
        with torch.cuda.stream(stream):
            fn()
    finally:
        torch.cuda.graph.default_capture_stream = before
    torch.cuda.synchronize()


def recapture_codec(worker, retired: list) -> None:
    """A batching engine's `CodecWorker` graphs captured again (on the current stream, see
    `capture_on`), into a pool of their own; the old ones kept alive in `retired` (dropping
    every graph of a pool trips an allocator assert when it is captured into again)."""
    sc = worker.codec
    retired.append((dict(sc.graphs), dict(sc.full.graphs), dict(sc.back.graphs)))
    sc.graphs.clear(), sc.full.graphs.clear(), sc.back.graphs.clear()
    stream = torch.cuda.current_stream()
    sc.captures = sc.full.captures = Captures(stream.device, stream=stream, tf32=sc.captures.tf32)
    worker.capture(pieces=12)


def recaptured_steps(batcher) -> dict:
    """A compiled batching engine's decode steps and first frames captured again, as
    `BatchEngine.compile` captures them (with the layers as compiled now), into a pool of their
    own: the new graphs, also left in place (the old ones stay alive with whoever holds them)."""
    step = batcher._step
    step.graphs, step.pool = {}, torch.cuda.graph_pool_handle()
    step.capture_all(batcher.batch_sizes)
    return dict(step.graphs)


def kernels_ms(prof, width: int = 90) -> collections.Counter:
    """A finished CUDA profile's kernel time in ms by name (cut to `width` characters)."""
    by_name = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:width]] += e.device_time_total / 1e3
    return by_name


def compiled_batcher(checkpoint: str, most_streams: int) -> tuple:
    """A batching engine as the benchmark runs it (KV 2,048, bf16, CUDA) for up to
    `most_streams`, compiled: (it, the start of an experiment's record)."""
    from fish_sm.engine import Engine
    from fish_sm.engine.batching import BatchEngine

    batcher = BatchEngine(Engine.from_pretrained(checkpoint, device="cuda", max_seq_len=2048),
                          max_batch=most_streams, max_queue=0)
    t0 = time.perf_counter()
    batcher.compile()
    return batcher, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "compile_s": time.perf_counter() - t0}


# What a level's short line shows (the JSON files keep everything).
LEVEL_SUMMARY = ("aggregate_frames_per_s", "per_request_decode_frames_per_s_median", "per_request_realtime_x_min",
                 "first_audio_ms_p50", "first_audio_ms_p95", "wall_s")
# ... and with closed loops among the levels (see `_levels`' `loops`).
LOOP_SUMMARY = ("rounds", "aggregate_frames_per_s", "aggregate_decode_frames_per_s", "steady_decode_frames_per_s",
                "per_request_decode_frames_per_s_median", "stopped_early", "first_audio_ms_p95")


def _levels(batcher, streams: list[int], frames: int, tag: dict, summary: tuple | None = None,
            loops: tuple = (1,)) -> list[dict]:
    """`batcher` started and warmed up, then `batching_level` at each number of streamed
    requests, as a burst and as closed loops of each of `loops` requests a client (1: a burst
    only); one JSON line per level (all of it, or `tag`, the streams and `summary`)."""
    levels = []
    with batcher:
        batcher.submit(Job(BATCH_TEXTS[0], params=SamplingParams(seed=0, max_new_tokens=8))).result()
        for n in streams:
            for rounds in loops:
                level = {**tag, **batching_level(batcher, n, frames, True, rounds=rounds)}
                shown = level if summary is None else {k: level[k] for k in (*tag, "streams", *summary) if k in level}
                print(json.dumps(shown), flush=True)
                levels.append(level)
    return levels


def levels_in_turns(batchers: dict, streams: list[int], rounds: int, label: str, frames: int = 200) -> list[dict]:
    """Each named BatchEngine in turn, `rounds` times (so that drift shows): `_levels`."""
    return [level for round_ in range(rounds) for name, batcher in batchers.items()
            for level in _levels(batcher, streams, frames, {label: name, "round": round_})]


def settings_in_turns(batcher, settings: dict, streams: list[int], rounds: int, label: str,
                      frames: int = 200, loops: tuple = (1,), summary: tuple = LEVEL_SUMMARY) -> list[dict]:
    """One BatchEngine under each named setting in turn (`settings[name]()` applies it),
    `rounds` times: `_levels`, one short line per level."""
    levels = []
    for round_ in range(rounds):
        for name, apply in settings.items():
            apply()
            levels += _levels(batcher, streams, frames, {label: name, "round": round_}, summary, loops)
    return levels


def compiled_variant(checkpoint: str, mode: str, name: str, out: dict, save=lambda: None,
                     prepare=lambda engine: None, facts=lambda engine: {}) -> Engine:
    """An engine of `mode` weights (bf16 or int8), `prepare(engine)` run before it compiles
    (captures its frames: settings read then are fixed from there on); its compile seconds,
    `facts(engine)` and the compiled-against-eager check into out["variants"][name], printed,
    then `save`."""
    engine = Engine.from_pretrained(checkpoint, device="cuda")
    if mode == "int8":
        engine.quantize_int8()
    prepare(engine)
    t0 = time.perf_counter()
    engine.compile()
    info = {"compile_s": time.perf_counter() - t0, **facts(engine),
            "compiled_vs_eager": compare_compiled_to_eager(
                engine, build_prompt(engine.tokenizer, engine.config.num_codebooks, [], SENTENCE))}
    out["variants"][name] = info
    print(name, json.dumps(info), flush=True)
    save()
    return engine


def decode_in_turns(engines: dict, rounds: int, out: dict, save=lambda: None, before=lambda name: None) -> None:
    """Each named engine's `measure` (decode of a 1,098-token prompt, 2 x 400 frames) in turn,
    `rounds` times, so that drift between them shows: into out["rounds"], then each one's
    median into out["decode_frames_per_s_median"], printed; `save` after every measurement and
    at the end, `before(name)` before each."""
    for round_ in range(rounds):
        for name, engine in engines.items():
            before(name)
            m = measure(engine, 400, 2, 1000)
            out["rounds"].append({"variant": name, "round": round_, **m})
            print(name, round_, round(m["decode_frames_per_s"], 1), flush=True)
            save()
    out["decode_frames_per_s_median"] = {name: statistics.median(r["decode_frames_per_s"] for r in out["rounds"]
                                                                  if r["variant"] == name) for name in engines}
    print(json.dumps(out["decode_frames_per_s_median"]), flush=True)
    save()


def stream_all(sc, codes: list) -> float:
    """Seconds for `StreamingCodec` `sc` to decode each of `codes` ([1, rows, frames] each) as
    its own stream, every stream's piece k in one `push_many` (as the batching codec batches)."""
    streams = [CodecStream() for _ in codes]
    frames = codes[0].shape[-1]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    at = 0
    while at < frames:
        m = min(sc.next_frames(streams[0]), frames - at)
        sc.push_many([(s, c[..., at:at + m]) for s, c in zip(streams, codes)])
        at += m
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def curves_by_variant(checkpoint: str, streams: list[int], variants: list[str], set_variant, name: str,
                      profile: bool = False) -> dict:
    """`benchmark.batching_curve` (bf16, 200 frames a request, 2,048 slots) once per variant, one
    after another in this process, `set_variant(variant)` before each; printed as it goes and
    written to $OUT/NAME.json after each."""
    out = {}
    for variant in variants:
        set_variant(variant)
        out[variant] = batching_curve(checkpoint, "bf16", streams, 200, 2048, "cuda", profile=profile)
        print(variant, json.dumps({k: v for k, v in out[variant].items() if k not in ("levels", "sequential", "profile")}),
              flush=True)
        for level in out[variant]["levels"]:
            print(variant, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in level.items()}),
                  flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), name + ".json"), "w") as f:
            json.dump(out, f, indent=1)
    return out

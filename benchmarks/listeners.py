"""Closed-loop listeners against one batching engine in this process, as `fish-sm capacity
--listeners` runs them over HTTP (the same mix, population and playback model), with what the
HTTP run cannot see: where each underrun came from. Each stream's frames are timed as they reach
the codec thread and its audio as it leaves it; a listener's wait is the decode's while the frames
of the piece that ends it were not yet decoded, the codec's after.

    python benchmarks/listeners.py CHECKPOINT [--listeners 512,576,640] [--duration 30]
        [--max-seq-len 2048] [--variant spare_s=0.6 ...] [--profile-s 3] [--out DIR]

The engine starts as `fish-sm serve` starts it (`start_engine`, FISH_SM_* settings; here
FISH_SM_BENCHMARK_LENGTHS=true and FISH_SM_CAPTURE=all unless set), so a level runs with every
graph captured. Instruments only its own engine object (wrapping five of its codec worker's
methods on the instance). One JSON line per level; DIR/listeners.json (DIR: --out, else $OUT,
else .). On a CPU it runs on a tiny checkpoint, to check the script.

`--variant NAME=VALUE,...` (repeatable) runs every level once more, after the levels as shipped,
with those attributes set on this engine object. The codec worker's: `spare_s` (a piece whose
listener has less audio left goes beside a batch on the GPU rather than wait for company),
`depth` (batches on the GPU at once), `max_frames` (frames a batch holds at most), `stream=decode`
(the codec's work queued on the decode loop's CUDA stream, one after the other, instead of its own
stream beside it; the engine's threads restarted to take it). The scheduler's: `horizon_s` (slack
past which a stream yields its turn). Both's: `piece_repeats` (pieces of each length on the codec's
ramp, `PieceSchedule`). `codec_rows=N` (1 or 2) keeps only the codec's graphs of N batch sizes
an octave (`batch_sizes`; 4 are captured), so that its batches pad more (for an A/B in one
process; it cannot be undone, so it goes in the last variants, the fewest sizes last).

`--profile-s S` records S seconds of the GPU's work (torch.profiler, CUDA activity only) from the
middle of each level: each CUDA stream's busy time, the decode's and the codec's together, and
the GPU's busy fraction (the union of every stream's kernels and copies) over the window. The
profiler's stop stalls the engine: such a level's listener figures are not comparable.

Each level also reports its busy part (`busy`: from a third of its asking time to its end, not
the drain after, whose lighter steps dilute the level's averages): the decode step's period and
rows, host and wait time per step, prefills, and the gap between a stream's frames before its
first piece, on its codec pieces' ramp and after it."""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import queue
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks` run as a file


class Recorder:
    """What the engine's threads hand the codec thread, and what it runs: (time, lanes) per
    step's frames and (time, lane, ticket) per stream opened, in the engine thread's order;
    (time, pieces, frames) per codec batch, and each batch's seconds from launch to delivery with
    the batches already on the GPU when it was launched; the garbage collector's pauses; the
    engine thread's decode steps (time, rows) and prefills (time, chunks)."""

    def __init__(self, batcher):
        worker = batcher._codec
        self.events: list = []
        self.batches: list = []
        self.latencies: list = []
        self.thread_s = {"launch": 0.0, "finish": 0.0}  # the codec thread's time in each
        open_, frames, push = worker.open, worker.frames, worker.codec.push
        launch, finish = worker._launch, worker._finish
        clock = time.perf_counter
        launched: dict = {}

        def launching():
            at, ahead = clock(), len(worker._flying)
            batch = launch()
            self.thread_s["launch"] += clock() - at
            if batch is not None:
                launched[id(batch)] = (at, ahead)
            return batch

        def finishing(batch):
            began = clock()
            finish(batch)
            self.thread_s["finish"] += clock() - began
            at, ahead = launched.pop(id(batch), (None, 0))
            if at is not None:
                self.latencies.append((clock() - at, ahead))

        def opened(lane, ticket):
            self.events.append((clock(), lane, ticket))
            return open_(lane, ticket)

        def framed(lanes, codes):
            self.events.append((clock(), np.array(lanes), None))
            return frames(lanes, codes)

        def pushed(lanes, pieces, codes, taken, **options):
            self.batches.append((clock(), len(lanes), int(np.sum(taken))))
            return push(lanes, pieces, codes, taken, **options)

        worker.open, worker.frames, worker.codec.push = opened, framed, pushed
        worker._launch, worker._finish = launching, finishing
        self.steps: list = []  # (time, rows) per decode step queued
        self.starts: list = []  # (time, chunks) per iteration that prefilled chunks
        decode, start_chunks = batcher.runner.decode, batcher._start_chunks

        def decoding(slots):
            self.steps.append((clock(), len(slots)))
            return decode(slots)

        def starting(requests):
            if requests:
                self.starts.append((clock(), len(requests)))
            return start_chunks(requests)

        batcher.runner.decode, batcher._start_chunks = decoding, starting
        self.pauses: list = []  # (generation, seconds) of each collection
        started: list = [0.0]

        def collected(phase, info):
            if phase == "start":
                started[0] = clock()
            else:
                self.pauses.append((info["generation"], clock() - started[0]))

        gc.callbacks.append(collected)

    def clear(self) -> None:
        self.events, self.batches, self.latencies, self.pauses = [], [], [], []
        self.steps, self.starts = [], []
        self.thread_s = {"launch": 0.0, "finish": 0.0}

    def frame_times(self) -> dict[int, list[float]]:
        """Each ticket's (by id) frames' arrival times at the codec thread."""
        owner: dict[int, int] = {}
        times: dict[int, list[float]] = {}
        for t, lanes, ticket in self.events:
            if ticket is not None:
                owner[lanes] = id(ticket)
                times[id(ticket)] = []
                continue
            for lane in lanes.tolist():
                who = owner.get(lane)
                if who is not None:
                    times[who].append(t)
        return times


def percentiles_ms(seconds: list[float]) -> dict | None:
    return {q: 1e3 * float(np.percentile(seconds, q)) for q in (50, 90, 99)} if seconds else None


def first_audio_parts(records: dict, frame_times: dict, first_piece: int) -> dict:
    """Streamed requests' first audio in parts (p50/p90/p99 ms): waiting for a slot (`queue`),
    from admission to the first frame at the codec thread (prefill), from there to the first
    piece's last frame (decode steps), and from there to its audio (the codec)."""
    parts: dict[str, list[float]] = {"queue": [], "prefill": [], "first_piece_frames": [], "codec": []}
    for key, record in records.items():
        arrived, ticket = frame_times.get(key, []), record["ticket"]
        if (not record["planned"].body.get("stream") or not record["audio"] or len(arrived) < first_piece
                or "queue" not in ticket.timings):
            continue
        admitted = record["sent"] + ticket.timings["queue"]
        parts["queue"].append(ticket.timings["queue"])
        parts["prefill"].append(arrived[0] - admitted)
        parts["first_piece_frames"].append(arrived[first_piece - 1] - arrived[0])
        parts["codec"].append(record["audio"][0][0] - arrived[first_piece - 1])
    return {name: percentiles_ms(values) for name, values in parts.items()}


class GpuWindow:
    """The GPU's work recorded for `seconds` from `start_s` into a level (CUDA activity only; on
    a CPU, the CPU's, to check the script), summarised once the level is over. Stopping the
    profiler holds the GIL for a while, stalling the engine's threads: a level with a window
    measures the GPU, not its listeners."""

    def __init__(self, start_s: float, seconds: float):
        self.start_s, self.seconds = start_s, seconds
        self.profile, self.summary, self.stopped = None, None, False

    def poll(self, elapsed_s: float) -> None:
        import torch

        if self.seconds and self.profile is None and elapsed_s >= self.start_s:
            activity = torch.profiler.ProfilerActivity
            self.profile = torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU])
            self.profile.__enter__()
        elif self.profile is not None and not self.stopped and elapsed_s >= self.start_s + self.seconds:
            self.profile.__exit__(None, None, None)  # (recorded to the level's end, a loaded GPU's trace is too large to read)
            self.stopped = True

    def finish(self) -> None:
        """Stop (if the level ended first) and summarise."""
        if self.profile is not None and self.summary is None:
            if not self.stopped:
                self.profile.__exit__(None, None, None)
                self.stopped = True
            self.summary = gpu_window(self.profile, self.seconds)


def gpu_window(prof, window_s: float) -> dict:
    """Over the first `window_s` seconds of the recorded GPU work: each stream's busy ms, the
    decode's and codec's overlap, and the union of every stream's work against the window."""
    from benchmarks.batching_profile import chrome_trace, overlap_ms, reported, stream_times, union

    spans = [e for e in chrome_trace(prof) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    began = min((e["ts"] for e in spans), default=0.0)
    streams = stream_times([e for e in spans if e["ts"] < began + 1e6 * window_s])
    merged = union(iv for s in streams.values() for iv in s["intervals"])
    ranked = sorted(streams, key=lambda s: (not streams[s]["decode"], -streams[s]["busy_ms"]))
    out = {"window_ms": 1e3 * window_s, "gpu_busy_ms": sum(hi - lo for lo, hi in merged) / 1e3,
           "streams": {str(s): reported(streams[s], 1) for s in ranked}}
    out["gpu_busy_fraction"] = out["gpu_busy_ms"] / out["window_ms"]
    if len(ranked) > 1:
        out["decode_and_codec_together_ms"] = overlap_ms(streams[ranked[0]]["intervals"], streams[ranked[1]]["intervals"])
    return out


def run_level(batcher, recorder: Recorder, listeners: int, duration_s: float, seed: int, profile_s: float = 0.0) -> dict:
    from fish_sm.clients.bench import REJECTED
    from fish_sm.clients.capacity import Mix, Population, StreamSample, playback_waits, summarize_level
    from fish_sm.contract import SamplingParams
    from fish_sm.engine.batching import Job, Overloaded

    engine = batcher.engine
    frame_s = engine.frame_length / engine.sample_rate
    population = Population(Mix(), listeners, duration_s, seed)
    due = [(p.at_s, p.index, p) for p in population.first()]
    heapq.heapify(due)
    finished: queue.SimpleQueue = queue.SimpleQueue()
    records = {}
    recorder.clear()
    stats_before = batcher.stats.snapshot()
    codec = batcher._codec.codec
    run_before, given_before = codec.frames_run, codec.frames_given
    t0 = time.perf_counter()

    def submit(planned) -> None:
        body = planned.body
        record = {"planned": planned, "sent": time.perf_counter(), "audio": [], "error": None}
        job = Job(body["text"], chunk_length=body["chunk_length"], stream=bool(body.get("stream")),
                  params=SamplingParams(max_new_tokens=body["max_new_tokens"], seed=body["seed"]))

        def sink(event, record=record):
            kind, payload = event
            if kind == "audio":
                record["audio"].append((time.perf_counter(), len(payload)))
            elif kind in ("done", "error"):
                record["end"] = time.perf_counter()
                record["error"] = payload if kind == "error" else None
                finished.put(record)

        try:
            record["ticket"] = batcher.submit(job, sink)
        except Overloaded as exc:  # a full engine refuses it, as the server's 503 does
            record.update(end=time.perf_counter(), error=exc, kind=REJECTED)
            finished.put(record)
            return
        records[id(record["ticket"])] = record

    def sample(record) -> StreamSample:
        planned, rate = record["planned"], engine.sample_rate
        sent = record["sent"] - t0
        pieces = [(t - t0, n / rate) for t, n in record["audio"]]
        fields = dict(streams=None, index=planned.index, at_s=planned.at_s, mode="stream" if planned.body.get("stream") else "whole",
                      voice="none", text_chars=len(planned.body["text"]), intended_s=planned.intended_s,
                      listeners=listeners, listener=planned.listener, late_s=max(0.0, sent - planned.at_s))
        if record["error"] is not None:
            return StreamSample(ok=False, kind=record.get("kind", "error"), latency_s=record["end"] - record["sent"],
                                error=str(record["error"]), **fields)
        audio = sum(s for _, s in pieces)
        if fields["mode"] == "whole":
            return StreamSample(ok=True, kind="ok", latency_s=record["end"] - record["sent"], audio_seconds=audio,
                                first_audio_s=record["end"] - record["sent"], **fields)
        record["waits"] = waits = playback_waits(pieces)[0]
        return StreamSample(ok=True, kind="ok", latency_s=record["end"] - record["sent"],
                            first_audio_s=pieces[0][0] - sent if pieces else None, audio_seconds=audio,
                            underrun_s=sum(came - ran_out for ran_out, came, _, _ in waits), underruns=len(waits),
                            **fields)

    samples, outstanding = [], 0
    window = GpuWindow(duration_s / 2, profile_s)
    busy = {}  # the engine's counters as the busy part of the level begins and ends
    while due or outstanding:
        now = time.perf_counter() - t0
        window.poll(now)
        for edge, at in (("began", BUSY_FROM * duration_s), ("ended", duration_s)):
            if edge not in busy and now >= at:
                busy[edge] = (time.perf_counter(), batcher.stats.snapshot())
        while due and due[0][0] <= now:
            submit(heapq.heappop(due)[2])
            outstanding += 1
        wait = min(max(0.0, due[0][0] - now) if due else 1.0, 0.1)
        try:
            record = finished.get(timeout=wait)
        except queue.Empty:
            continue
        outstanding -= 1
        record["sample"] = s = sample(record)
        samples.append(s)
        nxt = population.after(s)
        if nxt is not None:
            heapq.heappush(due, (nxt.at_s, nxt.index, nxt))
    wall = time.perf_counter() - t0
    window.finish()
    level = summarize_level(samples, wall, listeners, len(samples) / duration_s, duration_s, population="closed loop")

    # Where the waits came from: the decode (the piece's last frame not yet at the codec thread
    # when playback ran out) or the codec (after it).
    frame_times = recorder.frame_times()
    decode_s = codec_s = 0.0
    heard_at = []  # audio seconds a listener had heard when playback ran out
    for key, record in records.items():
        arrived = frame_times.get(key, [])
        for ran_out, came, before, heard in record.get("waits", []):  # (seconds after t0)
            ran_out, came = ran_out + t0, came + t0
            heard_at.append(before)
            last = min(len(arrived), max(1, round(heard / frame_s))) - 1
            decoded = arrived[last] if last >= 0 else came
            decode_s += max(0.0, min(decoded, came) - ran_out)
            codec_s += came - max(ran_out, min(decoded, came))
    after = batcher.stats.snapshot()
    steps = after["steps"] - stats_before["steps"]
    rows = sum(len(lanes) for _, lanes, ticket in recorder.events if ticket is None)
    batches = np.array([(n, f) for _, n, f in recorder.batches] or [(0, 0)], float)
    level["where"] = {
        "underrun_decode_s": decode_s, "underrun_codec_s": codec_s,
        "decode_steps": steps, "rows_per_step": rows / steps if steps else 0.0,
        "iteration_ms": 1e3 * (after["wall_s"] - stats_before["wall_s"]) / max(1, after["iterations"] - stats_before["iterations"]),
        "frames_per_s": rows / wall, "codec_batches": len(recorder.batches),
        "stall_at_audio_s": {q: float(np.percentile(heard_at, q)) for q in (10, 50, 90)} if heard_at else None,
        "codec_pieces_per_batch": float(batches[:, 0].mean()), "codec_frames_per_batch": float(batches[:, 1].mean()),
        "codec_padding": 1 - (codec.frames_given - given_before) / max(1, codec.frames_run - run_before),
        "codec_batch_ms": percentiles_ms([t for t, _ in recorder.latencies]),
        "codec_batch_ms_alone": percentiles_ms([t for t, ahead in recorder.latencies if not ahead]),
        "codec_batch_ms_behind_another": percentiles_ms([t for t, ahead in recorder.latencies if ahead]),
        "first_audio_parts_ms": first_audio_parts(records, frame_times, batcher.scheduler.pieces.first),
        "gc_pauses": {"count": len(recorder.pauses), "total_s": sum(t for _, t in recorder.pauses),
                      "max_ms": 1e3 * max((t for _, t in recorder.pauses), default=0.0),
                      "full": sum(1 for g, _ in recorder.pauses if g == 2)},
        "codec_thread_fraction": {k: v / wall for k, v in recorder.thread_s.items()},
    }
    if len(busy) == 2:
        streamed = {key: frame_times.get(key, []) for key, record in records.items() if record["planned"].body.get("stream")}
        level["busy"] = busy_summary(recorder, streamed, busy["began"], busy["ended"], batcher.scheduler.pieces)
    if window.summary is not None:
        level["gpu_window"] = window.summary
        start = t0 + duration_s / 2
        level["gpu_window"]["decode_steps"] = sum(1 for t, _ in recorder.steps if start <= t < start + profile_s)
    return level


BUSY_FROM = 1 / 3  # the busy part of a level: from this share of its asking time to its end


def busy_summary(recorder: Recorder, frame_times: dict, began: tuple, ended: tuple, pieces) -> dict:
    """The engine while every listener is asking (not the level's drain, whose lighter steps
    dilute its averages): the decode step's period and rows, host and wait time per step (host
    time by phase), how often a step also prefilled, and the gap between a stream's frames before
    its first codec piece, on the pieces' ramp and after it (`pieces`: the `PieceSchedule`;
    streams only)."""
    (t_from, before), (t_to, after) = began, ended
    steps = np.array([(t, n) for t, n in recorder.steps if t_from <= t < t_to], float).reshape(-1, 2)
    starts = [n for t, n in recorder.starts if t_from <= t < t_to]
    count = max(1, after["steps"] - before["steps"])
    per_step = {k: 1e3 * (after[k] - before[k]) / count for k in ("wall_s", "host_s", "host_cpu_s", "wait_s", "launch_s")}
    phases = {k: round(1e3 * (after["phases_s"][k] - before["phases_s"][k]) / count, 3) for k in after["phases_s"]}
    gaps: dict[str, list] = {"first_piece": [], "ramp": [], "steady": []}
    for arrived in frame_times.values():
        for i in range(1, len(arrived)):
            if t_from <= arrived[i - 1] and arrived[i] < t_to:
                part = "first_piece" if i < pieces.first else "ramp" if i < pieces.ramp_end else "steady"
                gaps[part].append(arrived[i] - arrived[i - 1])
    return {"seconds": t_to - t_from, "decode_steps": len(steps),
            "step_period_ms": percentiles_ms(np.diff(steps[:, 0]).tolist()),
            "rows_per_step": {"mean": float(steps[:, 1].mean()), "p90": float(np.percentile(steps[:, 1], 90))}
            if len(steps) else None,
            "frames_per_s": float(steps[:, 1].sum() / (t_to - t_from)),
            "prefills_per_s": len(starts) / (t_to - t_from), "chunks_per_prefill": float(np.mean(starts)) if starts else 0.0,
            "per_step_ms": {k.replace("_s", "_ms"): round(v, 3) for k, v in per_step.items()}, "phase_ms_per_step": phases,
            "frame_gap_ms": {k: percentiles_ms(v) for k, v in gaps.items()}}


def keep_sizes(codec, per_octave: int) -> None:
    """Only the codec's graphs of `per_octave` batch sizes an octave kept: its batches pad more."""
    from fish_sm.engine.generate import batch_sizes

    for graphs in (codec.fronts, codec.backs):
        for n, rows in list(graphs):
            if rows not in batch_sizes(codec._most_rows(n), per_octave):
                del graphs[(n, rows)]
    codec._fitting.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--listeners", default="512,576,640", help="listener counts, comma-separated")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of asking a level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV length per request")
    p.add_argument("--device", default="auto")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE,...",
                   help="also run every level with these codec worker or scheduler attributes set (repeatable)")
    p.add_argument("--profile-s", type=float, default=0.0, help="seconds of GPU work to record from the middle of each level")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where listeners.json goes")
    args = p.parse_args()
    os.environ.setdefault("FISH_SM_BENCHMARK_LENGTHS", "true")
    os.environ.setdefault("FISH_SM_CAPTURE", "all")
    os.environ.setdefault("FISH_SM_MAX_SEQ_LEN", str(args.max_seq_len))
    import torch

    from fish_sm.engine.codec_stream import CODEC_SIZES_PER_OCTAVE
    from fish_sm.engine.pieces import PieceSchedule
    from fish_sm.serving.core import devices, start_engine
    from fish_sm.settings import Settings

    device = devices()[0] if args.device == "auto" else args.device
    began = time.perf_counter()
    _, batcher = start_engine(Path(args.checkpoint), device, Settings.from_env())
    print(f"engine ready in {time.perf_counter() - began:.1f} s with {batcher.slots} slots on "
          f"{torch.cuda.get_device_name() if device.startswith('cuda') else device}", flush=True)
    recorder = Recorder(batcher)
    levels = []
    try:
        worker, scheduler = batcher._codec, batcher.scheduler
        owners = {name: worker for name in ("spare_s", "depth", "max_frames")}
        owners["horizon_s"] = scheduler
        shipped = {name: getattr(owner, name) for name, owner in owners.items()}
        streams = {"own": worker._cuda, "decode": batcher.decode_stream}
        shipped["stream"] = "own"
        shipped["piece_repeats"] = scheduler.pieces.repeats
        shipped["codec_rows"] = CODEC_SIZES_PER_OCTAVE
        for variant in [""] + args.variant:
            settings = dict(shipped)
            for item in filter(None, variant.split(",")):
                name, _, value = item.partition("=")
                if (name not in shipped or (name == "stream" and value not in streams)
                        or (name == "codec_rows" and value not in ("1", "2"))):
                    raise SystemExit(f"--variant {item!r}: one of {', '.join(shipped)} (stream: own or decode; "
                                     "codec_rows: 1 or 2)")
                settings[name] = value if isinstance(shipped[name], str) else type(shipped[name])(float(value))
            for name, owner in owners.items():
                setattr(owner, name, settings[name])
            pieces = scheduler.pieces  # (between levels: every stream has ended)
            scheduler.pieces = worker.codec.schedule = PieceSchedule(pieces.first, pieces.largest, settings["piece_repeats"])
            if settings["codec_rows"] != CODEC_SIZES_PER_OCTAVE:
                keep_sizes(worker.codec, settings["codec_rows"])
            if streams[settings["stream"]] is not worker._cuda:  # the threads take their streams as they start
                batcher.stop()
                worker._cuda = streams[settings["stream"]]
                batcher.start()
            for n in [int(x) for x in args.listeners.split(",")]:
                level = run_level(batcher, recorder, n, args.duration, args.seed, args.profile_s)
                level["variant"] = settings
                levels.append(level)
                keep = {k: level[k] for k in ("variant", "listeners", "requests", "ok", "first_audio_ms", "underrun",
                                              "audio_seconds_per_wall_second", "passed", "where", "busy", "gpu_window")
                        if k in level}
                print(json.dumps(keep), flush=True)
    finally:
        batcher.stop()
    out = Path(args.out) / "listeners.json"
    out.write_text(json.dumps({"device": device, "levels": levels}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

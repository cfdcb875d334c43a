"""Load tests: closed-loop clients at several concurrencies against an endpoint, a URL or a local server.

Each concurrency level runs its requests through a pool of that many threads (each thread
sends its next request when the last one is answered), so the level measures what that many
simultaneous users see. Figures: latency percentiles, requests per second, audio seconds
produced per wall second (the capacity figure for TTS), real-time factor, errors by kind,
and requests the server rejected because it was full (503 with Retry-After: counted, not
retried, as a client that gives up would see it). With streaming, also the time to the
first audio byte, which is what a listener waits for.
Every answer must be audio of the format asked for (response.check_audio): anything else is an
error of kind "not audio". A level passes when the share of its requests that brought no audio
is within the run's max_error_rate; a percentile over too few samples carries a warning.
The report (table, JSON, HTML) is fish_sm.clients.report's.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import fish_sm
from fish_sm.aws.pricing import usd_per_audio_hour
from fish_sm.clients.response import ServiceError, check_audio
from fish_sm.contract import AUDIO_TYPES, STREAM_FORMATS
from fish_sm.errors import InputError

# Varied lengths on purpose: TTS latency grows with the audio produced, so a benchmark of one
# short sentence says little about a service that reads paragraphs.
BUILTIN_TEXTS = [
    "Hello.",
    "Your order has shipped and will arrive on Thursday.",
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "Please hold while I transfer your call. A member of our team will be with you in just a moment, "
    "and we appreciate your patience.",
    "In the beginning, the river was only a thin line of silver between the hills. Over many centuries it "
    "cut deeper, carrying sand and stone to the sea, until the valley we know today took shape around it.",
    "Welcome to the quarterly review. Revenue grew eleven percent over the previous quarter, driven mostly by "
    "new customers in Europe and Asia. Operating costs stayed flat, and we expect the same trend to continue "
    "through the end of the year, although currency movements remain a risk that we are watching closely.",
    "Numbers and dates test a reader too: on March 3rd, 2024, at 4:15 pm, flight 208 left gate B12 with "
    "164 passengers.",
    "Is it raining? Bring an umbrella, just in case!",
]


def load_texts(path: Path) -> list[dict]:
    """One request per line: plain text, or a JSON object with at least "text"."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--texts file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise InputError(f"{path}:{n}: not valid JSON ({exc})") from None
            if not isinstance(doc.get("text"), str) or not doc["text"].strip():
                raise InputError(f"{path}:{n}: a JSON line needs a non-empty \"text\"")
            out.append(doc)
        else:
            out.append({"text": line})
    if not out:
        raise InputError(f"{path} holds no texts")
    return out


def parse_concurrency(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--concurrency must be numbers separated by commas, got {spec!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise InputError(f"--concurrency levels must be at least 1, got {spec!r}")
    return sorted(set(levels))


@dataclass
class Sample:
    concurrency: int
    index: int
    start_s: float  # since the level began
    latency_s: float
    ok: bool
    kind: str  # "ok" or the error kind
    audio_seconds: float | None
    text_chars: int
    error: str | None = None
    first_audio_s: float | None = None  # streamed requests: time to the first audio byte


def _one(target, request: dict, accept: str, concurrency: int, index: int, t0: float, fmt: str = "wav") -> Sample:
    """One request; an answer that is not `fmt` audio (check_audio) is an error like any other."""
    start = time.perf_counter()
    chars = len(request.get("text", ""))
    try:
        response = target.send(request, accept)
        seconds = check_audio(response, fmt, str(target))
    except ServiceError as exc:
        return Sample(concurrency, index, start - t0, time.perf_counter() - start, False, exc.kind, None, chars, str(exc))
    except Exception as exc:  # anything else still counts, by its type, rather than killing the run
        return Sample(concurrency, index, start - t0, time.perf_counter() - start, False, type(exc).__name__, None,
                      chars, str(exc))
    return Sample(concurrency, index, start - t0, response.latency_s, True, "ok", seconds, chars,
                  first_audio_s=response.first_audio_s)


def run_level(target, requests: list[dict], concurrency: int,
              accept: str = "audio/wav", fmt: str = "wav") -> tuple[list[Sample], float]:
    """Send every request with `concurrency` workers; returns the samples and the wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"bench-c{concurrency}") as pool:
        futures = [pool.submit(_one, target, r, accept, concurrency, i, t0, fmt) for i, r in enumerate(requests)]
        samples = [f.result() for f in futures]
    return samples, time.perf_counter() - t0


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


REJECTED = "rejected"  # the kind of a 503 with Retry-After: the server was full

# The fewest samples a percentile needs to rest on more than the largest few: p95 needs 20
# (one sample in its top 5%), p99 needs 100. Fewer gives a figure with a warning.
MIN_SAMPLES = {"p95": 20, "p99": 100}


def thin_percentiles(counts: dict[str, int]) -> list[str]:
    """Warnings such as "p99 from 6 samples", for each figure ("first audio p95": its sample
    count) whose percentile rests on fewer samples than MIN_SAMPLES asks."""
    return [f"{figure} from {n} sample{'s' if n != 1 else ''}" for figure, n in counts.items()
            if 0 < n < MIN_SAMPLES[figure.split()[-1]]]


def level_passed(level: dict, max_error_rate: float) -> bool:
    """Whether a level's failed requests (errors and rejections: every request that brought no
    audio) are within max_error_rate, a fraction of its requests."""
    failed = level["requests"] - level["ok"]
    return failed <= max_error_rate * level["requests"] + 1e-9


def summarize(samples: list[Sample], wall_s: float, concurrency: int, max_error_rate: float = 0.0) -> dict:
    """Figures for one level; latency, first audio and RTF over successful requests only; the
    error rate (every request without audio, rejections included) and whether it passed."""
    ok = [s for s in samples if s.ok]
    lat = np.array([s.latency_s for s in ok])
    first = np.array([s.first_audio_s for s in ok if s.first_audio_s is not None]) * 1000
    audio = [s.audio_seconds for s in ok if s.audio_seconds is not None]
    rtf = np.array([s.latency_s / s.audio_seconds for s in ok if s.audio_seconds])
    errors = Counter(s.kind for s in samples if not s.ok and s.kind != REJECTED)
    examples = {}
    for s in samples:
        if not s.ok and s.kind not in examples:
            examples[s.kind] = s.error
    total_audio = float(sum(audio))
    summary = {
        "concurrency": concurrency,
        "requests": len(samples),
        "ok": len(ok),
        "rejected": sum(1 for s in samples if not s.ok and s.kind == REJECTED),
        "error_rate": (len(samples) - len(ok)) / len(samples) if samples else 0.0,
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "wall_s": wall_s,
        "rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "audio_seconds": total_audio,
        "audio_seconds_per_wall_second": total_audio / wall_s if wall_s > 0 else 0.0,
        "latency_s": {"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99),
                      "mean": float(lat.mean()) if len(lat) else None,
                      "min": float(lat.min()) if len(lat) else None,
                      "max": float(lat.max()) if len(lat) else None},
        "first_audio_ms": {"p50": _pct(first, 50), "p95": _pct(first, 95),
                           "mean": float(first.mean()) if len(first) else None},
        "rtf": {"p50": _pct(rtf, 50), "p95": _pct(rtf, 95), "mean": float(rtf.mean()) if len(rtf) else None},
        "warnings": thin_percentiles({"p95": len(lat), "p99": len(lat), "first audio p95": len(first),
                                      "RTF p95": len(rtf)}),
    }
    summary["passed"] = level_passed(summary, max_error_rate)
    return summary


def run_bench(target, *, concurrencies: list[int], requests_per_level: int, texts: list[dict],
              base: dict | None = None, accept: str = "audio/wav", warmup: int = 1, stream: bool = False,
              max_error_rate: float = 0.0, device: str = "unknown", server: dict | None = None,
              price: dict | None = None, instances: int = 1, instance_type: str | None = None,
              notes: list[str] | None = None, adapters: list[str] | None = None, log=lambda s: None) -> dict:
    """The whole benchmark: warm-up, then each level in turn; returns the report as plain data.

    stream: every request asks for a streamed answer, and each sample records its first audio.
    Every answer must be audio of the format asked for (base's "format", else accept's).
    max_error_rate: the fraction of a level's requests that may fail for it to pass.
    device, server: what the target runs on and what its /ping said, for the report.
    price: {"usd_per_hour", "source"} of one instance (or None), on `instances` of `instance_type`:
    each level then costs its instances' hours over the audio-hours it made (bench_cost).
    adapters: LoRA adapter names given to the requests round-robin (request i gets adapters[i % n];
    a JSON text line's own "adapter" wins).
    """
    if requests_per_level < 1:
        raise InputError(f"--requests must be at least 1, got {requests_per_level}")
    if not 0 <= max_error_rate <= 1:
        raise InputError(f"--max-error-rate is a fraction from 0 to 1, got {max_error_rate:g}")
    base = dict(base or {})
    fmt = base.get("format") or {mime: f for f, mime in AUDIO_TYPES.items()}.get(accept, "wav")
    if stream:
        fmt = base.get("format", "wav")
        if fmt not in STREAM_FORMATS:
            raise InputError(f"--stream sends {' or '.join(STREAM_FORMATS)}, not {fmt}")
        base["stream"] = True
    adapters = list(adapters or [])
    requests = [{**base, **({"adapter": adapters[i % len(adapters)]} if adapters else {}), **texts[i % len(texts)]}
                for i in range(requests_per_level)]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for i in range(warmup):  # first requests pay for lazy loading and compilation: not measured
        s = _one(target, requests[i % len(requests)], accept, 0, i, time.perf_counter(), fmt)
        log(f"warm-up {i + 1}/{warmup}: {'ok' if s.ok else s.error} in {s.latency_s:.2f} s")
    levels, samples = [], []
    for c in concurrencies:
        level_samples, wall = run_level(target, requests, c, accept, fmt)
        summary = summarize(level_samples, wall, c, max_error_rate)
        levels.append(summary)
        samples.extend(level_samples)
        lat, first = summary["latency_s"]["p50"], summary["first_audio_ms"]["p50"]
        log(f"concurrency {c}: {summary['ok']}/{summary['requests']} ok in {wall:.1f} s"
            + (f", p50 {lat:.2f} s" if lat is not None else "")
            + (f", first audio p50 {first:.0f} ms" if first is not None else "")
            + (f", {summary['rejected']} rejected (server full)" if summary["rejected"] else ""))
    return {
        "target": str(target), "device": device, "server": server, "fish_sm_version": fish_sm.__version__,
        "started": started, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {"concurrency": list(concurrencies), "requests": requests_per_level, "format": fmt,
                     "stream": stream, "max_new_tokens": base.get("max_new_tokens"), "seed": base.get("seed"),
                     "voice": base.get("voice"), "max_error_rate": max_error_rate, "warmup": warmup,
                     "texts": len(texts),
                     **({"adapters": len(adapters), "adapter_names": adapters} if adapters else {})},
        "passed": all(lv["passed"] for lv in levels),
        "accept": accept, "stream": stream,
        "requests_per_level": requests_per_level, "texts": len(texts), "warmup": warmup, "levels": levels,
        "cost": bench_cost(levels, price, instances, instance_type), "notes": list(notes or []),
        "samples": [asdict(s) for s in samples],
    }


def bench_cost(levels: list[dict], price: dict | None, instances: int = 1, instance_type: str | None = None) -> dict:
    """Dollars per audio-hour at each level (its usd_per_audio_hour, set here) and at the cheapest:
    `instances` instances billed price["usd_per_hour"] each made the level's audio seconds a second.
    Closed-loop clients keep the server as busy as the level's concurrency, so the cheapest level
    is the cost at that load, not under a latency SLO (`fish-sm capacity` gives that)."""
    usd = (price or {}).get("usd_per_hour")
    for level in levels:
        level["usd_per_audio_hour"] = usd_per_audio_hour(usd, level["audio_seconds_per_wall_second"] / instances)
    priced = [lv for lv in levels if lv["usd_per_audio_hour"] is not None and lv.get("passed", True)]
    best = min(priced, key=lambda lv: lv["usd_per_audio_hour"], default=None)
    return {"instance_type": instance_type, "instances": instances, "usd_per_hour": usd,
            "price_source": (price or {}).get("source"),
            "usd_per_audio_hour": best["usd_per_audio_hour"] if best else None,
            "at_concurrency": best["concurrency"] if best else None}

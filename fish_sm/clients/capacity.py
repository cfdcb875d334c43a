"""Capacity the way operators plan it: how many listeners a server keeps fed under a latency SLO.

Each level offers a number of concurrent real-time streams. Requests arrive open-loop (Poisson,
or evenly spaced; seeded) at the rate that keeps that many listeners busy on average: by
Little's law, streams / the mix's mean audio seconds a second, whatever the server does, so a
slow server meets more arrivals rather than fewer. Each streamed answer is *played*: from its
first audio byte a listener plays at real time, and whenever the playback reaches the end of
the audio received it waits (an underrun). A level passes when its streams' p99 time to first
audio and its underrun time as a share of playback time are within the SLO, and its failed
requests (errors and rejections by a full server) within the error rate allowed. The capacity
is the largest level up to which every level passes (a pass above a failure is noise, not
capacity), as streams per GPU, audio-hours per instance-hour (a listener plays one audio-second
a second) and, with an hourly price, dollars per audio-hour.

A closed-loop population (`Population`, --listeners) is the other way to load a level: that many
listeners, each asking (a request from the same mix), playing the answer at real time from its
first audio, and asking again as soon as it has played (`played_at`: first audio + audio +
underruns; a whole answer once it has arrived and played; a failure after the audio it asked
for would have played). First requests are spread over one mean answer of the mix (seeded), so
requests arrive from the start at the rate the loop keeps up (listeners / mean answer seconds),
not as one burst whose first audio would dominate the level's p99; nobody asks after the
duration, and the level ends when the answers in flight are in. The same samples,
verdict and ramp; the capacity is then the largest passing level's listeners. Against a URL
the listeners run as tasks on one asyncio event loop with aiohttp's client (threads, one a
listener, fall behind well before 1,024 listeners of 44.1 kHz WAV); an endpoint's go through
boto3 on threads.

The mix (documented defaults): the bench's built-in texts, one picked at random per request;
with --voice, 25% of requests name that packaged voice; with --reference, 10% carry that
recording inline as a zero-shot reference; 10% ask for the whole WAV instead of a stream (they
load the server like the rest; their latency is reported apart, not held to the streams' SLO).
Every text is sent as one chunk with max_new_tokens = its intended length: characters over the
speaking rate (15 a second), times 21.5 frames a second. A real model ends where it ends within
that cap; random weights stop at random frames, so a benchmark of them needs the server's
benchmark-only FISH_SM_BENCHMARK_LENGTHS=true, under which a request always runs to its cap
(the report says whether lengths were forced).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import numpy as np

import fish_sm
from fish_sm.clients.bench import BUILTIN_TEXTS, REJECTED, level_passed, thin_percentiles
from fish_sm.clients.response import Response, ServiceError, check_audio, error_text
from fish_sm.clients.stream import close_wav, pcm_offset
from fish_sm.clients.url import UrlTarget, base_url
from fish_sm.contract import CHUNK_LENGTH_RANGE, request_body
from fish_sm.errors import InputError

FRAMES_PER_SECOND = 44100 / 2048  # the codec's frame rate: 44.1 kHz audio, 2,048 samples a frame
CHARS_PER_SECOND = 15.0  # the speaking rate intended lengths assume (about 150 words a minute)
SLO_FIRST_AUDIO_MS = 500.0
SLO_UNDERRUN = 0.001  # underrun time as a fraction of playback time
VOICE_SHARE = 0.25  # of requests, when a packaged voice is given
REFERENCE_SHARE = 0.10  # of requests, when a reference recording is given
WHOLE_SHARE = 0.10  # of requests that ask for the whole WAV rather than a stream
ARRIVALS = ("poisson", "fixed")
ONE_CHUNK = CHUNK_LENGTH_RANGE[1]  # so max_new_tokens, which is per chunk, bounds the whole text
ACCEPT = "audio/wav"
POPULATIONS = ("open loop", "closed loop")
LATE_WARNING_MS = 100.0  # a client sending this much after a request's arrival is itself the bottleneck


def parse_streams(spec: str, option: str = "--streams") -> list[int]:
    """A ramp's levels (--streams or --listeners): distinct, ascending, each at least 1."""
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option} must be numbers separated by commas, got {spec!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise InputError(f"{option} levels must be at least 1, got {spec!r}")
    return sorted(set(levels))


def intended_seconds(text: str, chars_per_second: float = CHARS_PER_SECOND) -> float:
    return len(text.strip()) / chars_per_second


def intended_frames(text: str, chars_per_second: float = CHARS_PER_SECOND) -> int:
    return max(1, round(intended_seconds(text, chars_per_second) * FRAMES_PER_SECOND))


@dataclass(frozen=True)
class Mix:
    """What a level's requests are made of; shares are fractions of its requests."""

    texts: tuple[str, ...] = tuple(BUILTIN_TEXTS)
    chars_per_second: float = CHARS_PER_SECOND
    voice: str | None = None
    voice_share: float = 0.0
    reference: tuple[str, str] | None = None  # (audio as the request carries it, its transcript)
    reference_share: float = 0.0
    whole_share: float = WHOLE_SHARE

    def __post_init__(self):
        for name in ("voice_share", "reference_share", "whole_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise InputError(f"--{name.replace('_', '-')} is a fraction from 0 to 1, got {getattr(self, name):g}")
        if self.voice_share + self.reference_share > 1 + 1e-9:
            raise InputError("--voice-share and --reference-share add up to more than 1")
        if self.voice_share and not self.voice:
            raise InputError("--voice-share needs --voice")
        if self.reference_share and not self.reference:
            raise InputError("--reference-share needs --reference")
        if self.chars_per_second <= 0:
            raise InputError(f"--chars-per-second must be positive, got {self.chars_per_second:g}")
        if not self.texts:
            raise InputError("the mix has no texts")

    @property
    def mean_seconds(self) -> float:
        """The mean intended audio of a request (texts are picked uniformly)."""
        return float(np.mean([intended_seconds(t, self.chars_per_second) for t in self.texts]))

    def describe(self) -> dict:
        return {"texts": len(self.texts), "chars_per_second": self.chars_per_second,
                "frames_per_second": round(FRAMES_PER_SECOND, 3), "mean_intended_s": round(self.mean_seconds, 3),
                "voice": self.voice, "voice_share": self.voice_share,
                "reference_share": self.reference_share if self.reference else 0.0, "whole_share": self.whole_share}


@dataclass
class Planned:
    """One request of a level: when it arrives (seconds after the level begins) and its body."""

    index: int
    at_s: float
    body: dict
    voice: str  # "packaged", "reference" or "none"
    intended_s: float
    listener: int | None = None  # closed loop: the listener who asks


def arrival_times(rate: float, duration_s: float, arrivals: str, rng: np.random.Generator) -> list[float]:
    """Arrival times in [0, duration_s) at `rate` a second: Poisson, or evenly spaced; at least one."""
    if arrivals == "fixed":
        times = list(np.arange(0.0, duration_s, 1.0 / rate))
    else:
        times, t = [], float(rng.exponential(1.0 / rate))
        while t < duration_s:
            times.append(t)
            t += float(rng.exponential(1.0 / rate))
    return [float(t) for t in times] or [0.0]


def plan_level(mix: Mix, streams: int, duration_s: float, arrivals: str = "poisson", seed: int = 0) -> list[Planned]:
    """A level's requests: arrivals at the rate that keeps `streams` listeners busy, each with a
    text, voice and mode drawn from the mix; the same seed gives the same requests."""
    if arrivals not in ARRIVALS:
        raise InputError(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
    if duration_s <= 0:
        raise InputError(f"--duration must be positive, got {duration_s:g}")
    rng = np.random.default_rng([seed, streams])
    rate = streams / mix.mean_seconds
    return [draw_request(mix, rng, i, at) for i, at in enumerate(arrival_times(rate, duration_s, arrivals, rng))]


def draw_request(mix: Mix, rng: np.random.Generator, index: int, at_s: float, listener: int | None = None) -> Planned:
    """One request of the mix: its text, voice, mode (stream or whole) and sampling seed from rng."""
    text = mix.texts[int(rng.integers(len(mix.texts)))]
    u, whole = float(rng.random()), float(rng.random()) < mix.whole_share
    voice = "packaged" if u < mix.voice_share else (
        "reference" if u < mix.voice_share + mix.reference_share else "none")
    body = request_body(
        text, voice=mix.voice if voice == "packaged" else None,
        reference_audio=mix.reference[0] if voice == "reference" else None,
        reference_text=mix.reference[1] if voice == "reference" else None, fmt="wav", stream=not whole,
        max_new_tokens=intended_frames(text, mix.chars_per_second), chunk_length=ONE_CHUNK,
        seed=int(rng.integers(2**31)))
    return Planned(index, at_s, body, voice, intended_seconds(text, mix.chars_per_second), listener)


def playback_underrun(pieces: list[tuple[float, float]]) -> tuple[float, int, float]:
    """A listener's playback of a stream whose pieces arrive at (time, audio seconds) in arrival
    order: it starts with the first audio and plays at real time; whenever it reaches the end of
    the audio received it waits for the next piece. Returns (seconds waited, times it waited,
    seconds of audio)."""
    waits, have = playback_waits(pieces)
    return sum(came - ran_out for ran_out, came, _, _ in waits), len(waits), have


def playback_waits(pieces: list[tuple[float, float]]) -> tuple[list[tuple[float, float, float, float]], float]:
    """The waits of `playback_underrun`'s listener, each as (when playback reached the end of
    the audio received, when the next piece came, seconds of audio before it, and with it), and
    the seconds of audio."""
    clock, position, have = None, 0.0, 0.0
    waits = []
    for t, seconds in pieces:
        if seconds <= 0:
            continue
        if clock is None:
            clock, have = t, seconds
            continue
        runs_out = clock + (have - position)  # when playback would reach the end of what has come
        if runs_out < t - 1e-9:
            waits.append((runs_out, t, have, have + seconds))
            position = have
        else:
            position += t - clock
        clock, have = t, have + seconds
    return waits, have


def audio_pieces(arrivals: list[tuple[float, int]], pcm_start: int, bytes_per_second: float) -> list[tuple[float, float]]:
    """(time, audio seconds) of each piece of a stream from (time, bytes): bytes before
    `pcm_start` (a WAV header) are no audio."""
    out, total, before = [], 0, 0.0
    for t, n in arrivals:
        total += n
        audio = max(0, total - pcm_start) / bytes_per_second
        out.append((t, audio - before))
        before = audio
    return out


@dataclass
class StreamSample:
    """One request of a level, as its listener saw it (times from its arrival)."""

    streams: int | None  # the open-loop level's offered concurrency (None in a closed loop)
    index: int
    at_s: float  # its arrival (closed loop: when its listener asked), seconds after the level began
    mode: str  # "stream" or "whole"
    voice: str
    text_chars: int
    intended_s: float
    ok: bool
    kind: str  # "ok" or the error kind
    latency_s: float  # arrival to the last byte
    late_s: float  # how much later than its arrival the client sent it
    first_audio_s: float | None = None  # streams: arrival to the first audio byte; whole: the latency
    audio_seconds: float | None = None
    underrun_s: float | None = None  # streams: seconds the listener waited after playback began
    underruns: int | None = None  # streams: times it waited
    error: str | None = None
    listeners: int | None = None  # the closed-loop level's listeners (None in an open loop)
    listener: int | None = None  # closed loop: which of them asked


def _fields(planned: Planned, streams: int | None, listeners: int | None) -> dict:
    return dict(streams=streams, index=planned.index, at_s=planned.at_s,
                mode="stream" if planned.body.get("stream") else "whole", voice=planned.voice,
                text_chars=len(planned.body["text"]), intended_s=planned.intended_s, listeners=listeners,
                listener=planned.listener)


def _failed(fields: dict, exc: Exception, latency_s: float, late_s: float) -> StreamSample:
    """A request that brought no audio: a ServiceError by its kind, anything else by its type
    (it still counts, rather than ending the run)."""
    kind = exc.kind if isinstance(exc, ServiceError) else type(exc).__name__
    return StreamSample(**fields, ok=False, kind=kind, latency_s=latency_s, late_s=late_s, error=str(exc))


def _judge(fields: dict, response, late: float, start: float, source: str) -> StreamSample:
    """A request's answer as its listener heard it: its audio, its first audio and the underruns
    of its playback (streams), or the failure that it is not the audio asked for."""
    try:
        seconds = check_audio(response, "wav", source)
    except ServiceError as exc:
        return _failed(fields, exc, late + time.perf_counter() - start, late)
    sample = StreamSample(**fields, ok=True, kind="ok", latency_s=late + response.latency_s, late_s=late,
                          audio_seconds=seconds)
    if sample.mode == "whole":
        sample.first_audio_s = sample.latency_s  # the listener hears nothing before the whole file
        return sample
    sample.first_audio_s = late + response.first_audio_s if response.first_audio_s is not None else None
    pcm_start = pcm_offset(response.body, response.content_type) or 0
    if response.arrivals and seconds:
        pieces = audio_pieces(response.arrivals, pcm_start, (len(response.body) - pcm_start) / seconds)
        sample.underrun_s, sample.underruns, _ = playback_underrun(pieces)
    return sample


def _send(target, planned: Planned, streams: int | None, t0: float, listeners: int | None = None) -> StreamSample:
    """Send one request at its arrival and judge it; any failure is a sample of its kind."""
    start = time.perf_counter()
    late = max(0.0, start - (t0 + planned.at_s))
    fields = _fields(planned, streams, listeners)
    try:
        response = target.send(planned.body, ACCEPT)
    except Exception as exc:
        return _failed(fields, exc, late + time.perf_counter() - start, late)
    return _judge(fields, response, late, start, str(target))


def run_level(target, planned: list[Planned], streams: int) -> tuple[list[StreamSample], float]:
    """Send each planned request at its arrival time, on a thread of its own (open loop: nothing
    waits for an answer before sending the next), then wait for every answer."""
    results: list[StreamSample | None] = [None] * len(planned)

    def one(p: Planned, t0: float) -> None:
        results[p.index] = _send(target, p, streams, t0)

    threads = []
    t0 = time.perf_counter()
    for p in planned:
        delay = t0 + p.at_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(p, t0), name=f"capacity-{streams}-{p.index}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None], time.perf_counter() - t0


# -- the closed loop: a population of listeners -------------------------------------------------

def played_at(sample: StreamSample) -> float:
    """When the listener of `sample` has heard its answer (seconds after the level began), and so
    asks again: a stream at its first audio + its audio + the underruns its playback waited out;
    a whole answer when it has arrived and then played (its latency + its audio). A request that
    brought no audio leaves its listener waiting as long as the audio it asked for would have
    played, from the failure on (so a full server is not flooded with retries)."""
    if sample.ok and sample.mode == "stream" and sample.first_audio_s is not None:
        return sample.at_s + sample.first_audio_s + (sample.audio_seconds or 0.0) + (sample.underrun_s or 0.0)
    if sample.ok:
        return sample.at_s + sample.latency_s + (sample.audio_seconds or 0.0)
    return sample.at_s + sample.latency_s + sample.intended_s


class Population:
    """A closed-loop level: `listeners` listeners, each asking (a request drawn from the mix), playing
    the answer at real time from its first audio, and asking again as soon as it has played
    (`played_at`). First requests are spread uniformly over the first `spread_s` seconds (default:
    the mix's mean answer, the loop's steady pace from the start); nobody asks at or after
    `duration_s`. Seeded: a listener's k-th request is the same whatever the timing (each
    listener draws from a generator of its own). Safe to share across threads."""

    def __init__(self, mix: Mix, listeners: int, duration_s: float, seed: int = 0, spread_s: float | None = None):
        if listeners < 1:
            raise InputError(f"--listeners levels must be at least 1, got {listeners}")
        if duration_s <= 0:
            raise InputError(f"--duration must be positive, got {duration_s:g}")
        self.mix, self.listeners, self.duration_s = mix, listeners, duration_s
        self.spread_s = min(mix.mean_seconds if spread_s is None else spread_s, duration_s)
        rng = np.random.default_rng([seed, listeners, 1])
        self.starts = [float(t) for t in rng.uniform(0.0, self.spread_s, listeners)]
        self._rngs = [np.random.default_rng([seed, listeners, 2, i]) for i in range(listeners)]
        self._next_index = 0
        self._lock = threading.Lock()

    def _ask(self, listener: int, at_s: float) -> Planned:
        with self._lock:
            index, self._next_index = self._next_index, self._next_index + 1
        return draw_request(self.mix, self._rngs[listener], index, at_s, listener)

    def first(self) -> list[Planned]:
        """Every listener's first request."""
        return [self._ask(i, at) for i, at in enumerate(self.starts)]

    def after(self, sample: StreamSample) -> Planned | None:
        """The next request of sample's listener, when its answer has played; None once that is
        past the duration."""
        at = played_at(sample)
        return self._ask(sample.listener, at) if at < self.duration_s else None


def _before_the_clock(population: Population) -> list[Planned]:
    """What a level does before its clock starts: draw every listener's first request (1,024
    bodies take a while) and import soundfile, which judging the first answer would otherwise
    do while hundreds of streams wait."""
    import soundfile  # noqa: F401

    return population.first()


@contextlib.contextmanager
def _collector_paused():
    """No garbage collection while a level runs: a full collection scans every live object (the
    arrival times of 1,024 streams in flight: 50 ms and more) while the streams wait, and a
    level's cyclic garbage is a few hundred objects, collected when it ends."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_population(target, population: Population) -> tuple[list[StreamSample], float]:
    """A closed-loop level on threads, one a listener, each sending through target.send (any
    target: an endpoint's InvokeEndpointWithResponseStream too); the level ends when every
    listener's last answer is in."""
    samples: list[StreamSample] = []
    first = _before_the_clock(population)

    def listener(p: Planned | None) -> None:
        while p is not None:
            _sleep_until(t0 + p.at_s)
            sample = _send(target, p, None, t0, population.listeners)
            samples.append(sample)  # list.append is atomic
            p = population.after(sample)

    threads = [threading.Thread(target=listener, args=(p,), name=f"listener-{population.listeners}-{p.listener}",
                                daemon=True) for p in first]
    with _collector_paused():
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - t0
    return sorted(samples, key=lambda s: s.index), wall


def aiohttp_missing() -> str | None:
    """Why the asyncio client cannot run here (aiohttp is not installed), else None."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return ("aiohttp is not installed, so the listeners ran on threads, one each, which share one core and fall "
                "behind beyond a few hundred listeners of 44.1 kHz WAV: pip install 'fish-sm[bench]'")
    return None


def run_population_async(url: str, population: Population, timeout_s: float = 900) -> tuple[list[StreamSample], float]:
    """A closed-loop level over HTTP (a --url or --local server) on one asyncio event loop with
    aiohttp's client: a task a listener, one connection each, kept alive between its requests;
    the level ends when every listener's last answer is in."""
    return asyncio.run(_population_async(base_url(url), population, timeout_s))


async def _population_async(url: str, population: Population, timeout_s: float):
    import aiohttp

    _more_open_files(population.listeners + 64)
    samples: list[StreamSample] = []
    first = _before_the_clock(population)

    async def listener(session, p: Planned | None) -> None:
        while p is not None:
            delay = t0 + p.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            start = time.perf_counter()
            late = max(0.0, start - (t0 + p.at_s))
            fields = _fields(p, None, population.listeners)
            try:
                response = await _post(session, url, p.body, timeout_s)
            except Exception as exc:
                sample = _failed(fields, exc, late + time.perf_counter() - start, late)
            else:
                sample = _judge(fields, response, late, start, url)
            samples.append(sample)
            p = population.after(sample)

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        with _collector_paused():
            t0 = time.perf_counter()
            await asyncio.gather(*(listener(session, p) for p in first))
            wall = time.perf_counter() - t0
    return sorted(samples, key=lambda s: s.index), wall


async def _post(session, url: str, body: dict, timeout_s: float) -> Response:
    """POST /invocations as UrlTarget.send does (the same errors, the same timings), on aiohttp."""
    import aiohttp

    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json", "Accept": ACCEPT}
    try:
        async with session.post(url + "/invocations", data=json.dumps(body).encode(), headers=headers) as r:
            if r.status >= 400:
                message = f"{url} answered {r.status}: {error_text(await r.read())}"
                retry_after = r.headers.get("Retry-After")
                if r.status == 503 and retry_after:  # full: a refusal to count, not a failure
                    raise ServiceError(message, REJECTED, r.status, retry_after)
                raise ServiceError(message, f"HTTP {r.status}", r.status)
            content_type = r.headers.get("Content-Type", ACCEPT)
            rate = r.headers.get("X-Sample-Rate")
            rate = int(rate) if rate and rate.isdigit() else body.get("sample_rate")
            if not body.get("stream"):
                payload = await r.read()
                return Response(payload, content_type, time.perf_counter() - t0, sample_rate=rate)
            data, arrivals, start, first = bytearray(), [], None, None
            async for piece in r.content.iter_any():  # whatever has come, as it comes
                now = time.perf_counter() - t0
                arrivals.append((now, len(piece)))
                data += piece
                if first is None:
                    start = pcm_offset(data, content_type) if start is None else start
                    if start is not None and len(data) > start:
                        first = now
            payload = bytes(data) if content_type.startswith("audio/pcm") else close_wav(bytes(data))
            return Response(payload, content_type, time.perf_counter() - t0, first, rate, arrivals)
    except asyncio.TimeoutError:
        raise ServiceError(f"{url}: no answer within {timeout_s:g} s", "timeout") from None
    except aiohttp.ClientConnectorError as exc:
        raise ServiceError(f"cannot reach {url}: {exc.os_error or exc}", "connection") from None
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise ServiceError(f"{url}: connection broken ({type(exc).__name__}: {exc})", "connection") from None


def _more_open_files(needed: int) -> None:
    """Raise this process's soft limit on open files towards `needed` (a socket a listener), as
    far as its hard limit allows."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize_level(samples: list[StreamSample], wall_s: float, streams: int, rate: float, duration_s: float, *,
                    slo_first_audio_ms: float = SLO_FIRST_AUDIO_MS, slo_underrun: float = SLO_UNDERRUN,
                    max_error_rate: float = 0.0, population: str = "open loop") -> dict:
    """A level's figures over its streams (first audio, underruns), its whole requests (latency)
    and all of them (audio, errors); whether it meets the SLO, and if not, why.

    `streams` is the level: offered streams (open loop, the level keyed "streams") or listeners
    (closed loop, keyed "listeners"); `rate` its arrivals a second (closed loop: the requests its
    listeners made over the duration)."""
    if population not in POPULATIONS:
        raise InputError(f"population must be one of {', '.join(POPULATIONS)}, got {population!r}")
    ok = [s for s in samples if s.ok]
    streamed = [s for s in ok if s.mode == "stream"]
    whole = np.array([s.latency_s for s in ok if s.mode == "whole"])
    first = np.array([s.first_audio_s for s in streamed if s.first_audio_s is not None]) * 1000
    played = float(sum(s.audio_seconds or 0.0 for s in streamed))
    waited = float(sum(s.underrun_s or 0.0 for s in streamed))
    audio = float(sum(s.audio_seconds or 0.0 for s in ok))
    intended = float(sum(s.intended_s for s in ok))
    errors = Counter(s.kind for s in samples if not s.ok and s.kind != REJECTED)
    examples = {}
    for s in samples:
        if not s.ok and s.kind not in examples:
            examples[s.kind] = s.error
    level = {
        unit_of(population): streams, "arrivals_per_s": rate, "duration_s": duration_s,
        "requests": len(samples), "ok": len(ok), "streamed": len(streamed), "whole": int(len(whole)),
        "rejected": sum(1 for s in samples if not s.ok and s.kind == REJECTED),
        "error_rate": (len(samples) - len(ok)) / len(samples) if samples else 0.0,
        "errors": dict(sorted(errors.items())), "error_examples": examples,
        "wall_s": wall_s, "audio_seconds": audio,
        "audio_seconds_per_wall_second": audio / wall_s if wall_s > 0 else 0.0,
        "audio_vs_intended": audio / intended if intended else None,
        "first_audio_ms": {"p50": _pct(first, 50), "p95": _pct(first, 95), "p99": _pct(first, 99),
                           "max": float(first.max()) if len(first) else None},
        "underrun": {"seconds": waited, "playback_seconds": played, "share": waited / played if played else None,
                     "streams": sum(1 for s in streamed if s.underrun_s), "events": sum(s.underruns or 0 for s in streamed)},
        "whole_latency_s": {"p50": _pct(whole, 50), "p99": _pct(whole, 99)},
        "client_late_ms_max": max((s.late_s for s in samples), default=0.0) * 1000,
        "warnings": thin_percentiles({"first audio p99": len(first)}),
    }
    if level["client_late_ms_max"] > LATE_WARNING_MS:  # its own timing is then in doubt too
        due = "their listeners asked" if population == "closed loop" else "their arrival"
        level["warnings"].append(f"the client sent requests up to {level['client_late_ms_max']:.0f} ms after "
                                 f"{due} (short of CPU?)")
    reasons = []
    if not streamed:
        reasons.append("no stream brought audio")
    else:
        p99, share = level["first_audio_ms"]["p99"], level["underrun"]["share"]
        if p99 is None or p99 > slo_first_audio_ms:
            reasons.append(f"first audio p99 {_num(p99, '.0f')} ms > {slo_first_audio_ms:g} ms")
        if share is None or share > slo_underrun:
            reasons.append(f"underrun {_num(share, '.3%')} of playback > {slo_underrun:.3%}")
    if not level_passed(level, max_error_rate):
        reasons.append(f"{len(samples) - len(ok)} of {len(samples)} requests brought no audio "
                       f"(at most {max_error_rate:.0%} may)")
    level["slo_failures"] = reasons
    level["passed"] = not reasons
    # Errors other than a full server's rejections, beyond the rate allowed: something broke.
    broken = sum(errors.values())
    level["broken"] = broken > max_error_rate * len(samples) + 1e-9
    return level


def _num(v, spec) -> str:
    return "-" if v is None else format(v, spec)


def unit_of(population: str) -> str:
    """What a population's levels count: "streams" offered (open loop) or "listeners" (closed loop)."""
    return "listeners" if population == "closed loop" else "streams"


def level_of(level: dict) -> int:
    """A level's size: its listeners (closed loop) or its offered streams (open loop)."""
    return level["listeners"] if "listeners" in level else level["streams"]


def capacity_level(levels: list[dict]) -> dict | None:
    """The largest level up to which every level (in ascending order) passed; None if the first failed."""
    best = None
    for level in sorted(levels, key=level_of):
        if not level["passed"]:
            break
        best = level
    return best


def capacity_figures(streams: int | None, *, gpus: int, instances: int = 1, usd_per_hour: float | None = None,
                     unit: str = "streams") -> dict:
    """What `streams` concurrent real-time listeners on `instances` instances of `gpus` GPUs
    each mean: streams per GPU, audio-hours per instance-hour (each listener plays one
    audio-second a second), and with an instance's hourly price, dollars per audio-hour.
    unit "listeners" (a closed loop's figure) keys them "listeners" and "listeners_per_gpu"; a
    listener also waits for each answer's first audio, so its audio-hours are a little less."""
    if gpus < 1 or instances < 1:
        raise InputError("--gpus and the instance count must be at least 1")
    out = {unit: streams, "gpus": gpus, "instances": instances, f"{unit}_per_gpu": None,
           "audio_hours_per_instance_hour": None, "usd_per_hour": usd_per_hour, "usd_per_audio_hour": None}
    if streams:
        per_instance = streams / instances
        out.update({f"{unit}_per_gpu": per_instance / gpus, "audio_hours_per_instance_hour": per_instance})
        if usd_per_hour is not None:
            out["usd_per_audio_hour"] = usd_per_hour / per_instance
    return out


def run_capacity(target, *, levels: list[int], duration_s: float, mix: Mix, population: str = "open loop",
                 arrivals: str = "poisson", seed: int = 0,
                 slo_first_audio_ms: float = SLO_FIRST_AUDIO_MS, slo_underrun: float = SLO_UNDERRUN,
                 max_error_rate: float = 0.0, warmup: int = 2, keep_going: bool = False, gpus: int = 1,
                 instances: int = 1, price: dict | None = None, lengths: str = "not forced",
                 device: str = "unknown", server: dict | None = None, notes: list[str] | None = None,
                 client: str | None = None, log=lambda s: None) -> dict:
    """Warm up, then ramp the levels in ascending order (stopping after the first that fails the
    SLO unless keep_going); returns the report as plain data (fish_sm.clients.report writes it).

    population "open loop": levels are offered streams, arriving as `arrivals` says (plan_level,
    run_level); "closed loop": levels are listeners, each asking again when its answer has played
    (Population), on an asyncio client (aiohttp) for a URL target, else on threads; client
    "asyncio" or "threads" picks one (asyncio needs a URL target and aiohttp).
    price: {"usd_per_hour", "source"} or None; lengths: how request lengths were held (for the
    report); notes: lines for the report (a price that could not be found, ...)."""
    if population not in POPULATIONS:
        raise InputError(f"population must be one of {', '.join(POPULATIONS)}, got {population!r}")
    closed, unit = population == "closed loop", unit_of(population)
    notes = list(notes or [])
    if closed:
        client = client or ("asyncio" if isinstance(target, UrlTarget) and not aiohttp_missing() else "threads")
        if client == "asyncio" and not isinstance(target, UrlTarget):
            raise InputError("the asyncio client speaks HTTP: it needs --url or --local")
        if client == "threads" and isinstance(target, UrlTarget) and aiohttp_missing():
            notes.append(aiohttp_missing())
    if slo_first_audio_ms <= 0 or not 0 <= slo_underrun <= 1:
        raise InputError("--slo-first-audio-ms must be positive and --slo-underrun a fraction from 0 to 1")
    if not 0 <= max_error_rate <= 1:
        raise InputError(f"--max-error-rate is a fraction from 0 to 1, got {max_error_rate:g}")
    if warmup < 0:
        raise InputError(f"--warmup must not be negative, got {warmup}")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # Unmeasured first requests (streamed, then the other kinds of the mix) pay for lazy start-up work.
    warm = plan_level(mix, 1, max(mix.mean_seconds * (warmup + 1), 1e-3), "fixed", seed + 1)
    for i in range(warmup):
        s = _send(target, warm[i % len(warm)], 0, time.perf_counter())
        log(f"warm-up {i + 1}/{warmup}: {'ok' if s.ok else s.error} in {s.latency_s:.2f} s")
    out_levels, samples = [], []
    for n in levels:
        if closed:
            listeners = Population(mix, n, duration_s, seed)
            if client == "asyncio":
                level_samples, wall = run_population_async(target.url, listeners, target.timeout_s)
            else:
                level_samples, wall = run_population(target, listeners)
            rate = len(level_samples) / duration_s
            what = f"{n} listeners ({len(level_samples)} requests, {rate:.2f}/s)"
        else:
            planned = plan_level(mix, n, duration_s, arrivals, seed)
            rate = n / mix.mean_seconds
            level_samples, wall = run_level(target, planned, n)
            what = f"{n} streams ({rate:.2f} arrivals/s, {len(planned)} requests)"
        level = summarize_level(level_samples, wall, n, rate, duration_s, slo_first_audio_ms=slo_first_audio_ms,
                                slo_underrun=slo_underrun, max_error_rate=max_error_rate, population=population)
        out_levels.append(level)
        samples.extend(level_samples)
        first, share = level["first_audio_ms"]["p99"], level["underrun"]["share"]
        log(f"{what}: {level['ok']}/{level['requests']} "
            f"ok, first audio p99 {_num(first, '.0f')} ms, underrun {_num(share, '.3%')}, "
            f"{level['audio_seconds_per_wall_second']:.1f} audio s/s: "
            + ("pass" if level["passed"] else "FAIL (" + "; ".join(level["slo_failures"]) + ")"))
        if not level["passed"] and not keep_going and n != levels[-1]:
            log(f"stopping the ramp: {n} {unit} fail the SLO (--keep-going runs every level)")
            break
    best = capacity_level(out_levels)
    figures = capacity_figures(level_of(best) if best else None, gpus=gpus, instances=instances,
                               usd_per_hour=(price or {}).get("usd_per_hour"), unit=unit)
    figures["price_source"] = (price or {}).get("source")
    load = ({"listeners": list(levels), "duration_s": duration_s, "spread_s": min(mix.mean_seconds, duration_s),
             "client": client}
            if closed else {"streams": list(levels), "duration_s": duration_s, "arrivals": arrivals})
    return {
        "kind": "capacity", "population": population, "target": str(target), "device": device, "server": server,
        "fish_sm_version": fish_sm.__version__, "started": started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {"population": population, **load, "seed": seed,
                     "slo_first_audio_ms": slo_first_audio_ms, "slo_underrun": slo_underrun,
                     "max_error_rate": max_error_rate, "warmup": warmup, "keep_going": keep_going,
                     "format": "wav", "lengths": lengths},
        "mix": mix.describe(), "lengths": lengths, "capacity": figures, "notes": notes,
        "passed": best is not None, "levels": out_levels, "samples": [asdict(s) for s in samples],
    }


def endpoint_hardware(aws, name: str) -> tuple[str | None, int]:
    """(instance type, instances in service) of endpoint NAME's first instance-backed variant,
    for its capacity per GPU and its price; (None, 1) for a serverless one, or when these
    credentials may not describe it (then --instance-type or --price says it)."""
    from fish_sm.aws.endpoints import endpoint_config, require_endpoint
    from fish_sm.clients.endpoint import denied

    try:
        endpoint = require_endpoint(aws, name)
        variants = endpoint_config(aws, endpoint)["ProductionVariants"]
    except Exception as exc:
        if denied(exc):
            return None, 1
        raise
    live = {v["VariantName"]: v for v in endpoint.get("ProductionVariants", [])}
    for variant in variants:
        if "InstanceType" in variant:
            count = live.get(variant["VariantName"], {}).get("CurrentInstanceCount", variant.get("InitialInstanceCount"))
            return variant["InstanceType"], max(1, int(count or 1))
    return None, 1

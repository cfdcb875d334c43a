"""CloudWatch Embedded Metric Format (EMF) lines on stdout: one per request a server answers,
one per bidirectional-streaming session, and one of the batching server's state every few seconds.

SageMaker sends a container's stdout to CloudWatch Logs, and CloudWatch turns a log line that
is an EMF object (`_aws.Timestamp`, `_aws.CloudWatchMetrics` naming the namespace, dimensions
and metrics, then the values as top-level keys) into metrics, with no agent or dependency. The
names and units are fish_sm.cloudwatch_metrics' (and, for adapters and sessions, this module's).
FISH_SM_METRICS=off writes nothing. No torch.

A request that used a LoRA adapter is counted twice: under the two dimensions every metric has
(so the dashboard's and alarms' series include it) and, for ADAPTER_METRICS only, under those
and "Adapter" (CloudWatch bills each series: a few metrics per adapter, not all). Only adapters
the server knows become a dimension, never an unknown name from a request.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from fish_sm.cloudwatch_metrics import (ADAPTER_DIMENSION, DIMENSIONS, ENDPOINT_ENV, LOCAL_ENDPOINT, NAMESPACE,
                                        REQUEST_METRICS, STATE_METRICS)
from fish_sm.contract import ADAPTER_NAME

# The request metrics also kept per adapter: how much each is used, how it fails, how fast it is.
ADAPTER_METRICS = ("Requests", "Errors", "AdapterErrors", "Latency", "FirstAudio", "AudioSeconds")
# One line per bidirectional-streaming session (batching server), when it ends. SessionFirstAudio:
# from the first sentence's text complete (queued to the engine) to its first audio sent.
SESSION_METRICS = {
    "AdapterErrors": "Count",  # its adapter could not be read or served (as REQUEST_METRICS')
    "Sessions": "Count",
    "SentencesSpoken": "Count",
    "SessionFirstAudio": "Milliseconds",
    "SessionSeconds": "Seconds",
    "SessionsCancelled": "Count",  # barge-in
    "SessionsRejected": "Count",  # the server was full (503)
    "SessionErrors": "Count",  # ended by a 5xx
}


@dataclass
class RequestFigures:
    """What one answered request did, gathered while it is served (None: not applicable)."""

    status: int = 200
    stream: bool = False
    first_audio_ms: float | None = None
    rtf: float | None = None
    frames: int | None = None
    audio_seconds: float | None = None
    queue_wait_ms: float | None = None
    rejected: bool = False  # a 503 because every slot and queue place was taken (Retry-After)
    latency_ms: float | None = None  # None: from `started` until the line is written
    adapter: str | None = None  # the LoRA adapter the request used (a known one), the "Adapter" dimension
    adapter_failed: bool = False  # it failed because its adapter could not be read or served
    started: float = field(default_factory=time.perf_counter, repr=False, compare=False)

    def add_synthesis(self, frames: int, seconds: float, rtf: float | None) -> None:
        """One utterance's result; the lines of a JSON Lines body add up (RTF: the slowest line's)."""
        self.frames = (self.frames or 0) + int(frames)
        self.audio_seconds = (self.audio_seconds or 0.0) + float(seconds)
        if rtf is not None:
            self.rtf = max(self.rtf or 0.0, float(rtf))

    def add_queue_wait(self, ms: float) -> None:
        self.queue_wait_ms = max(self.queue_wait_ms or 0.0, ms)

    def add_worker_answer(self, headers: Mapping[str, str], forwarded_at: float) -> bool:
        """What the mms worker that answered said in its headers (see `worker_headers`): its audio,
        and its queue wait since the gate passed the request on at `forwarded_at` (epoch seconds).
        False when no worker answered (the model server itself did: no worker or queue place)."""
        try:
            started = float(headers[STARTED_HEADER])
        except (KeyError, ValueError):
            return False
        self.add_queue_wait(max(0.0, (started - forwarded_at) * 1000))
        adapter = headers.get(ADAPTER_HEADER)
        if adapter and ADAPTER_NAME.fullmatch(adapter):
            self.adapter = adapter
            self.adapter_failed = headers.get(ADAPTER_ERROR_HEADER) == "1"
        try:
            audio = json.loads(headers.get(AUDIO_HEADER) or "null")
            if isinstance(audio, dict):
                self.add_synthesis(int(audio["frames"]), float(audio["seconds"]), audio.get("rtf"))
        except (ValueError, KeyError, TypeError):
            pass  # a worker of another version: its audio goes uncounted, the answer still is
        return True

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {"Requests": 1, "Rejected": int(self.rejected),
                                 "Errors": int(self.status >= 500 and not self.rejected)}
        if self.adapter is not None:
            out["AdapterErrors"] = int(self.adapter_failed)
        for name, value in (("Latency", self.latency_ms), ("FirstAudio", self.first_audio_ms),
                            ("RealTimeFactor", self.rtf),
                            ("Frames", self.frames), ("AudioSeconds", self.audio_seconds),
                            ("QueueWait", self.queue_wait_ms)):
            if value is not None:
                out[name] = round(float(value), 3)
        return out


# The mms server's Python worker cannot write a metrics line that reaches stdout whole (the Java
# model server logs its output through log4j, with a prefix), and never sees the requests that
# the gate or the model server refuse; the gate, which sees every request and its answer, writes
# the line, with what only the worker knows in headers of its answer, taken off before the
# client gets it: when it took the request (epoch seconds), the audio it made (JSON) and the
# adapter it used (a name).
STARTED_HEADER = "X-Fish-SM-Started"
AUDIO_HEADER = "X-Fish-SM-Audio"
ADAPTER_HEADER = "X-Fish-SM-Adapter"
ADAPTER_ERROR_HEADER = "X-Fish-SM-Adapter-Error"  # "1": its adapter could not be read or served
WORKER_HEADERS = frozenset(h.lower() for h in (STARTED_HEADER, AUDIO_HEADER, ADAPTER_HEADER, ADAPTER_ERROR_HEADER))


@dataclass
class SessionFigures:
    """What one bidirectional-streaming session did, from its WebSocket's opening to its close."""

    adapter: str | None = None
    sentences_spoken: int = 0
    first_audio_ms: float | None = None
    cancelled: bool = False
    rejected: bool = False  # refused at the start: the server was full
    status: int = 200  # the status of the error that ended it, if one did
    adapter_failed: bool = False  # its adapter could not be read or served
    started: float = field(default_factory=time.perf_counter, repr=False, compare=False)

    def values(self, seconds: float) -> dict[str, float]:
        out: dict[str, float] = {"Sessions": 1, "SentencesSpoken": self.sentences_spoken,
                                 "SessionSeconds": round(seconds, 3), "SessionsCancelled": int(self.cancelled),
                                 "SessionsRejected": int(self.rejected),
                                 "SessionErrors": int(self.status >= 500 and not self.rejected)}
        if self.first_audio_ms is not None:
            out["SessionFirstAudio"] = round(float(self.first_audio_ms), 3)
        if self.adapter is not None:
            out["AdapterErrors"] = int(self.adapter_failed)
        return out


def audio_header(results: Iterable) -> str | None:
    """The answer's audio (frames, seconds, the slowest real-time factor) from its syntheses (a
    JSON Lines line without audio holds its error instead); None when it has none."""
    figures = RequestFigures()
    for result in results:
        if hasattr(result, "frames"):
            figures.add_synthesis(result.frames, result.seconds, getattr(result, "rtf", None))
    if figures.frames is None:
        return None
    return json.dumps({"frames": figures.frames, "seconds": round(figures.audio_seconds, 6), "rtf": figures.rtf},
                      separators=(",", ":"))


def emf_line(dimensions: dict[str, str], values: dict[str, float], units: dict[str, str],
             properties: dict | None = None, timestamp_ms: int | None = None,
             adapter: str | None = None, adapter_metrics: Iterable[str] = ADAPTER_METRICS) -> str:
    """One EMF object as a line of JSON: the metrics `values` names (with `units`), under
    NAMESPACE and one dimension set; with `adapter`, those of `adapter_metrics` again under the
    set and "Adapter" (a second directive); `properties` are logged beside them, not as metrics."""
    directives = [{"Namespace": NAMESPACE, "Dimensions": [list(dimensions)],
                   "Metrics": [{"Name": n, "Unit": units[n]} for n in values]}]
    extra = {}
    if adapter is not None:
        per_adapter = [n for n in adapter_metrics if n in values]
        if per_adapter:
            directives.append({"Namespace": NAMESPACE, "Dimensions": [[*dimensions, ADAPTER_DIMENSION]],
                               "Metrics": [{"Name": n, "Unit": units[n]} for n in per_adapter]})
        extra[ADAPTER_DIMENSION] = adapter
    doc = {"_aws": {"Timestamp": int(time.time() * 1000) if timestamp_ms is None else timestamp_ms,
                    "CloudWatchMetrics": directives},
           **(properties or {}), **dimensions, **extra, **values}
    return json.dumps(doc, separators=(",", ":"))


def state_values(loads: list[dict]) -> dict[str, float]:
    """The engines' `load()` dicts together: slots, active, waiting, and free KV memory if given."""
    slots = sum(int(x.get("slots", 0)) for x in loads)
    active = sum(int(x.get("active", 0)) for x in loads)
    out = {"BatchOccupancy": round(100.0 * active / slots, 2) if slots else 0.0, "ActiveRequests": active,
           "QueueDepth": sum(int(x.get("waiting", 0)) for x in loads), "Slots": slots}
    free = [x["free_kv_bytes"] for x in loads if x.get("free_kv_bytes") is not None]
    if free:
        out["FreeKVMemory"] = sum(int(b) for b in free)
    return out


def _stdout(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Metrics:
    """Writes a server's EMF lines (nothing when disabled). `write` takes one line; stdout by default."""

    def __init__(self, server: str, enabled: bool = True, env: dict[str, str] | None = None,
                 write: Callable[[str], None] | None = None):
        env = os.environ if env is None else env
        self.enabled = enabled
        self.dimensions = dict(zip(DIMENSIONS, (env.get(ENDPOINT_ENV) or LOCAL_ENDPOINT, server)))
        self._write = write or _stdout
        self._lock = threading.Lock()  # lines whole, whatever thread writes them

    def _emit(self, line: str) -> None:
        with self._lock:
            self._write(line)

    def request(self, figures: RequestFigures) -> None:
        if figures.latency_ms is None:
            figures.latency_ms = (time.perf_counter() - figures.started) * 1000
        if self.enabled:
            self._emit(emf_line(self.dimensions, figures.values(), REQUEST_METRICS,
                                {"StatusCode": figures.status, "Stream": figures.stream}, adapter=figures.adapter))

    def session(self, figures: SessionFigures, outcome: str) -> None:
        """A bidirectional-streaming session's line, when it ends (`outcome`: done, cancelled, closed,
        refused, timeout or failed, logged beside the metrics)."""
        if self.enabled:
            seconds = time.perf_counter() - figures.started
            self._emit(emf_line(self.dimensions, figures.values(seconds), SESSION_METRICS,
                                {"Outcome": outcome, "StatusCode": figures.status}, adapter=figures.adapter,
                                adapter_metrics=("Sessions", "SentencesSpoken", "SessionFirstAudio", "SessionErrors",
                                                 "AdapterErrors")))

    def state(self, loads: list[dict]) -> None:
        if self.enabled and loads:
            self._emit(emf_line(self.dimensions, state_values(loads), STATE_METRICS))

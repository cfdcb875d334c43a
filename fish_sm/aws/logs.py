"""An endpoint's container logs: CloudWatch Logs group /aws/sagemaker/Endpoints/NAME, every
instance's stream interleaved by time."""

from __future__ import annotations

import re
import time
from typing import Callable, Iterator

from fish_sm.aws import AWSError
from fish_sm.aws.naming import check_name
from fish_sm.aws.session import AWS, error_code
from fish_sm.errors import InputError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FOLLOW_POLL_S = 2.0


def log_group(name: str) -> str:
    return f"/aws/sagemaker/Endpoints/{name}"


def parse_since(text: str) -> int:
    """'90s', '10m', '2h', '1d' -> seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhd])\s*", text or "")
    if not m:
        raise InputError(f"--since must be a number and a unit (s, m, h, d), e.g. 10m; got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _events(aws: AWS, name: str, start_ms: int) -> list[dict]:
    """Every event from start_ms on, all streams, sorted by time (then stream, for a stable order)."""
    events = []
    try:
        for page in aws.logs.get_paginator("filter_log_events").paginate(logGroupName=log_group(name),
                                                                         startTime=start_ms):
            events.extend(page.get("events", []))
    except Exception as exc:
        if error_code(exc) == "ResourceNotFoundException":
            raise AWSError(f"no logs for endpoint {name}: log group {log_group(name)} does not exist "
                           f"in {aws.region_name} (not deployed, or no instance has started yet)") from None
        raise
    return sorted(events, key=lambda e: (e["timestamp"], e.get("logStreamName", ""), e.get("eventId", "")))


def endpoint_logs(aws: AWS, name: str, *, since_s: int = 600, tail: int | None = None, follow: bool = False,
                  poll_s: float = FOLLOW_POLL_S, sleep: Callable[[float], None] = time.sleep,
                  now: Callable[[], float] = time.time) -> Iterator[dict]:
    """Log events (timestamp ms, logStreamName, message) of the last `since_s` seconds, the last
    `tail` of them if given; with follow, then new ones as they come, until interrupted."""
    check_name(name)
    if tail is not None and tail < 0:
        raise InputError(f"--tail must be at least 0, got {tail}")
    events = _events(aws, name, int((now() - since_s) * 1000))
    if tail is not None:
        events = events[len(events) - tail:] if tail else []
    yield from events
    if not follow:
        return
    start = events[-1]["timestamp"] if events else int(now() * 1000)
    seen = {e.get("eventId"): e["timestamp"] for e in events if e["timestamp"] == start}
    while True:
        sleep(poll_s)
        # From the last time seen, not after it: events of that millisecond may still arrive.
        new = [e for e in _events(aws, name, start) if e.get("eventId") not in seen]
        if new:
            start = new[-1]["timestamp"]
            seen.update((e.get("eventId"), e["timestamp"]) for e in new)
            seen = {i: t for i, t in seen.items() if t >= start}  # older ones cannot come back
        yield from new

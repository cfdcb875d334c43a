"""Plain HTTP to `fish-sm serve` (or any server speaking SageMaker's container contract).

urllib rather than requests: one POST needs no dependency. A request with `"stream": true`
is answered chunked as it is generated, and read chunk by chunk.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

from fish_sm.clients.response import Response, ServiceError, error_text
from fish_sm.clients.stream import stream_response
from fish_sm.errors import InputError

_READ_BYTES = 64 * 1024


def base_url(url: str) -> str:
    """http://host:port from a URL that may end in / or /invocations."""
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/invocations")] if url.endswith("/invocations") else url


def ping(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(base_url(url) + "/ping", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def server_info(url: str, timeout_s: float = 5.0) -> tuple[str, dict | None]:
    """(device, /ping's JSON) for a benchmark's report: the device is what the server says
    ("device" or "devices" in /ping's answer), else "unknown"; the JSON is None when /ping
    answers none."""
    try:
        with urllib.request.urlopen(base_url(url) + "/ping", timeout=timeout_s) as r:
            doc = json.loads(r.read(64 * 1024))
    except (OSError, ValueError, http.client.HTTPException):
        return "unknown", None
    if not isinstance(doc, dict):
        return "unknown", None
    device = doc.get("device") or doc.get("devices")
    if isinstance(device, list):
        device = ", ".join(map(str, device))
    return (str(device) if device else "unknown"), doc


class UrlTarget:
    """POST /invocations on a server speaking the SageMaker container contract."""

    def __init__(self, url: str, timeout_s: float = 900):
        self.url, self.timeout_s = base_url(url), timeout_s

    def __str__(self) -> str:
        return self.url

    def send(self, request: dict, accept: str = "audio/wav") -> Response:
        """POST the request; a streamed answer is read chunk by chunk as the server sends it."""
        req = urllib.request.Request(self.url + "/invocations", data=json.dumps(request).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": accept})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                content_type = r.headers.get("Content-Type", accept)
                rate = r.headers.get("X-Sample-Rate")
                rate = int(rate) if rate and rate.isdigit() else request.get("sample_rate")
                if request.get("stream"):
                    # read1: whatever the current chunk holds, without waiting to fill the buffer
                    return stream_response(iter(lambda: r.read1(_READ_BYTES), b""), content_type, t0, rate)
                body = r.read()
        except urllib.error.HTTPError as exc:
            message = f"{self.url} answered {exc.code}: {error_text(exc.read())}"
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            if exc.code == 503 and retry_after:  # full: a refusal to count, not a failure
                raise ServiceError(message, "rejected", exc.code, retry_after) from None
            raise ServiceError(message, f"HTTP {exc.code}", exc.code) from None
        except (TimeoutError, socket.timeout):
            raise ServiceError(f"{self.url}: no answer within {self.timeout_s:g} s", "timeout") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise ServiceError(f"{self.url}: no answer within {self.timeout_s:g} s", "timeout") from None
            raise ServiceError(f"cannot reach {self.url}: {exc.reason}", "connection") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise ServiceError(f"{self.url}: connection broken ({type(exc).__name__}: {exc})", "connection") from None
        return Response(body, content_type, time.perf_counter() - t0, sample_rate=rate)

"""A readiness gate in front of the model server.

The multi-model server answers `/ping` with 200 as soon as it listens, while its workers
are still loading, compiling and warming up (and whatever a worker's state, it never
answers anything else). SageMaker would route traffic to a container that cannot serve
it yet. So the public port is served here (aiohttp, with `http`'s guards): `GET /ping` is
200 only once every worker has finished `model_fn` — each one leaves a marker file with
its pid — and at least one is still alive afterwards. A worker that cannot load the model
leaves a failure marker with its one-line error instead, so that the launcher can stop a
server whose model will never load rather than let the model server restart it forever.

`POST /invocations` is the one request passed on; any other path is a 404 and any other
method a 405, so nothing reaches the rest of the model server's API. A request's body is
read whole here, within the body timeout and the size limit, before a connection to the
model server is taken from a bounded pool: a client that stalls its upload holds none.
The response is streamed back as it comes, and the model server's own errors (its
`{"code", "type", "message"}` objects, or plain text) become our `{"error": message}`.

Every answer writes its CloudWatch metrics line here (`serving.metrics`), as the batching
server's do: the gate sees every request, those it or the model server turn away too, and the
worker that answered adds its audio, the time it took the request and its adapter in headers (see
`serving.metrics.STARTED_HEADER`), which the client does not get.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from http import HTTPStatus
from pathlib import Path

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, ConnectionTimeoutError, TCPConnector, web

from fish_sm.serving.errors import HTTPError
from fish_sm.serving.http import Limits, application, error_response, read_body
from fish_sm.serving.metrics import WORKER_HEADERS, Metrics, RequestFigures
from fish_sm.serving.request import JSON, JSONLINES_ALIASES, media_type

logger = logging.getLogger("fish_sm.serving")

READY_DIR_ENV = "FISH_SM_READY_DIR"  # also a Settings field, so the strict settings parser knows it
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
                "proxy-authenticate", "host", "content-length"}
# The body is forwarded as read here: already decoded by aiohttp, and with no 100-continue to wait for.
_NOT_FORWARDED = _HOP_HEADERS | {"content-encoding", "expect"}
CONNECTION_WAIT = 5.0  # seconds a request waits for a free connection to the model server before a 503
ERROR_BODY_LIMIT = 64 * 1024  # bytes of a model server error read to find its message


FAILED = "failed-"  # a failure marker's name: failed-<device>-<pid>, holding the worker's one-line error


def mark_ready(device: str = "") -> None:
    """Called by a worker when its model is loaded and warm; its device's earlier failures no longer count."""
    ready_dir = os.environ.get(READY_DIR_ENV)
    if ready_dir:
        Path(ready_dir).mkdir(parents=True, exist_ok=True)
        (Path(ready_dir) / str(os.getpid())).write_text("ready\n")
        for marker in Path(ready_dir).glob(f"{FAILED}{device or '*'}-*"):
            marker.unlink(missing_ok=True)


def mark_failed(device: str, message: str) -> None:
    """Called by a worker whose model could not be loaded, before it exits: the launcher counts these."""
    ready_dir = os.environ.get(READY_DIR_ENV)
    if ready_dir:
        Path(ready_dir).mkdir(parents=True, exist_ok=True)
        (Path(ready_dir) / f"{FAILED}{device}-{os.getpid()}").write_text(message)


def live_ready_workers(ready_dir: Path) -> int:
    n = 0
    for marker in ready_dir.glob("[0-9]*"):
        try:
            os.kill(int(marker.name), 0)
            n += 1
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            n += 1
    return n


def load_failure(ready_dir: Path, attempts: int) -> str | None:
    """The last error of a device whose worker has failed to load the model `attempts` times
    since it last loaded it; None while every device may still come up."""
    by_device: dict[str, list[Path]] = {}
    for marker in ready_dir.glob(FAILED + "*"):
        by_device.setdefault(marker.name[len(FAILED):].rpartition("-")[0], []).append(marker)
    for device, markers in sorted(by_device.items()):
        if len(markers) >= attempts:
            try:
                last = max(markers, key=lambda m: m.stat().st_mtime_ns)
                cause = " ".join(last.read_text(errors="replace").split()) or "no message"
            except FileNotFoundError:  # the device's worker has just loaded it after all
                continue
            n = len(markers)
            return f"the model did not load on {device} after {n} attempt{'s' * (n != 1)}; the last error: {cause}"
    return None


def is_utf8_text(content_type: str | None) -> bool:
    """The content types whose bodies the toolkit and our handler decode as UTF-8."""
    kind = media_type(content_type)
    return kind.startswith("text/") or kind == JSON or kind.endswith("+json") or kind in JSONLINES_ALIASES


class Front:
    def __init__(self, backend: str, ready_dir: Path, workers: int, timeout: float, *, connections: int,
                 connection_wait: float = CONNECTION_WAIT, metrics: Metrics | None = None):
        self.invocations_url = backend.rstrip("/") + "/invocations"
        self.metrics = metrics or Metrics("mms", enabled=False)
        self.ready_dir, self.workers, self.connections = ready_dir, workers, connections
        # `connect` covers waiting for a free pooled connection as well as opening one.
        self.timeout = ClientTimeout(total=timeout, connect=connection_wait, sock_read=timeout)
        self.started = False  # every worker has been ready once
        self.session: ClientSession | None = None

    def healthy(self) -> bool:
        n = live_ready_workers(self.ready_dir)
        if n >= self.workers:
            self.started = True
        return n >= 1 if self.started else False

    async def ping(self, request: web.Request) -> web.Response:
        if self.healthy():
            return web.json_response({"status": "Healthy"})
        return web.json_response({"status": "Loading" if not self.started else "Unhealthy"}, status=503)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """Pass the request on, then write its metrics line (none for a client that left unanswered)."""
        figures = RequestFigures(status=0)
        response = await self._invocations(request, figures)
        figures.status = response.status
        self.metrics.request(figures)
        return response

    async def _invocations(self, request: web.Request, figures: RequestFigures) -> web.StreamResponse:
        try:
            body = await read_body(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message, close=True)
        if is_utf8_text(request.content_type):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError:
                return error_response(400, "the request body is not UTF-8 text")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        forwarded_at = time.time()
        try:
            upstream = await self.session.post(self.invocations_url, data=body, headers=headers, timeout=self.timeout)
        except ConnectionTimeoutError:
            figures.rejected = True
            return error_response(503, "the model server is busy: no connection to it came free in time; retry")
        except asyncio.TimeoutError:
            return error_response(504, "the model server did not answer in time")
        except ClientError as exc:
            return error_response(503, f"the model server is not reachable ({type(exc).__name__})")
        async with upstream:
            # A 503 no worker took is the model server's own: no worker free and its queue full.
            answered = figures.add_worker_answer(upstream.headers, forwarded_at)
            figures.rejected = upstream.status == 503 and not answered
            if upstream.status >= 400:
                return await _json_error(upstream)
            return await _relay(request, upstream)

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(connector=TCPConnector(limit=self.connections, limit_per_host=self.connections),
                                     auto_decompress=False,
                                     skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"))

    async def stop(self, app: web.Application) -> None:
        await self.session.close()


async def _relay(request: web.Request, upstream: ClientResponse) -> web.StreamResponse:
    """Stream the model server's answer through; a failure midway (its timeout, its connection
    dropped) propagates, so aiohttp closes the client's connection on a visibly cut answer."""
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for k, v in upstream.headers.items():
        if k.lower() not in _HOP_HEADERS and k.lower() not in WORKER_HEADERS:
            response.headers[k] = v
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    await response.prepare(request)
    async for chunk in upstream.content.iter_chunked(1 << 16):
        await response.write(chunk)
    await response.write_eof()
    return response


async def _json_error(upstream: ClientResponse) -> web.Response:
    """The model server's error with its status, in our shape; a message of one line."""
    try:
        raw = await upstream.content.read(ERROR_BODY_LIMIT)
    except (ClientError, asyncio.TimeoutError):
        raw = b""
    message = error_message(raw) or upstream.reason or HTTPStatus(upstream.status).phrase
    if upstream.status >= 500:
        logger.warning("the model server answered %d: %s", upstream.status, message)
    return error_response(upstream.status, message)


def error_message(raw: bytes) -> str:
    """Our handler's `{"error": ...}`, MMS's `{"message": ...}`, or the first line of plain text
    (the toolkit's default error is the message, then a traceback); "" if there is none."""
    try:
        doc = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", errors="replace")
        return next((line.strip()[:1000] for line in text.splitlines() if line.strip()), "")
    for key in ("error", "message"):
        if isinstance(doc, dict) and isinstance(doc.get(key), str) and doc[key].strip():
            return doc[key].strip().splitlines()[0][:1000]
    return ""


def make_app(front: Front, limits: Limits) -> web.Application:
    app = application(limits)
    app.router.add_get("/ping", front.ping, allow_head=False)
    app.router.add_post("/invocations", front.invocations)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    return app

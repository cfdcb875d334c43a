"""A readiness gate in front of the model server.

The multi-model server answers `/ping` with 200 as soon as it listens, while its workers
are still loading, compiling and warming up (and whatever a worker's state, it never
answers anything else). SageMaker would route traffic to a container that cannot serve
it yet. So the public port is served here (aiohttp): `/ping` is 200 only once every
worker has finished `model_fn` — each one leaves a marker file with its pid — and at
least one is still alive afterwards; everything else is streamed through to the model
server on a private port, bodies unbuffered.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

READY_DIR_ENV = "FISH_SM_READY_DIR"  # also a Settings field, so the strict settings parser knows it
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
                "proxy-authenticate", "host", "content-length"}


def mark_ready() -> None:
    """Called by a worker when its model is loaded and warm."""
    ready_dir = os.environ.get(READY_DIR_ENV)
    if ready_dir:
        Path(ready_dir).mkdir(parents=True, exist_ok=True)
        (Path(ready_dir) / str(os.getpid())).write_text("ready\n")


def live_ready_workers(ready_dir: Path) -> int:
    n = 0
    for marker in ready_dir.glob("*"):
        try:
            os.kill(int(marker.name), 0)
            n += 1
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            n += 1
    return n


class Front:
    def __init__(self, backend: str, ready_dir: Path, workers: int, timeout: float):
        self.backend, self.ready_dir, self.workers = backend.rstrip("/"), ready_dir, workers
        self.timeout = ClientTimeout(total=timeout, sock_connect=10)
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

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            async with self.session.request(request.method, self.backend + request.rel_url.path_qs, headers=headers,
                                            data=request.content if request.can_read_body else None,
                                            timeout=self.timeout) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP_HEADERS:
                        response.headers[k] = v
                if upstream.content_length is not None:
                    response.content_length = upstream.content_length
                await response.prepare(request)
                async for chunk in upstream.content.iter_chunked(1 << 16):
                    await response.write(chunk)
                await response.write_eof()
                return response
        except asyncio.TimeoutError:
            return _error(504, "the model server did not answer in time")
        except OSError as exc:
            return _error(503, f"the model server is not reachable ({type(exc).__name__})")

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(auto_decompress=False)

    async def stop(self, app: web.Application) -> None:
        await self.session.close()


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=json.dumps({"error": message}), content_type="application/json")


def make_app(front: Front, max_body: int) -> web.Application:
    app = web.Application(client_max_size=max_body)
    app.router.add_get("/ping", front.ping)
    app.router.add_route("*", "/{tail:.*}", front.proxy)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    return app

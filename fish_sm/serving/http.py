"""What our two aiohttp servers (the batching server and the model server's readiness gate)
share against hostile clients.

- Request headers must arrive within `header_timeout` of their first byte, bodies within
  `body_timeout` of the handler asking for them: a client that trickles bytes
  (slowloris) loses its connection instead of holding it for as long as it likes.
- A body whose `Content-Length` is over the limit is refused with 413 at once, before a
  byte of it is read, and the connection is closed rather than drained.
- Every error either server sends, aiohttp's own included (unknown path, wrong method,
  malformed HTTP), is the JSON object `{"error": message}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from fish_sm.errors import ConfigError
from fish_sm.serving.errors import HTTPError

PAYLOAD_LIMIT = 100 * 1024 * 1024  # bytes, each way: an hour of 44.1 kHz 16-bit WAV is 318 MB, so ~15 min


@dataclass(frozen=True)
class Limits:
    max_body: int = PAYLOAD_LIMIT
    header_timeout: float = 10.0  # seconds from a request's first byte to the end of its headers
    body_timeout: float = 60.0  # seconds for the whole body, once the handler reads it


    @classmethod
    def from_settings(cls, settings) -> "Limits":
        return cls(header_timeout=settings.header_timeout, body_timeout=settings.body_timeout)


LIMITS = web.AppKey("limits", Limits)


class GuardedProtocol(RequestHandler):
    """aiohttp's connection handler, closing a connection whose request headers do not
    arrive in time: bytes that come while no request is being handled start a clock that
    only the start of a request's handler stops. Idle kept-alive connections are left to
    aiohttp's keep-alive timeout."""

    def __init__(self, manager: web.Server, *, header_timeout: float, **kwargs):
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._header_clock: asyncio.TimerHandle | None = None
        self._handling = 0

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if data and not self._handling and self._header_clock is None and self.transport is not None:
            self._header_clock = asyncio.get_running_loop().call_later(self._header_timeout, self._headers_late)

    def request_started(self) -> None:
        self._handling += 1
        if self._header_clock is not None:
            self._header_clock.cancel()
            self._header_clock = None

    def request_finished(self) -> None:
        self._handling -= 1

    def _headers_late(self) -> None:
        self._header_clock = None
        if not self._handling:
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_clock is not None:
            self._header_clock.cancel()
            self._header_clock = None
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Malformed HTTP (and aiohttp's own failures): its status, in our JSON shape."""
        response = super().handle_error(request, status, exc, message)  # logs; raises if the response began
        text = HTTPStatus(response.status).phrase if response.status >= 500 else (message or HTTPStatus(response.status).phrase)
        return error_response(response.status, text.splitlines()[0] if text else "error", close=True)


def error_response(status: int, message: str, *, headers: dict | None = None, close: bool = False) -> web.Response:
    response = web.Response(status=status, body=json.dumps({"error": message}), content_type="application/json",
                            headers=headers)
    if close:
        response.force_close()
    return response


@web.middleware
async def guard(request: web.Request, handler) -> web.StreamResponse:
    """Marks the connection busy for the header clock, refuses an oversized body from its
    Content-Length, and answers aiohttp's HTTP exceptions (404, 405, 413...) as JSON."""
    protocol = request.protocol
    guarded = isinstance(protocol, GuardedProtocol)
    if guarded:
        protocol.request_started()
    try:
        limit = request.app[LIMITS].max_body
        if request.content_length is not None and request.content_length > limit:
            return error_response(413, f"the request body is {request.content_length} bytes; the limit is {limit}",
                                  close=True)
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        message = {404: f"no such path: {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
        return error_response(exc.status, message, headers=headers, close=exc.status == 413)
    finally:
        if guarded:
            protocol.request_finished()


async def read_body(request: web.Request) -> bytes:
    """The whole body within the app's limits: 413 if too large, 408 if too slow."""
    limits = request.app[LIMITS]
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"the request body did not arrive within {limits.body_timeout:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise HTTPError(413, f"the request body is over the {limits.max_body} byte limit") from None


def application(limits: Limits) -> web.Application:
    app = web.Application(client_max_size=limits.max_body, middlewares=[guard])
    app[LIMITS] = limits
    return app


@contextlib.asynccontextmanager
async def listening(app: web.Application, host: str, port: int, *, handler_cancellation: bool = False,
                    sock: socket.socket | None = None):
    """Serve `app` on host:port (or on `sock`, from `bind`) with guarded connections until the
    block exits. The port is bound before the app starts, so a port in use stops the server
    before it loads anything."""
    sock = sock or bind(host, port)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    loop = asyncio.get_running_loop()
    header_timeout = app[LIMITS].header_timeout

    def protocol() -> GuardedProtocol:
        # No lingering: after `guard`'s 413 or `read_body`'s 408, aiohttp would otherwise go on
        # reading and discarding the unfinished body for 10 s instead of closing the connection.
        return GuardedProtocol(runner.server, loop=loop, access_log=None, header_timeout=header_timeout,
                               lingering_time=0)

    try:
        await runner.setup()
        server = await loop.create_server(protocol, sock=sock)
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    try:
        yield server
    finally:
        server.close()
        await runner.cleanup()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (SO_REUSEADDR, as aiohttp sets it); ConfigError in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {(exc.strerror or str(exc)).lower()}") from None
    sock.setblocking(False)
    return sock

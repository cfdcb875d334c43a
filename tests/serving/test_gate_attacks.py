"""Attacks on `fish-sm serve --server mms` from loopback, each followed by a valid request.

The readiness gate passes on `POST /invocations` alone and never the model server's
management API (which listens on a unix socket in the server's private directory), reads
request bodies itself within its timeouts and limits, answers every error as JSON, and
each server keeps its sockets in its own temporary directory, gone once it stops.
"""

import asyncio
import getpass
import http.client
import io
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import soundfile as sf
from aiohttp import ClientSession, web

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd

from fish_sm.serving.mms.gate import Front, error_message, make_app
from fish_sm.serving.mms.launcher import socket_root
from fish_sm.serving.http import Limits, listening

TIMEOUT_S = 2.0  # the gate's header and body timeouts in this module
MMS_REQUEST_LIMIT = 256 * 1024  # MMS's own limit here, under the gate's, so that MMS answers a 413 itself
VALID = {"text": "Still fine.", "max_new_tokens": 2, "seed": 0}  # (some seeds end at once: a 422)


def start_server(package_dir: Path, tmp: Path) -> Server:
    """`fish-sm serve --server mms` whose temporary directories all go under a fresh directory in
    /tmp (short enough for unix sockets wherever pytest's tmp_path is; the caller removes it)."""
    temp = Path(tempfile.mkdtemp(prefix="gate-", dir="/tmp"))
    port = free_port()
    env = {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp / "cache"), "TMPDIR": str(temp),
           "FISH_SM_HEADER_TIMEOUT": str(TIMEOUT_S), "FISH_SM_BODY_TIMEOUT": str(TIMEOUT_S),
           "MMS_MAX_REQUEST_SIZE": str(MMS_REQUEST_LIMIT)}
    s = Server(serve_cmd(package_dir, port), port, env, tmp / "server.log")
    s.port, s.temp = port, temp
    return s


@pytest.fixture(scope="module")
def server(package_dir, tmp_path_factory):
    s = start_server(package_dir, tmp_path_factory.mktemp("gate"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
        shutil.rmtree(s.temp, ignore_errors=True)


def private_dir(server: Server) -> Path:
    (found,) = [p for p in server.temp.iterdir() if p.name.startswith("fish-sm-serve-")]
    return found


def assert_still_serving(server: Server) -> None:
    status, headers, body = request(server.url + "/invocations", VALID, timeout=60)
    assert status == 200 and headers["Content-Type"] == "audio/wav", body[:300]
    assert sf.info(io.BytesIO(body)).samplerate == 44100


def assert_json_error(status: int, headers, body: bytes, expected: int) -> str:
    assert status == expected, body[:300]
    assert headers["Content-Type"].startswith("application/json"), headers
    doc = json.loads(body)
    assert list(doc) == ["error"] and doc["error"] and "\n" not in doc["error"]
    return doc["error"]


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"the connection is still open; got {data[:200]!r}") from None
        if not chunk:
            return data
        data += chunk


def raw_status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def raw_json_body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def unix_sockets(group: int) -> set[str]:
    """Paths of the unix sockets the processes of a process group hold (Java's, and its
    Python workers', which listen for Java to connect)."""
    inodes = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            links = [os.readlink(fd) for fd in (stat.parent / "fd").iterdir()]
        except (OSError, ValueError):
            continue
        inodes.update(link[8:-1] for link in links if link.startswith("socket:["))
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            paths.add(fields[7])
    return paths


def model_server_pids(tmp_dir: Path) -> list[int]:
    """The Java model servers whose temporary directory is tmp_dir."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"com.amazonaws.ml.mms.ModelServer" in args and f"-Djava.io.tmpdir={tmp_dir}".encode() in args:
            pids.append(int(cmdline.parent.name))
    return pids


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path):
        super().__init__("localhost", timeout=30)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.socket_path))


def unix_http(path: Path, method: str, target: str) -> tuple[int, bytes]:
    connection = UnixHTTPConnection(path)
    try:
        connection.request(method, target)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


# -- only POST /invocations reaches the model server --------------------------------------

OTHER_REQUESTS = [
    ("PUT", "/models/model?min_worker=0&max_worker=0&synchronous=true", 404),
    ("POST", "/models?url=/tmp/evil&handler=evil:handle&initial_workers=1", 404),
    ("GET", "/models", 404),
    ("DELETE", "/models/model", 404),
    ("GET", "/api-description", 404),
    ("OPTIONS", "/", 404),
    ("POST", "/predictions/model", 404),
    ("POST", "/ping", 405),
    ("GET", "/ping/", 404),
    ("POST", "/invocations/", 404),
    ("PUT", "/invocations", 405),
    ("DELETE", "/invocations", 405),
    ("PATCH", "/invocations", 405),
    ("GET", "/invocations", 405),
]


@pytest.mark.parametrize("method, path, expected", OTHER_REQUESTS, ids=[f"{m} {p}" for m, p, _ in OTHER_REQUESTS])
def test_only_post_invocations_is_passed_on(server, method, path, expected):
    body = json.dumps(VALID) if method in ("POST", "PUT", "PATCH") else None
    status, headers, out = request(server.url + path, body, method=method)
    assert_json_error(status, headers, out, expected)
    assert_still_serving(server)


def test_management_api_is_on_a_private_unix_socket_the_gate_never_reaches(server):
    home = private_dir(server)
    assert home.stat().st_mode & 0o077 == 0  # only its owner may enter it, or open the sockets in it
    props = dict(line.split("=", 1) for line in (home / "mms.properties").read_text().splitlines() if "=" in line)
    assert props["management_address"] == f"unix:{home / 'management.sock'}"
    inference_port = int(props["inference_address"].rsplit(":", 1)[1])
    assert props["inference_address"] == f"http://127.0.0.1:{inference_port}" and inference_port != server.port
    # The model server logged the valid requests that came through the gate, and nothing else.
    access_log = (home / "logs" / "access_log.log").read_text()
    assert "/invocations" in access_log
    assert not any(p in access_log for p in ("/models", "/api-description", "/predictions", "/ping"))
    # The management API answers on its socket (to the model server's owner), with the model's one worker...
    status, answer = unix_http(home / "management.sock", "GET", "/models/model")
    assert status == 200 and json.loads(answer)["workers"][0]["status"] == "READY"
    # ...and not on the inference port.
    status, _, _ = request(f"http://127.0.0.1:{inference_port}/models", timeout=10)
    assert status in (404, 405)
    assert_still_serving(server)


# -- slow and oversized requests ----------------------------------------------------------


def test_stalled_uploads_do_not_block_invocations(server):
    stalled = []
    try:
        for _ in range(120):
            sock = connect(server)
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"text\": ")
            stalled.append(sock)
        sent = time.monotonic()
        assert_still_serving(server)
        assert time.monotonic() - sent < 20  # seconds on a busy CPU; the old gate hung for good
        deadline = sent + TIMEOUT_S + 15
        for sock in stalled:
            answer = read_until_closed(sock, deadline)
            assert answer == b"" or raw_status(answer) == 408, answer[:300]
            if answer:
                assert "did not arrive within" in raw_json_body(answer)["error"]
        assert time.monotonic() - sent >= TIMEOUT_S * 0.9  # they were given their time
    finally:
        for sock in stalled:
            sock.close()
    assert_still_serving(server)


def test_slow_headers_are_cut_off(server):
    slow = []
    try:
        for _ in range(20):
            sock = connect(server)
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(sock)
        sent = time.monotonic()
        for sock in slow:
            read_until_closed(sock, sent + TIMEOUT_S + 15)
        assert time.monotonic() - sent >= TIMEOUT_S * 0.9
    finally:
        for sock in slow:
            sock.close()
    assert_still_serving(server)


def test_a_huge_content_length_is_refused_at_once(server):
    with connect(server) as sock:
        sent = time.monotonic()
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000000000\r\n\r\n{\"text\":")
        answer = read_until_closed(sock, sent + 15)
        assert time.monotonic() - sent < TIMEOUT_S  # before the body timeout could have fired
    assert raw_status(answer) == 413 and "5000000000" in raw_json_body(answer)["error"]
    assert_still_serving(server)


# -- bodies the model server must not see --------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "text/plain",
                                          "application/jsonlines"])
def test_a_body_that_is_not_utf8_is_400_at_the_gate(server, content_type):
    status, headers, out = request(server.url + "/invocations", b'{"text": "caf\xe9 \xff"}', content_type)
    assert "not UTF-8" in assert_json_error(status, headers, out, 400)
    assert_still_serving(server)


@pytest.mark.parametrize("body", ["[" * 100000, '{"text": "hi", "seed": 1' + "0" * 4999 + "}"],
                         ids=["deeply nested", "5000-digit integer"])
def test_parser_attacks_are_400(server, body):
    status, headers, out = request(server.url + "/invocations", body)
    assert_json_error(status, headers, out, 400)
    assert_still_serving(server)


# -- the model server's own errors ---------------------------------------------------------


def test_the_model_servers_own_413_is_our_json(server):
    body = json.dumps({"text": "x" * (MMS_REQUEST_LIMIT + 1000)})  # under the gate's limit, over MMS's
    status, headers, out = request(server.url + "/invocations", body)
    assert_json_error(status, headers, out, 413)
    assert_still_serving(server)


def test_error_messages_of_the_model_server_become_one_line():
    assert error_message(b'{"error": "too long"}') == "too long"
    assert error_message(b'{"code": 503, "type": "ServiceUnavailableException", "message": "Worker died."}') \
        == "Worker died."
    assert error_message(b"division by zero\nTraceback (most recent call last):\n  ...") == "division by zero"
    assert error_message(b'{\n  "code": 500\n}') == error_message(b"") == ""  # the reason phrase stands in


def test_a_full_pool_is_503_busy_a_silent_model_server_504_and_errors_are_json(tmp_path):
    """The gate against a stand-in model server: one pooled connection, short timeouts."""
    ready = tmp_path / "ready"
    ready.mkdir()
    (ready / str(os.getpid())).write_text("ready\n")

    async def scenario():
        arrived, release = asyncio.Event(), asyncio.Event()

        async def invocations(request: web.Request) -> web.Response:
            case = request.headers["X-Case"]
            if case == "silent":
                arrived.set()
                await release.wait()
            if case == "traceback":
                return web.Response(status=500, text="boom\nTraceback (most recent call last):\n  ...")
            return web.json_response({"code": 503, "type": "ServiceUnavailableException", "message": "Worker died."},
                                     status=503)

        backend = web.Application()
        backend.router.add_post("/invocations", invocations)
        runner = web.AppRunner(backend)
        await runner.setup()
        backend_port = free_port()
        await web.TCPSite(runner, "127.0.0.1", backend_port).start()
        front = Front(f"http://127.0.0.1:{backend_port}", ready, workers=1, timeout=1.5, connections=1,
                      connection_wait=0.5)
        gate_port = free_port()
        url = f"http://127.0.0.1:{gate_port}/invocations"
        try:
            async with listening(make_app(front, Limits(header_timeout=2, body_timeout=2)), "127.0.0.1", gate_port):
                async with ClientSession() as client:
                    async def post(case):
                        async with client.post(url, json=VALID, headers={"X-Case": case}) as r:
                            return r.status, r.content_type, await r.json()

                    for case, status, message in (("traceback", 500, "boom"), ("mms", 503, "Worker died.")):
                        assert await post(case) == (status, "application/json", {"error": message})
                    silent = asyncio.create_task(post("silent"))
                    await arrived.wait()
                    t0 = time.monotonic()
                    status, _, doc = await post("mms")
                    assert status == 503 and "busy" in doc["error"] and time.monotonic() - t0 < 1.4
                    status, _, doc = await silent
                    assert status == 504 and "in time" in doc["error"]
        finally:
            release.set()
            await runner.cleanup()

    asyncio.run(scenario())


# -- one server's files, and nobody else's ---------------------------------------------------


def mms_files_in_tmp() -> set[Path]:
    """What MMS leaves in the shared /tmp when not given a directory of its own."""
    return {*Path("/tmp").glob(".mms.sock.*"), *Path("/tmp").glob(".model_server.pid")}


def test_two_servers_keep_their_sockets_apart_and_leave_nothing(server, package_dir, tmp_path):
    """Last in this module: it stops the module's server too, to see what each leaves behind."""
    before = mms_files_in_tmp()
    second = start_server(package_dir, tmp_path)
    try:
        second.wait_ready()
        homes = [private_dir(s) for s in (server, second)]
        assert homes[0] != homes[1]
        for s, home in zip((server, second), homes):
            (java,) = model_server_pids(home)
            sockets = unix_sockets(os.getpgid(java))
            assert {str(home / ".mms.sock.9000"), str(home / "management.sock")} <= sockets
            assert all(path.startswith(str(home) + "/") for path in sockets), sockets
            assert (home / ".model_server.pid").is_file()
            assert not (Path("/tmp") / f"hsperfdata_{getpass.getuser()}" / str(java)).exists()
            assert_still_serving(s)
    finally:
        second.stop()
        server.stop()
    try:
        for s, home in zip((server, second), homes):
            assert s.proc.returncode == 0  # SIGTERM is a clean stop
            assert not model_server_pids(home)
            assert not any(s.temp.iterdir()), list(s.temp.rglob("*"))
        assert mms_files_in_tmp() <= before
    finally:
        shutil.rmtree(second.temp, ignore_errors=True)


def test_a_temp_directory_too_long_for_a_socket_falls_back_to_tmp(monkeypatch, tmp_path):
    long_root = tmp_path / ("d" * 80)
    long_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_root))
    assert socket_root() == "/tmp"
    monkeypatch.setattr(tempfile, "tempdir", "/var/tmp")
    assert socket_root() == "/var/tmp"

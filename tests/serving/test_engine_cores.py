"""The batching server as two kinds of process (issue 42): the HTTP front end, which never loads
torch, and an engine core per device, talking over zmq on private unix sockets. For real on
loopback (CPU, tiny package): the front end holds no torch, messages that are not the protocol's
are refused without harm, a core killed mid-request fails its requests with a JSON 503 and
turns /ping unhealthy; and a core on its own, driven over its sockets as the front end drives
it. (Draining on SIGTERM: test_batching_server.py's last test.)"""

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd

from fish_sm.serving import ipc

LONG = {"text": "A long utterance that holds the only slot.", "max_new_tokens": 2000, "seed": 0}


@pytest.fixture(scope="module")
def cores_server(package_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cores")
    port = free_port()
    s = Server(serve_cmd(package_dir, port, "batching"), port,
               {**QUICK_ENV, "FISH_SM_MAX_BATCH": "4", "FISH_SM_CACHE_DIR": str(tmp / "cache")}, tmp / "server.log")
    s.wait_ready()
    yield s
    s.stop()


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def core_of(server) -> tuple[int, dict]:
    """The (one, on a CPU) engine core's pid and its command line's options."""
    [pid] = children(server.proc.pid)
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert args[1:3] == ["-m", "fish_sm.serving.core"], args
    return pid, {args[i][2:]: args[i + 1] for i in range(3, len(args) - 1, 2)}


def libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def invoke(server, body, timeout=60):
    return request(server.url + "/invocations", body, timeout=timeout)


def test_the_front_end_serves_without_torch_and_each_core_owns_the_model(cores_server):
    status, headers, body = invoke(cores_server, {"text": "Streamed.", "max_new_tokens": 6, "seed": 0, "stream": True})
    assert status == 200 and headers["Transfer-Encoding"] == "chunked" and len(body) == 44 + 6 * 2048 * 2
    assert "libtorch" not in libraries(cores_server.proc.pid)  # the process that accepts HTTP
    pid, options = core_of(cores_server)
    assert "libtorch" in libraries(pid) and options["device"] == "auto" and options["parent"] == str(cores_server.proc.pid)
    # Its sockets are unix sockets in a private directory; nothing but the HTTP port listens on TCP.
    for address in (options["commands"], options["events"]):
        path = Path(address.removeprefix("ipc://"))
        assert address.startswith("ipc://") and stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert listening_ports([cores_server.proc.pid, pid]) == [int(cores_server.url.rsplit(":", 1)[1])]


def listening_ports(pids: list[int]) -> list[int]:
    """The TCP ports these processes listen on (from their sockets' inodes and /proc/net/tcp*)."""
    inodes = {os.readlink(f"/proc/{p}/fd/{fd}") for p in pids for fd in os.listdir(f"/proc/{p}/fd")}
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for fields in (line.split() for line in Path(table).read_text().splitlines()[1:]):
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_messages_that_are_not_the_protocols_are_refused_without_harm(cores_server):
    _, options = core_of(cores_server)
    context = zmq.Context()
    try:
        for address in (options["commands"], options["events"]):  # the core's socket, then the front end's
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(address)
            for frames in ([b"not msgpack at all"], [b"\x80\x04\x95pickle"], [b"{}", b"two frames"],
                           [msgspec.msgpack.encode({"type": "Shutdown", "extra": 1})],
                           [msgspec.msgpack.encode([{"type": "Audio", "id": 1}])],  # no samples frame
                           [msgspec.msgpack.encode({"type": "Submit", "id": "x", "job": {}})]):
                push.send_multipart(frames)
            # Well-formed, about requests that do not exist: ignored too.
            push.send(ipc.encode_command(ipc.Cancel(123456)) if address == options["commands"] else
                      ipc.encode_events([(ipc.Done(123456, 1, 0.1, 1.0, {}), None)])[0])
            push.close()
    finally:
        context.term()
    log = cores_server.log
    deadline = time.monotonic() + 10
    while not ("not a command was ignored" in log.read_text() and "not an event was ignored" in log.read_text()):
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    status, _, body = invoke(cores_server, {"text": "Still serving.", "max_new_tokens": 4, "seed": 0})
    assert status == 200 and request(cores_server.url + "/ping")[0] == 200
    assert "Traceback" not in log.read_text()


@contextlib.contextmanager
def core_on_its_own(model_dir, tmp_path):
    """A core run by a thread here, its sockets as the front end binds them: yields the core, the
    front end's two sockets (events to read, commands to send) and the list its exit status
    goes to."""
    from fish_sm.serving.core import Core
    from fish_sm.settings import Settings

    settings = Settings.from_env({**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp_path / "cache")})
    directory = ipc.private_directory()
    addresses = ipc.CoreAddresses.of(directory, 0)
    context = zmq.Context()
    events, commands = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    events.bind(addresses.events)
    commands.connect(addresses.commands)
    core, codes = Core(model_dir, "auto", addresses, settings), []
    thread = threading.Thread(target=lambda: codes.append(core.run()), daemon=True)
    thread.start()
    try:
        yield core, events, commands, codes
        thread.join(30)
        assert not thread.is_alive()
    finally:
        commands.close(linger=0)
        events.close(linger=0)
        context.term()
        shutil.rmtree(directory, ignore_errors=True)


def received(events, until) -> list:
    """(event, samples) from the core until one satisfies `until`."""
    got = []
    while not any(until(event) for event, _ in got):
        assert events.poll(60_000), got
        got += ipc.decode_events(events.recv_multipart())
    return got


def test_a_core_reads_nothing_in_the_model_directory_until_the_front_end_has_verified_it(tmp_path):
    """A core starts (imports, its device) while the front end hashes the package, then waits for
    its word. Its model directory here does not exist, so any read would fail its start
    (StartFailed, status 1): told to shut down instead, it exits 0 having said only Hello."""
    with core_on_its_own(tmp_path / "not-there", tmp_path) as (core, events, commands, codes):
        [(hello, _)] = received(events, lambda e: isinstance(e, ipc.Hello))
        commands.send(ipc.encode_command(ipc.Shutdown()))
    assert hello.device == "cpu" and codes == [0] and core.model is None and core.batcher is None


def test_a_core_on_its_own_speaks_the_protocol_and_drops_a_request_cancelled_while_its_reference_is_encoded(
        package_dir, tmp_path, tone, encode_audio):
    """A core (run by a thread here, its sockets as the front end binds them): Hello, then, once
    told the package is verified, Ready; each event in order with audio as raw float32 frames, a
    request cancelled right after it was sent never reaching the engine (whether its reference
    was waiting or being encoded), the next one served, and Shutdown ending it with status 0."""
    from fish_sm.settings import Settings

    settings = Settings.from_env(QUICK_ENV)
    with core_on_its_own(package_dir, tmp_path) as (core, events, commands, codes):
        commands.send(ipc.encode_command(ipc.Verified(None)))  # no token: the core verifies the package itself
        hello, ready = [e for e, _ in received(events, lambda e: isinstance(e, ipc.Ready)) if not isinstance(e, ipc.Load)]
        assert (hello.device, hello.devices, ready.voices, ready.sample_rate) == ("cpu", ["cpu"], ["narrator"], 44100)
        pieces = core.batcher.scheduler.pieces  # the settings' schedule, one for the scheduler and the codec
        assert pieces is core.batcher._codec.codec.schedule and pieces.repeats == settings.piece_repeats == 3

        def job(**fields):
            return ipc.JobSpec(**{"text": "Hello there.", "chunk_length": 200, "temperature": 0.8, "top_p": 0.8,
                                  "repetition_penalty": 1.1, "max_new_tokens": 4, "seed": 0, **fields})

        recording = encode_audio(tone(10.0, 44100), 44100, "WAV")  # takes a while to encode
        commands.send(ipc.encode_command(ipc.Submit(1, job(reference=recording, reference_text="A tone."))))
        commands.send(ipc.encode_command(ipc.Cancel(1)))
        commands.send(ipc.encode_command(ipc.Submit(2, job(voice="narrator", stream=True))))
        commands.send(ipc.encode_command(ipc.Submit(3, job(reference=recording, reference_text="A tone."))))
        got = received(events, lambda e: isinstance(e, ipc.Done) and e.id == 3)
        by_id = {}
        for event, samples in got:
            if hasattr(event, "id"):
                by_id.setdefault(event.id, []).append((type(event).__name__, samples))
        assert 1 not in by_id  # dropped: never submitted, nothing sent for it
        assert [kind for kind, _ in by_id[2]][0] == "Admitted" and by_id[2][-1][0] == "Done"
        audio = [samples for kind, samples in by_id[2] if kind == "Audio"]
        assert audio and all(a.dtype == "float32" for a in audio) and sum(map(len, audio)) == 4 * 2048
        assert [kind for kind, _ in by_id[3]] == ["Admitted", "Audio", "Done"]  # the encoder went on
        commands.send(ipc.encode_command(ipc.Shutdown()))
    assert codes == [0]


async def a_session_then_its_core_dies(url: str, kill) -> list:
    """A bidirectional session given a sentence; `kill()` is called; the messages it gets after."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url.replace("http://", "ws://") + "/invocations-bidirectional-stream") as ws:
            await ws.send_str(json.dumps({"seed": 0, "max_new_tokens": 2000}))
            assert (await ws.receive_json(timeout=30))["ready"]
            await ws.send_str(LONG["text"])  # a session holds its slot, speaking or not, until it ends
            assert (await ws.receive_json(timeout=30))["queued"] == 0
            kill()
            got = []
            async for msg in ws:
                got.append(json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else len(msg.data))
            return [m for m in got if isinstance(m, dict)]


def test_a_core_that_dies_fails_its_requests_with_a_json_503_and_the_server_turns_unhealthy(cores_server):
    """Last in this module: it kills the server's core."""
    pid, _ = core_of(cores_server)
    port = int(cores_server.url.rsplit(":", 1)[1])
    stream = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    stream.request("POST", "/invocations", json.dumps({**LONG, "stream": True}), {"Content-Type": "application/json"})
    streamed = stream.getresponse()
    assert streamed.status == 200 and streamed.read1(1 << 16)  # answering already
    whole = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    whole.request("POST", "/invocations", json.dumps(LONG), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while json.loads(request(cores_server.url + "/ping")[2])["load"][0]["active"] < 2:  # both in the engine
        assert time.monotonic() < deadline
        time.sleep(0.02)

    messages = asyncio.run(a_session_then_its_core_dies(cores_server.url, lambda: os.kill(pid, signal.SIGKILL)))
    assert messages[-1]["status"] == 503 and "unhealthy" in messages[-1]["error"], messages

    answer = whole.getresponse()  # the whole request's answer: a JSON error, not a hang or a traceback
    assert answer.status == 503 and answer.getheader("Content-Type").startswith("application/json")
    assert "unhealthy" in json.loads(answer.read())["error"]
    rest = streamed.read()  # the stream that had begun is cut short (its 200 went out)
    assert len(rest) < 2000 * 2048 * 2
    status, _, body = request(cores_server.url + "/ping")
    assert status == 503 and json.loads(body)["status"] == "Unhealthy"
    status, headers, body = invoke(cores_server, {"text": "Anyone there?", "max_new_tokens": 2, "seed": 0})
    assert status == 503 and "unhealthy" in json.loads(body)["error"] and "Retry-After" not in headers
    assert f"engine core 0 (cpu, pid {pid}) exited with status -9" in cores_server.log.read_text()
    assert cores_server.proc.poll() is None  # the front end goes on answering (unhealthy), never restarts a core
    assert children(cores_server.proc.pid) == []

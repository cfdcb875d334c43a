"""`fish-sm serve --server batching` for real on loopback: continuous batching, streaming,
backpressure, and the handler's request contract (CPU, tiny package; the module's server
serves it as the model.tar.gz `fish-sm package` writes)."""

import base64
import http.client
import io
import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from server_helpers import QUICK_ENV, Server, check_bad_request_then_a_good_one, free_port, request, serve_cmd
from test_server import SERVER_BAD, unpacked_dir

from fish_sm.package.tarball import make_tarball

LIMITS = {"FISH_SM_MAX_TEXT_CHARS": "100", "FISH_SM_MAX_REFERENCE_BYTES": "1000", "FISH_SM_ALLOWED_BUCKETS": "voices-ok"}


def start(package_dir, tmp, **env) -> Server:
    port = free_port()
    s = Server(serve_cmd(package_dir, port, "batching"), port,
               {**QUICK_ENV, **LIMITS, "FISH_SM_CACHE_DIR": str(tmp / "cache"), **env}, tmp / "server.log")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def server(package_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batching")
    s = start(make_tarball(package_dir, tmp / "model.tar.gz").path, tmp, FISH_SM_MAX_BATCH="8",
              FISH_SM_MAX_QUEUE="16", FISH_SM_MAX_NEW_TOKENS="128")  # a CPU takes 30 s for 1,024 frames
    yield s
    s.stop()


@pytest.fixture
def one_slot(package_dir, tmp_path):
    s = start(package_dir, tmp_path, FISH_SM_MAX_BATCH="1", FISH_SM_MAX_QUEUE="0")
    yield s
    s.stop()


def invoke(server, body, content_type="application/json", accept=None):
    return request(server.url + "/invocations", body, content_type, accept)


def pcm(wav: bytes) -> np.ndarray:
    return sf.read(io.BytesIO(wav), dtype="int16")[0].astype(np.int32)


def test_ping_is_503_until_the_engine_serves(server):
    assert server.pings[-1] == 200 and 200 not in server.pings[:-1]
    status, _, body = request(server.url + "/ping")
    assert json.loads(body)["load"] == [{"slots": 8, "active": 0, "waiting": 0, "max_queue": 16}]
    log = server.log.read_text()
    assert "ready with 8 slots" in log
    # The front end verified the unpacked package; its core took the front end's token for it
    # instead of hashing the package again.
    assert "files unchanged since the process that started this one verified them" in log


@pytest.mark.parametrize("body, ctype, status, message", SERVER_BAD, ids=[m for *_, m in SERVER_BAD])
def test_bad_requests_get_the_handlers_errors(server, body, ctype, status, message):
    check_bad_request_then_a_good_one(server, body, ctype, status, message)


@pytest.mark.parametrize("body, accept, status, message", [
    ({"text": "x", "stream": True, "format": "mp3"}, None, 400, "cannot be streamed"),
    ({"text": "x", "stream": True}, "application/json", 406, "audio/wav or audio/pcm"),
    ({"text": "x", "stream": True, "sample_rate": 16000}, None, 400, "sample_rate cannot be combined"),
    ({"text": "x", "stream": "yes"}, None, 400, "must be true or false"),
])
def test_bad_stream_requests(server, body, accept, status, message):
    got, _, out = invoke(server, body, accept=accept)
    assert got == status and message in json.loads(out)["error"]


@pytest.mark.parametrize("accept, fmt", [("audio/flac", "FLAC"), ("audio/ogg", "OGG"), ("*/*", "WAV")])
def test_accept_audio(server, accept, fmt):
    status, _, body = invoke(server, {"text": "Accept test.", "max_new_tokens": 4, "seed": 0}, accept=accept)
    assert status == 200 and sf.info(io.BytesIO(body)).format == fmt


def test_text_plain_json_and_jsonlines(server):
    status, headers, body = invoke(server, "Plain text.", "text/plain")
    assert status == 200 and headers["Content-Type"] == "audio/wav"
    status, headers, body = invoke(server, {"text": "As JSON.", "max_new_tokens": 4, "seed": 1}, accept="application/json")
    doc = json.loads(body)
    assert headers["Content-Type"] == "application/json"
    assert len(sf.read(io.BytesIO(base64.b64decode(doc["audio"])))[0]) == doc["frames"] * 2048
    lines = "\n".join(json.dumps({"text": f"Record {i}.", "max_new_tokens": 2 + i, "seed": i}) for i in range(4))
    status, headers, body = invoke(server, lines, "application/jsonlines", accept="application/jsonlines")
    docs = [json.loads(line) for line in body.decode().splitlines()]
    assert status == 200 and [d["frames"] for d in docs] == [2, 3, 4, 5]


def test_ten_concurrent_mixed_requests_equal_each_alone(server, tone, encode_audio):
    ref = base64.b64encode(encode_audio(tone(0.02, 16000), 16000, "WAV")).decode()
    bodies = []
    for i in range(10):
        body = {"text": ["Hello there.", "A longer sentence to speak, with a comma.", "Short.", "Numbers: 1, 2, 3."][i % 4],
                "max_new_tokens": 5 + 6 * i, "seed": 100 + i, "temperature": 0.5 + 0.05 * i, "top_p": 0.6 + 0.04 * i,
                "repetition_penalty": 1.0 + 0.1 * (i % 3)}
        if i % 3 == 1:
            body["voice"] = "narrator"
        elif i % 3 == 2:
            body["reference"] = {"audio": ref, "text": "Ref."}
        bodies.append(body)
    with ThreadPoolExecutor(10) as pool:
        together = list(pool.map(lambda b: invoke(server, b), bodies))
    alone = [invoke(server, b) for b in bodies]
    for (s1, _, a), (s2, _, b) in zip(together, alone):
        # The same codes give the same audio up to rounding: pieces decoded in a batch with
        # other requests' round differently in the last bits, a 16-bit sample by at most one step.
        assert s1 == s2 == 200 and len(a) == len(b)
        x, y = sf.read(io.BytesIO(a), dtype="int16")[0], sf.read(io.BytesIO(b), dtype="int16")[0]
        assert np.abs(x.astype(int) - y).max() <= 1
    assert len({len(b) for *_, b in alone}) > 5


def read_stream(server, body, accept="audio/wav"):
    """(headers, chunks with arrival times) of a streamed response, read as it comes."""
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    conn.request("POST", "/invocations", json.dumps(body), {"Content-Type": "application/json", "Accept": accept})
    response = conn.getresponse()
    chunks, t0 = [], time.perf_counter()
    while chunk := response.read1(1 << 20):
        chunks.append((time.perf_counter() - t0, chunk))
    conn.close()
    return response, chunks


def test_stream_arrives_in_pieces_that_concatenate_to_the_whole(server):
    body = {"text": "Streaming this sentence, piece by piece.", "max_new_tokens": 80, "seed": 7, "voice": "narrator"}
    whole = pcm(invoke(server, body)[2])
    response, chunks = read_stream(server, {**body, "stream": True})
    assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
    assert response.getheader("Content-Type") == "audio/wav"
    data = b"".join(c for _, c in chunks)
    assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff"  # a WAV of open length
    assert len(chunks) >= 3 and chunks[0][0] < chunks[-1][0]  # audio came before the end
    streamed = np.frombuffer(data[44:], "<i2").astype(np.int32)
    assert len(streamed) == len(whole) == 80 * 2048
    assert np.abs(streamed - whole).max() <= 2  # the streaming decoder rounds a little differently
    assert sf.info(io.BytesIO(data)).frames == len(whole)  # libsndfile reads it to its end
    response, chunks = read_stream(server, {**body, "stream": True}, accept="audio/pcm")
    assert response.getheader("Content-Type").startswith("audio/pcm;rate=44100")
    assert b"".join(c for _, c in chunks) == data[44:]
    # each request's line in the log says where its time went, in order
    line = [x for x in server.log.read_text().splitlines() if "stream done: " in x][-1]
    stages = re.findall(r"(accepted|admitted|first frame|first audio|first byte|total) (\d+) ms", line)
    assert [s for s, _ in stages] == ["accepted", "admitted", "first frame", "first audio", "first byte", "total"]
    upto_first_byte = [int(ms) for _, ms in stages[:5]]  # the total may be taken before the first write
    assert upto_first_byte == sorted(upto_first_byte)


def test_sigterm_lets_the_requests_in_flight_finish_then_the_server_and_its_cores_exit_0(server):
    """Last of the module server's tests: it stops it, with SIGTERM to its process group as
    `docker stop` sends it, while a stream is being answered. The stream ends whole, then the
    engine core is told to stop and exits 0, and the server exits 0, leaving neither the
    unpacked package nor the cores' private socket directory behind."""
    unpacked = unpacked_dir(server)
    assert (unpacked / "manifest.json").is_file() and (unpacked.stat().st_mode & 0o777) == 0o700
    [core] = [int(p) for p in open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()]
    sockets = re.search(r"--commands\0ipc://(\S+?)/core-0\.commands", open(f"/proc/{core}/cmdline").read()).group(1)
    body = {"text": "Streaming this sentence, piece by piece.", "max_new_tokens": 128, "seed": 7, "voice": "narrator"}
    whole = pcm(invoke(server, body)[2])
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    conn.request("POST", "/invocations", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read1(1 << 20)
    os.killpg(server.proc.pid, signal.SIGTERM)
    data += response.read()
    assert response.status == 200 and len(data) == 44 + 2 * len(whole)  # all of it
    assert server.proc.wait(timeout=60) == 0
    log = server.log.read_text()
    stopping = log.index("stopping: no new connections")
    assert log.index("stream done: ", stopping) < log.index("cpu: shutting down", stopping)
    assert f"engine core 0 (cpu, pid {core}) stopped (exit status 0)" in log
    assert not unpacked.exists() and not os.path.exists(sockets)


def test_overload_is_503_at_once_and_a_disconnect_frees_the_slot(one_slot):
    port = int(one_slot.url.rsplit(":", 1)[1])
    long = json.dumps({"text": "A long utterance that holds the only slot.", "max_new_tokens": 2000, "seed": 0,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(long) + long)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # streaming: the slot is taken
    status, headers, body = invoke(one_slot, {"text": "Me too.", "max_new_tokens": 2, "seed": 0})
    assert status == 503 and headers["Retry-After"] == "1" and "slots are busy" in json.loads(body)["error"]
    # Refused while the stream still held the slot: it did not wait for it.
    assert json.loads(request(one_slot.url + "/ping")[2])["load"][0]["active"] == 1
    sock.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while json.loads(request(one_slot.url + "/ping")[2])["load"][0]["active"]:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    status, _, _ = invoke(one_slot, {"text": "Now me.", "max_new_tokens": 2, "seed": 0})
    assert status == 200
    assert "stream ended early: " in one_slot.log.read_text()


def test_jsonlines_lines_wait_for_a_slot_instead_of_503(one_slot):
    lines = "\n".join(json.dumps({"text": f"Line {i}.", "max_new_tokens": 3, "seed": i}) for i in range(5))
    status, headers, body = invoke(one_slot, lines, "application/jsonlines", accept="application/jsonlines")
    assert status == 200 and [json.loads(line)["frames"] for line in body.decode().splitlines()] == [3] * 5

"""Hostile clients against the batching server and the request contract both servers share
(CPU, tiny package, real servers on loopback). Each test repeats an attack that once took a
server down, hung it or got a 500, and checks that a valid request still gets audio after it."""

import asyncio
import contextlib
import io
import json
import os
import queue
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd

from fish_sm.engine.audio import FILTER_BANK_LIMIT, _resample_per_sample, read_audio, resample
from fish_sm.errors import InputError
from fish_sm.serving.errors import HTTPError
from fish_sm.serving.request import parse_body, response_format
from fish_sm.settings import Settings

ENV = {**QUICK_ENV, "FISH_SM_MAX_BATCH": "2", "FISH_SM_MAX_QUEUE": "2", "FISH_SM_MAX_LINES": "64",
       "FISH_SM_HEADER_TIMEOUT": "1", "FISH_SM_BODY_TIMEOUT": "2", "FISH_SM_ALLOWED_BUCKETS": "voices-ok"}
GOOD = {"text": "Still fine.", "max_new_tokens": 2, "seed": 0}  # (some seeds end at once: a 422)


@pytest.fixture(scope="module")
def server(package_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attacks")
    port = free_port()
    s = Server(serve_cmd(package_dir, port, "batching"), port, {**ENV, "FISH_SM_CACHE_DIR": str(tmp / "cache")},
               tmp / "server.log")
    s.wait_ready()
    yield s
    s.stop()


def invoke(url, body, content_type="application/json", accept=None, timeout=60):
    return request(url + "/invocations", body, content_type, accept, timeout=timeout)


def still_serves(url):
    status, _, audio = invoke(url, GOOD)
    assert status == 200 and sf.info(io.BytesIO(audio)).samplerate == 44100
    assert request(url + "/ping")[0] == 200


def json_error(status_body):
    status, headers, body = status_body
    assert headers["Content-Type"].startswith("application/json") and b"Traceback" not in body
    return status, json.loads(body)["error"]


def raw(port: int, data: bytes, read: bool = True, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return sock.recv(65536) if read else b""


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- the request contract (both servers parse with it) ------------------------------------------

SETTINGS = Settings.from_env({"FISH_SM_ALLOWED_BUCKETS": "voices-ok", "FISH_SM_MAX_LINES": "5"})


@pytest.mark.parametrize("body, ctype, status, message", [
    ('{"text": "hi", "seed": 18446744073709551616}', "application/json", 400, "seed must be an integer in [0, 2^64 - 1]"),
    ('{"text": "hi", "seed": -1}', "application/json", 400, "seed must be an integer in [0, 2^64 - 1]"),
    ("[" * 100_000, "application/json", 400, "nested too deeply"),
    ('{"text": "hi", "seed": 1' + "0" * 5000 + "}", "application/json", 400, "an integer of 5001 digits"),
    ('{"text": "hi", "temperature": 1e999}', "application/json", 400, "numbers in a request"),
    ('{"text": "hi", "temperature": NaN}', "application/json", 400, "NaN"),
    ('{"text": ["' + "x" * 10_000 + '"]}', "application/json", 400, "'text' is required"),
    ('{"text": "hi", "voice": ["' + "x" * 10_000 + '"]}', "application/json", 400, 'got ["xxx'),
    ("\n".join(['{"text": "a"}'] * 6), "application/jsonlines", 413, "6 requests; the limit is 5"),
    ('{"text": "x", "reference": {"audio": "s3://voices-ok/a/../../secret.wav", "text": "t"}}', "application/json",
     400, "'..' segment"),
    ('{"text": "x", "reference": {"audio": "s3://voices-ok/./k.wav", "text": "t"}}', "application/json", 400, "segment"),
], ids=["seed-overflow", "seed-negative", "deep-json", "huge-int", "huge-float", "nan", "echo-text", "echo-voice",
        "too-many-lines", "s3-dotdot", "s3-dot"])
def test_hostile_bodies_are_4xx(body, ctype, status, message):
    with pytest.raises(HTTPError) as err:
        parse_body(body.encode(), ctype, SETTINGS)
    assert err.value.status == status and message in err.value.message
    assert len(err.value.message) < 300  # no echo of a payload


def test_a_foreign_bucket_is_403_without_the_allow_list():
    body = json.dumps({"text": "x", "reference": {"audio": "s3://other/k.wav", "text": "t"}})
    with pytest.raises(HTTPError) as err:
        parse_body(body, "application/json", SETTINGS)
    assert err.value.status == 403 and "other" in err.value.message and "voices-ok" not in err.value.message


@pytest.mark.parametrize("accept, expected", [
    ("audio/wav;q=0, application/json", ("application/json", "wav")),
    ("audio/wav;q=0.5, audio/flac", ("audio/flac", "flac")),
    ("application/json;q=0.2, audio/ogg;q=0.9", ("audio/ogg", "ogg")),
    ("*/*;q=0.1, audio/mpeg", ("audio/mpeg", "mp3")),
    (None, ("audio/wav", "wav")),
])
def test_accept_is_negotiated_by_q_value(accept, expected):
    assert response_format(accept) == expected


@pytest.mark.parametrize("accept, status", [("*/*;q=0", 406), ("audio/wav;q=0, application/json;q=0", 406),
                                            ("audio/wav;q=abc", 400), ("audio/wav;q=2", 400)])
def test_accept_with_nothing_acceptable(accept, status):
    with pytest.raises(HTTPError) as err:
        response_format(accept)
    assert err.value.status == status


def test_a_format_conflict_passes_to_the_next_acceptable_type():
    [req] = parse_body('{"text": "x", "format": "flac"}', "application/json", SETTINGS)
    assert response_format("audio/wav, audio/*;q=0.5", req) == ("audio/flac", "flac")
    with pytest.raises(HTTPError, match="asks for audio/wav"):
        response_format("audio/wav", req)


# -- the resampler's cost is bounded by the audio, never by the rates ---------------------------

def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV written by hand, so any rate a header can hold is possible."""
    data = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", len(data)) + data)


def test_odd_rates_resample_in_bounded_time_and_memory():
    assert len(wav_bytes(np.zeros(1), 44101)) == 46
    t0 = time.perf_counter()
    out = resample(np.ones(44101, np.float32) * 0.5, 44101, 44100)  # reduced ratio 44101/44100
    assert len(out) == 44100 and np.allclose(out[100:-100], 0.5, atol=1e-3)
    out = resample(np.ones(1009, np.float32) * 0.5, 1009, 44100)
    assert len(out) == 44100 and np.allclose(out[2000:-2000], 0.5, atol=1e-3)
    assert time.perf_counter() - t0 < 10
    samples, rate = read_audio(wav_bytes(np.zeros(1), 44101))
    assert rate == 44101 and len(samples) == 1


def test_the_per_sample_resampler_matches_the_filter_bank():
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    for orig, new in [(22050, 44100), (48000, 44100), (44100, 8000), (16000, 44100)]:
        assert np.abs(resample(x, orig, new) - _resample_per_sample(x, orig, new)).max() < 1e-5
    orig, new = 44101, 44100
    assert new * (2 * 7 + orig) > FILTER_BANK_LIMIT  # this pair takes the per-sample path


@pytest.mark.parametrize("rate", [1, 999, 384_001])
def test_unsupported_reference_rates_are_refused(rate):
    with pytest.raises(InputError, match="not supported"):
        read_audio(wav_bytes(np.zeros(rate // 10 + 1), rate))


# -- the batching server, attacked on loopback ------------------------------------------------------

def test_a_64_bit_overflowing_seed_is_a_400(server):
    status, message = json_error(invoke(server.url, {"text": "hi", "seed": 18446744073709551616}))
    assert status == 400 and "seed" in message
    still_serves(server.url)


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


@pytest.mark.parametrize("samples, rate", [(1, 44101), (1009, 1009), (44_101, 44_101)], ids=["46-bytes", "1s-1009Hz", "1s-44101Hz"])
def test_a_reference_at_an_odd_rate_costs_little(server, samples, rate):
    tone = np.sin(np.arange(samples) * 2 * np.pi * 200 / rate).astype(np.float32) * 0.5
    import base64

    body = {"text": "hi", "max_new_tokens": 2, "reference": {"audio": base64.b64encode(wav_bytes(tone, rate)).decode(),
                                                             "text": "A tone."}}
    # The front end checks the recording; its engine core decodes, resamples and encodes it.
    processes = [server.proc.pid, *map(int, open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split())]
    before = [peak_rss_mb(pid) for pid in processes]
    t0 = time.perf_counter()
    status, headers, out = invoke(server.url, body)
    assert status in (200, 422), out  # a single sample may be too short to be a voice
    assert time.perf_counter() - t0 < 20
    assert all(peak_rss_mb(pid) - mb < 300 for pid, mb in zip(processes, before))
    still_serves(server.url)


def test_json_lines_never_lock_other_clients_out(server):
    """40 lines against 2 slots and 2 queue places: other clients are served (never 503)
    while the body is worked through, /ping stays quick, and every line is answered."""
    lines = "\n".join(json.dumps({"text": f"Line number {i}.", "max_new_tokens": 6, "seed": i}) for i in range(40))
    with ThreadPoolExecutor(4) as pool:
        batch = pool.submit(invoke, server.url, lines, "application/jsonlines", "application/jsonlines", 300)
        deadline = time.monotonic() + 60
        while json.loads(request(server.url + "/ping")[2])["load"][0]["active"] == 0:
            assert time.monotonic() < deadline
        # As many as the queue's places: the lines hold both slots (so a third waiting request
        # would be refused until a slot frees), never a queue place.
        others = [pool.submit(invoke, server.url, {"text": f"Me {i}.", "max_new_tokens": 2, "seed": 0}) for i in range(2)]
        assert request(server.url + "/ping")[0] == 200 and not batch.done()  # answered while the lines run
        assert [f.result()[0] for f in others] == [200, 200]
        assert not batch.done()  # they were served in between its lines, not after them
        status, _, body = batch.result()
    answers = [json.loads(line) for line in body.decode().splitlines()]
    # (the tiny random model happens to end "Line number 9." at once: that line is its own 422)
    assert status == 200 and len(answers) == 40 and answers[9] == {"status": 422, "error": answers[9]["error"]}
    assert all(a["frames"] == 6 for i, a in enumerate(answers) if i != 9)


def test_a_huge_json_lines_body_is_413_at_once(server):
    lines = "\n".join('{"text": "a"}' for _ in range(20_000))
    t0 = time.perf_counter()
    status, message = json_error(invoke(server.url, lines, "application/jsonlines"))
    assert status == 413 and "20000 requests; the limit is 64" in message and time.perf_counter() - t0 < 5
    still_serves(server.url)


@pytest.mark.parametrize("body, ctype, message", [
    ("[" * 100_000, "application/json", "nested too deeply"),
    ('{"text": "hi", "seed": 1' + "0" * 5000 + "}", "application/json", "5001 digits"),
    (b'{"text": "caf\xe9"}', "application/json", "not UTF-8"),
])
def test_parser_attacks_are_400_json(server, body, ctype, message):
    status, error = json_error(invoke(server.url, body, ctype))
    assert status == 400 and message in error
    still_serves(server.url)


@pytest.mark.parametrize("method, path, status", [("PUT", "/invocations", 405), ("DELETE", "/invocations", 405),
                                                  ("PATCH", "/invocations", 405), ("POST", "/ping", 405),
                                                  ("GET", "/ping/", 404), ("GET", "/models", 404)])
def test_other_methods_and_paths_are_json_errors(server, method, path, status):
    got, error = json_error(request(server.url + path, b"{}", method=method))
    assert got == status and (path in error or method in error)
    still_serves(server.url)


def test_accept_q_values_on_the_server(server):
    status, headers, body = invoke(server.url, GOOD, accept="audio/wav;q=0, application/json")
    assert status == 200 and headers["Content-Type"].startswith("application/json") and json.loads(body)["frames"] == 2
    status, error = json_error(invoke(server.url, GOOD, accept="*/*;q=0"))
    assert status == 406


def test_an_oversized_content_length_is_413_before_the_body(server):
    reply = raw(port_of(server.url), b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 5000000000\r\n\r\n{\"text\":")
    # 413, not the 408 that waiting for the body would have ended in.
    assert reply.startswith(b"HTTP/1.1 413") and b'"error"' in reply
    still_serves(server.url)


def test_a_chunked_body_over_the_limit_is_413(server):
    """No Content-Length to refuse up front: the read stops at the limit, 100 MB."""
    import http.client

    from fish_sm.serving.http import PAYLOAD_LIMIT

    chunk = b"x" * (1 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server.url), timeout=60)
    try:
        conn.request("POST", "/invocations", body=(chunk for _ in range(PAYLOAD_LIMIT // len(chunk) + 2)),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        reply = conn.getresponse()
        assert reply.status == 413 and "limit" in json.loads(reply.read())["error"]
    except (BrokenPipeError, ConnectionResetError):  # the server may close before the last chunk is sent
        pass
    finally:
        conn.close()
    assert "request failed" not in server.log.read_text()  # never an internal error
    still_serves(server.url)


def test_a_body_shorter_than_its_length_is_408_after_the_body_timeout(server):
    t0 = time.perf_counter()
    reply = raw(port_of(server.url), b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 1000\r\n\r\n{\"text\":")
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in reply
    assert 1.5 < time.perf_counter() - t0 < 10
    still_serves(server.url)


def test_slow_headers_are_cut_off(server):
    """Slowloris: 100 connections sending half a request each are closed after the header timeout."""
    socks = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", port_of(server.url)), timeout=10)
        s.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    try:
        still_serves(server.url)  # meanwhile others are served
        t0 = time.perf_counter()
        assert all(s.recv(1024) == b"" for s in socks)  # closed by the server, not by us
        assert time.perf_counter() - t0 < 8
    finally:
        for s in socks:
            s.close()
    still_serves(server.url)


# -- a synthesis without audio, and an engine that fails -----------------------------------------

@pytest.fixture(scope="module")
def silent_package(tiny_checkpoint, tmp_path_factory):
    """A package whose model ends every utterance at once: each position's hidden state points
    along one dimension, and only the <|im_end|> row of the head reads it."""
    import shutil

    import torch

    from fish_sm.package.build import build_package_dir

    root = tmp_path_factory.mktemp("silent")
    ckpt = root / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    state = torch.load(ckpt / "model.pth", map_location="cpu", weights_only=True)
    im_end = json.loads((ckpt / "special_tokens.json").read_text())["<|im_end|>"]
    state["embeddings.weight"][:, 0] += 1000.0
    state["norm.weight"][0] = 1.0
    state["output.weight"][:, 0] = 0.0
    state["output.weight"][im_end, 0] = 10.0
    torch.save(state, ckpt / "model.pth")
    build_package_dir(ckpt, root / "package")
    return root / "package"


class InProcessCore:
    """An engine core run by a thread of this process instead of a process of its own (what the
    front end's `launch` returns: pid, wait, kill), so a test can reach into its engine."""

    def __init__(self, model_dir, device, addresses, settings):
        from fish_sm.serving.core import Core

        self.core, self.pid, self.code = Core(model_dir, device, addresses, settings), os.getpid(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.code = self.core.run()

    def wait(self) -> int:
        self.thread.join()
        return self.code

    def kill(self) -> None:
        pass  # (only for a core that will not stop: these stop when told, or end when their engine fails)


@contextlib.contextmanager
def in_process_server(model_dir, tmp_path):
    """The batching server's front end on a loopback port, served by a thread of this process,
    with its engine core on other threads of it (`InProcessCore`), so a test can reach into its
    engine; the two still talk over the core's sockets. Yields the URL and the `InProcessCore`."""
    from fish_sm.serving.batching_server import make_app
    from fish_sm.serving.http import listening

    settings = Settings.from_env({**ENV, "FISH_SM_CACHE_DIR": str(tmp_path / "cache")})
    cores = []

    def launch(model_dir, device, addresses):
        cores.append(InProcessCore(model_dir, device, addresses, settings))
        return cores[-1]

    app, port, loops = make_app(model_dir, settings, launch=launch), free_port(), []

    async def main():
        loops.append(asyncio.get_running_loop())
        async with listening(app, "127.0.0.1", port, handler_cancellation=True):
            await app["server"].stopping.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(OSError):
            if request(url + "/ping", timeout=2)[0] == 200:
                break
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.1)
    try:
        yield url, cores[0]
    finally:
        loops[0].call_soon_threadsafe(app["server"].stopping.set)
        thread.join(30)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def silent_server(silent_package, tmp_path_factory):
    with in_process_server(silent_package, tmp_path_factory.mktemp("silent-server")) as (url, _):
        yield url


def test_a_synthesis_without_audio_is_422(silent_server):
    status, error = json_error(invoke(silent_server, {"text": "Nothing will be said.", "seed": 1}))
    assert status == 422 and "before any audio" in error
    status, error = json_error(invoke(silent_server, {"text": "Nothing streamed.", "stream": True}))
    assert status == 422


def test_a_json_lines_line_without_audio_is_its_own_error(silent_server):
    lines = "\n".join(json.dumps({"text": f"Line {i}.", "seed": i}) for i in range(3))
    status, _, body = invoke(silent_server, lines, "application/jsonlines", "application/jsonlines")
    assert status == 200
    assert [json.loads(line) for line in body.decode().splitlines()] == [
        {"error": "the model ended the utterance before any audio; try another seed, or rephrase the text",
         "status": 422}] * 3


def test_the_handler_answers_422_for_no_audio(silent_package, serving_env):
    from fish_sm.serving.mms import handler

    model = handler.model_fn(str(silent_package))
    with pytest.raises(HTTPError) as err:
        handler.predict_fn(handler.input_fn('{"text": "Nothing."}', "application/json"), model)
    assert err.value.status == 422
    prediction = handler.predict_fn(handler.input_fn('{"text": "a"}\n{"text": "b"}', "application/jsonlines"), model)
    body, kind = handler.output_fn(prediction, "application/jsonlines")
    assert [json.loads(line)["status"] for line in body.decode().splitlines()] == [422, 422]


def test_an_engine_that_fails_turns_the_server_unhealthy_instead_of_hanging(package_dir, tmp_path):
    with in_process_server(package_dir, tmp_path) as (url, core):
        batcher = core.core.batcher

        def broken():
            raise RuntimeError("a bug in the engine loop")

        batcher.scheduler.schedule = broken  # a fault where no request is to blame
        t0 = time.perf_counter()
        status, error = json_error(invoke(url, GOOD, timeout=30))
        assert status in (500, 503) and time.perf_counter() - t0 < 10
        status, _, body = request(url + "/ping")
        assert status == 503 and json.loads(body)["status"] == "Unhealthy"
        status, error = json_error(invoke(url, GOOD, timeout=30))
        assert status == 503 and "unhealthy" in error
        assert not batcher.alive() and isinstance(batcher.failure, RuntimeError)
        core.thread.join(10)  # the core ends: a process of its own would exit 1
        assert core.code == 1


def test_a_codec_thread_that_fails_stops_the_engine(package_dir, tmp_path):
    with in_process_server(package_dir, tmp_path) as (url, core):
        batcher = core.core.batcher

        class Broken:  # the codec thread's queue, failing at its next wait
            def get_nowait(self):
                raise queue.Empty

            def get(self):
                raise RuntimeError("a bug in the codec loop")

            def put(self, item):
                pass

        waiting, batcher._codec._queue = batcher._codec._queue, Broken()
        waiting.put([])  # wake it: its next wait fails
        deadline = time.monotonic() + 10
        while request(url + "/ping")[0] != 503:  # the core notices, says so, and ends
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not batcher.alive()
        status, error = json_error(invoke(url, GOOD, timeout=30))
        assert status == 503 and "unhealthy" in error

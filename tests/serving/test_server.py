"""`fish-sm serve model.tar.gz` for real: the multi-model server (Java) on loopback, our handler
in its worker, the package unpacked from the tarball `fish-sm package` writes."""

import base64
import io
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from server_helpers import QUICK_ENV, Server, check_bad_request_then_a_good_one, free_port, request, serve_cmd
from test_request import BAD

from fish_sm.package.tarball import make_tarball


def unpacked_dir(server) -> Path:
    """Where `fish-sm serve` unpacked the tarball, from its log."""
    return Path(re.search(r"unpacked and verified \S+ in (\S+)", server.log.read_text()).group(1))


@pytest.fixture(scope="module")
def server(package_dir, tmp_path_factory):
    port = free_port()
    tmp = tmp_path_factory.mktemp("serve")
    tarball = make_tarball(package_dir, tmp / "model.tar.gz").path
    s = Server(serve_cmd(tarball, port), port, {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp / "cache"),
                                                     "FISH_SM_MAX_TEXT_CHARS": "100", "FISH_SM_MAX_REFERENCE_BYTES": "1000",
                                                     "FISH_SM_ALLOWED_BUCKETS": "voices-ok",
                                                     # a request's default length: a CPU takes 30 s for 1,024 frames
                                                     "FISH_SM_MAX_NEW_TOKENS": "64"}, tmp / "server.log")
    s.wait_ready()
    yield s
    s.stop()


def invoke(server, body, content_type="application/json", accept=None):
    return request(server.url + "/invocations", body, content_type, accept)


def test_ping_is_healthy_only_once_the_model_is_loaded(server):
    assert server.pings[-1] == 200
    assert (unpacked_dir(server) / "manifest.json").is_file()
    assert 200 not in server.pings[:-1]  # connection refused (0) or 503 while loading, never 200 early
    # The worker's log lines reach the server's log through Java's logger, which may write
    # them a moment after /ping turned healthy.
    deadline = time.monotonic() + 15
    while not ("model_fn ready" in (log := server.log.read_text()) and "model_fn warmup" in log):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.2)


def test_json_request_with_packaged_voice_returns_wav(server):
    status, headers, body = invoke(server, {"text": "Hello there.", "voice": "narrator", "max_new_tokens": 5, "seed": 3})
    assert status == 200 and headers["Content-Type"] == "audio/wav"
    audio, rate = sf.read(io.BytesIO(body))
    assert rate == 44100 and len(audio) <= 5 * 2048 and len(audio) % 2048 == 0


@pytest.mark.parametrize("content_type, body", [
    ("text/plain", "Plain text to speak."),
    ("application/json; charset=utf-8", json.dumps({"text": "Charset parameter.", "max_new_tokens": 4, "seed": 0})),
])
def test_content_types(server, content_type, body):
    # text/plain uses the defaults, so this one generates up to FISH_SM_MAX_NEW_TOKENS frames
    status, headers, out = invoke(server, body, content_type)
    assert status == 200 and headers["Content-Type"] == "audio/wav" and sf.info(io.BytesIO(out)).samplerate == 44100


@pytest.mark.parametrize("accept, fmt", [("audio/wav", "WAV"), ("audio/flac", "FLAC"), ("audio/ogg", "OGG"),
                                         ("audio/mpeg", "MP3"), ("*/*", "WAV")])
def test_accept_audio(server, accept, fmt):
    status, headers, body = invoke(server, {"text": "Accept test.", "max_new_tokens": 4, "seed": 0}, accept=accept)
    assert status == 200 and sf.info(io.BytesIO(body)).format == fmt


def test_accept_json_and_jsonlines_batch(server):
    status, headers, body = invoke(server, {"text": "As JSON.", "max_new_tokens": 4, "seed": 1}, accept="application/json")
    doc = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert len(sf.read(io.BytesIO(base64.b64decode(doc["audio"])))[0]) == doc["frames"] * 2048
    lines = "\n".join(json.dumps({"text": f"Record {i}.", "max_new_tokens": 2, "seed": i}) for i in range(4))
    status, headers, body = invoke(server, lines, "application/jsonlines", accept="application/jsonlines")
    assert status == 200 and headers["Content-Type"] == "application/jsonlines"
    assert len(body.decode().strip().splitlines()) == 4


def test_zero_shot_clone_from_wav(server, tone, encode_audio):
    ref = base64.b64encode(encode_audio(tone(0.02, 16000), 16000, "WAV")).decode()  # small: the limit is 1000 bytes
    status, _, body = invoke(server, {"text": "Cloned.", "reference": {"audio": ref, "text": "Ref."}, "max_new_tokens": 3, "seed": 0})
    assert status == 200 and len(sf.read(io.BytesIO(body))[0]) <= 3 * 2048


SERVER_BAD = [
    (body, ctype, status, message) for body, ctype, status, message in BAD
] + [
    ({"text": "x", "voice": "nobody"}, "application/json", 400, "unknown voice 'nobody'; packaged voices: narrator"),
    ({"text": "x", "reference": {"audio": base64.b64encode(b"not audio at all").decode(), "text": "t"}},
     "application/json", 422, "cannot be decoded"),
    ({"text": "x", "format": "flac"}, "application/json", 400, "asks for audio/wav"),  # sent with Accept: audio/wav
    ({"text": "x"}, "application/json", 406, "cannot answer with 'text/html'"),  # sent with Accept: text/html
]


@pytest.mark.parametrize("body, ctype, status, message", SERVER_BAD, ids=[m for *_, m in SERVER_BAD])
def test_bad_request_then_a_good_one(server, body, ctype, status, message):
    check_bad_request_then_a_good_one(server, body, ctype, status, message)


def test_silent_reference_is_422(server, encode_audio):
    silent = base64.b64encode(encode_audio(np.zeros((200, 1), np.float32), 16000, "WAV")).decode()
    got, _, out = invoke(server, {"text": "x", "reference": {"audio": silent, "text": "t"}})
    assert got == 422 and "silent" in json.loads(out)["error"]


def test_200_requests_at_concurrency_8(server):
    def one(i):
        # Seeds 200-399: the tiny random model ends any text at once with seed 9, which is a 422.
        status, headers, body = invoke(server, {"text": f"Request number {i}.", "max_new_tokens": 3, "seed": 200 + i},
                                       accept="application/json")
        doc = json.loads(body)
        audio, rate = sf.read(io.BytesIO(base64.b64decode(doc["audio"])))
        return status, rate, len(audio), doc["frames"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(200)))
    assert len(results) == 200
    assert all(status == 200 and rate == 44100 and n == frames * 2048 and frames <= 3
               for status, rate, n, frames in results)


def test_the_unpacked_package_is_removed_when_the_server_stops(server):
    """Last in this module: it stops the module's server."""
    unpacked = unpacked_dir(server)
    assert unpacked.is_dir() and (unpacked.stat().st_mode & 0o777) == 0o700
    server.stop()
    assert server.proc.returncode == 0 and not unpacked.exists()

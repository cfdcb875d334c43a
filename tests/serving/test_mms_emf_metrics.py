"""CloudWatch EMF lines from a real `fish-sm serve --server mms` on loopback (tiny package, one worker,
a model-server queue of one): the gate writes one line per answer, with the audio and queue wait the
worker reports in headers the client never sees; each line parsed from the server's stdout and
checked against its request and answer."""

import json
import time

import pytest

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd
from test_emf_metrics import check_emf, emf_lines

from fish_sm.cloudwatch_metrics import REQUEST_METRICS

pytestmark = pytest.mark.integration

# A few seconds on a CPU (this seed runs to max_new_tokens): the one worker is held while a second
# request waits in MMS's queue of one.


@pytest.fixture(scope="module")
def server(package_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mms-emf")
    port = free_port()
    s = Server(serve_cmd(package_dir, port, "mms"), port,
               {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp / "cache"), "SAGEMAKER_ENDPOINT_NAME": "tts-mms"}, tmp / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def answer_lines(server: Server, send, count: int = 1) -> tuple[object, list[dict]]:
    """What `send()` returns, and the `count` request lines the server wrote for it."""
    before = len(emf_lines(server.log.read_text()))
    got = send()
    deadline = time.monotonic() + 10  # the line follows the answer's last byte
    while True:
        new = emf_lines(server.log.read_text())[before:]
        if len(new) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(new) == count, new
    for doc in new:
        assert (doc["EndpointName"], doc["Server"], doc["Stream"]) == ("tts-mms", "mms", False)
    return got, new


def test_an_answer_with_audio_reports_what_the_worker_made(server):
    (status, headers, body), (doc,) = answer_lines(server, lambda: request(
        server.url + "/invocations", {"text": "Hello there.", "max_new_tokens": 8, "seed": 0},
        accept="application/json"))
    assert status == 200, body
    answer = json.loads(body)
    assert not [h for h in headers if h.lower().startswith("x-fish-sm")]  # the worker's headers stay inside
    values = check_emf(doc, REQUEST_METRICS)
    assert doc["StatusCode"] == 200
    assert (values["Requests"], values["Rejected"], values["Errors"]) == (1, 0, 0)
    assert values["Frames"] == answer["frames"]
    assert values["AudioSeconds"] == pytest.approx(answer["seconds"], abs=1e-3)
    assert values["RealTimeFactor"] == pytest.approx(answer["rtf"], abs=1e-3)
    synthesis_ms = answer["rtf"] * answer["seconds"] * 1000
    assert 0 <= values["QueueWait"] < values["Latency"] and values["Latency"] >= synthesis_ms * 0.99
    assert "FirstAudio" not in values


def test_json_lines_add_up(server):
    lines = "\n".join(json.dumps({"text": t, "max_new_tokens": 6, "seed": 1}) for t in ("One.", "Two."))
    (status, _, body), (doc,) = answer_lines(server, lambda: request(
        server.url + "/invocations", lines, content_type="application/jsonlines"))
    assert status == 200, body
    answers = [json.loads(line) for line in body.decode().splitlines()]
    values = check_emf(doc, REQUEST_METRICS)
    assert values["Frames"] == sum(a["frames"] for a in answers)
    assert values["AudioSeconds"] == pytest.approx(sum(a["seconds"] for a in answers), abs=1e-3)
    assert values["RealTimeFactor"] == pytest.approx(max(a["rtf"] for a in answers), abs=1e-3)


def test_refusals_by_the_worker_and_by_the_gate(server):
    (status, _, _), (worker_400,) = answer_lines(server, lambda: request(
        server.url + "/invocations", {"text": "x", "unknown": 1}))
    assert status == 400
    (status, _, _), (gate_400,) = answer_lines(server, lambda: request(
        server.url + "/invocations", b"\xff\xfe not utf-8", content_type="text/plain"))
    assert status == 400
    for doc in (worker_400, gate_400):
        values = check_emf(doc, REQUEST_METRICS)
        assert doc["StatusCode"] == 400 and (values["Rejected"], values["Errors"]) == (0, 0)
        assert "Frames" not in values and values["Latency"] >= 0
    # Only the worker's answer knows its queue wait; the gate answered the other itself.
    assert "QueueWait" in worker_400 and "QueueWait" not in gate_400

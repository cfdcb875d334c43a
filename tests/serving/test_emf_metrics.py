"""CloudWatch Embedded Metric Format lines: one per answered request and the server's state, from
a real `fish-sm serve --server batching` on loopback (tiny package, one slot, no queue), parsed
from its stdout and checked against each answer; the line format against the EMF specification."""

import json
import socket
import time

import pytest

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd

from fish_sm.cloudwatch_metrics import NAMESPACE, REQUEST_METRICS, STATE_METRICS
from fish_sm.serving.metrics import Metrics, RequestFigures, emf_line, state_values


def emf_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"_aws"')]


def check_emf(doc: dict, units: dict) -> dict:
    """The EMF specification's shape: a millisecond timestamp, one directive in our namespace whose
    dimension set and every metric have a top-level value. Returns the metrics' values."""
    directive, = doc["_aws"]["CloudWatchMetrics"]
    assert isinstance(doc["_aws"]["Timestamp"], int) and abs(doc["_aws"]["Timestamp"] / 1000 - time.time()) < 600
    assert directive["Namespace"] == NAMESPACE and directive["Dimensions"] == [["EndpointName", "Server"]]
    for dim in directive["Dimensions"][0]:
        assert isinstance(doc[dim], str)
    values = {}
    for metric in directive["Metrics"]:
        assert metric["Unit"] == units[metric["Name"]]
        assert isinstance(doc[metric["Name"]], (int, float))
        values[metric["Name"]] = doc[metric["Name"]]
    return values


def test_lines_follow_the_specification_and_off_writes_nothing():
    written = []
    metrics = Metrics("batching", env={"SAGEMAKER_ENDPOINT_NAME": "tts"}, write=written.append)
    figures = RequestFigures(status=200, stream=True, first_audio_ms=41.5, queue_wait_ms=3.0, latency_ms=120.0)
    figures.add_synthesis(20, 0.93, 0.5)
    figures.add_synthesis(10, 0.46, 0.7)  # a second JSON Lines line: sums, the slowest RTF
    metrics.request(figures)
    metrics.state([{"slots": 8, "active": 6, "waiting": 3, "max_queue": 16},
                   {"slots": 8, "active": 2, "waiting": 0, "max_queue": 16, "free_kv_bytes": 1 << 30}])
    request_doc, state_doc = map(json.loads, written)
    assert request_doc["EndpointName"] == "tts" and request_doc["Server"] == "batching"
    assert request_doc["StatusCode"] == 200 and request_doc["Stream"] is True
    assert check_emf(request_doc, REQUEST_METRICS) == {
        "Requests": 1, "Rejected": 0, "Errors": 0, "Latency": 120.0, "FirstAudio": 41.5, "RealTimeFactor": 0.7, "Frames": 30,
        "AudioSeconds": 1.39, "QueueWait": 3.0}
    assert check_emf(state_doc, STATE_METRICS) == {"BatchOccupancy": 50.0, "ActiveRequests": 8, "QueueDepth": 3,
                                                   "Slots": 16, "FreeKVMemory": 1 << 30}
    assert "FreeKVMemory" not in state_values([{"slots": 1, "active": 0, "waiting": 0}])
    assert Metrics("mms", env={}).dimensions == {"EndpointName": "local", "Server": "mms"}
    rejected = json.loads(emf_line({"EndpointName": "x", "Server": "y"},
                                   RequestFigures(status=503, rejected=True).values(), REQUEST_METRICS))
    assert (rejected["Rejected"], rejected["Errors"]) == (1, 0)
    assert json.loads(emf_line({}, RequestFigures(status=500).values(), REQUEST_METRICS))["Errors"] == 1
    quiet = []
    off = Metrics("batching", enabled=False, write=quiet.append)
    off.request(figures)
    off.state([{"slots": 1, "active": 1, "waiting": 0}])
    assert quiet == []


@pytest.mark.integration
def test_every_answer_writes_its_line(package_dir, tmp_path):
    port = free_port()
    server = Server(serve_cmd(package_dir, port, "batching"), port,
                    {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp_path / "cache"), "FISH_SM_MAX_BATCH": "1",
                     "FISH_SM_MAX_QUEUE": "0", "SAGEMAKER_ENDPOINT_NAME": "tts-emf"}, tmp_path / "server.log")
    try:
        server.wait_ready()
        url = server.url + "/invocations"
        status, _, body = request(url, {"text": "Hello there.", "max_new_tokens": 6, "seed": 0},
                                  accept="application/json")
        whole = json.loads(body)
        assert status == 200
        status, _, _ = request(url, {"text": "Streamed.", "max_new_tokens": 6, "seed": 1, "stream": True})
        assert status == 200
        assert request(url, {"text": "x", "unknown": 1})[0] == 400
        # A stream holds the only slot; the next request is turned away (503, Retry-After).
        long = json.dumps({"text": "A long utterance that holds the only slot.", "max_new_tokens": 2000, "seed": 0,
                           "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(long) + long)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            status, headers, _ = request(url, {"text": "Me too.", "max_new_tokens": 2, "seed": 0})
            assert status == 503 and headers["Retry-After"]
    finally:
        server.stop()
    docs = emf_lines(server.log.read_text())
    states = [d for d in docs if "Slots" in d]
    answers = [d for d in docs if "Requests" in d]
    assert states and check_emf(states[0], STATE_METRICS) == {"BatchOccupancy": 0.0, "ActiveRequests": 0,
                                                             "QueueDepth": 0, "Slots": 1}
    assert {d["EndpointName"] for d in docs} == {"tts-emf"} and {d["Server"] for d in docs} == {"batching"}
    # One line per answered request, in order; the client that left mid-stream was answered nothing more.
    assert [d["StatusCode"] for d in answers] == [200, 200, 400, 503], answers
    first, streamed, bad, rejected = (check_emf(d, REQUEST_METRICS) for d in answers)
    assert first["Frames"] == whole["frames"] and first["AudioSeconds"] == pytest.approx(whole["seconds"], abs=1e-3)
    # (the line rounds to 3 places, the JSON answer to 4)
    assert first["RealTimeFactor"] == pytest.approx(whole["rtf"], abs=6e-4) and first["QueueWait"] >= 0
    assert first["Latency"] >= first["RealTimeFactor"] * first["AudioSeconds"] * 1000 * 0.99
    assert "FirstAudio" not in first and (first["Rejected"], first["Errors"]) == (0, 0)
    assert answers[1]["Stream"] is True and 0 < streamed["FirstAudio"] and streamed["Frames"] >= 1
    assert streamed["AudioSeconds"] == pytest.approx(streamed["Frames"] * 2048 / 44100, abs=1e-3)
    assert (bad["Rejected"], bad["Errors"]) == (0, 0) and "Frames" not in bad
    assert (rejected["Rejected"], rejected["Errors"], rejected["Requests"]) == (1, 0, 1)

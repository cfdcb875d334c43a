"""invoke and bench on an inference component over real HTTP, against a stand-in for SageMaker's
runtime: the call carries InferenceComponentName (botocore serializes it with the real service
model), and while a scaled-to-zero component has no copy SageMaker answers 400 ValidationError
"Inference Component has no capacity ..." until its wake alarm has added one: invoke waits with
backoff and says so once, --no-wait fails at once, and a wait that runs out fails in one line."""

import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

import fish_sm.cli.invoke
import fish_sm.clients.endpoint
from fish_sm.cli import main
from standin_server import StandInServer

pytestmark = pytest.mark.integration

NAME = "tts"
COMPONENT = "tts-int8"
NO_CAPACITY = ("Inference Component has no capacity to process this request. ApplicationAutoScaling may be "
               "in-progress (if configured) or try to increase the capacity by invoking "
               "UpdateInferenceComponentRuntimeConfig API.")


def wav_bytes() -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(0.2 * 44100)) / 44100
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 44100, format="WAV", subtype="PCM_16")
    return buf.getvalue()


class Runtime(BaseHTTPRequestHandler):
    """InvokeEndpoint on /endpoints/NAME/invocations: `no_copy_for` calls find no copy, then audio.
    DescribeEndpoint and DescribeEndpointConfig (SageMaker's JSON protocol) say InService."""

    protocol_version = "HTTP/1.1"
    calls: list = []
    no_copy_for = 0
    audio = wav_bytes()

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        match = re.fullmatch(r"/endpoints/([^/]+)/invocations", urlsplit(self.path).path)
        if match is None:
            return self.describe(self.headers.get("X-Amz-Target", ""))
        Runtime.calls.append({"endpoint": match.group(1), "body": json.loads(body),
                              "component": self.headers.get("X-Amzn-SageMaker-Inference-Component")})
        if len(Runtime.calls) <= Runtime.no_copy_for:
            return self.send(400, json.dumps({"message": NO_CAPACITY}).encode(), "application/json",
                             {"x-amzn-ErrorType": "ValidationError"})
        self.send(200, Runtime.audio, "audio/wav", {"x-Amzn-Invoked-Production-Variant": "AllTraffic"})

    def describe(self, target: str):
        if target.endswith("DescribeEndpoint"):
            doc = {"EndpointName": NAME, "EndpointArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint/tts",
                   "EndpointConfigName": "tts-20250102030405678", "EndpointStatus": "InService",
                   "CreationTime": 1735776000, "LastModifiedTime": 1735776000,
                   "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": 1}]}
        else:
            doc = {"EndpointConfigName": "tts-20250102030405678", "CreationTime": 1735776000,
                   "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint-config/tts",
                   "ProductionVariants": [{"VariantName": "AllTraffic", "InstanceType": "ml.g6e.2xlarge",
                                           "InitialInstanceCount": 1}]}
        self.send(200, json.dumps(doc).encode(), "application/x-amz-json-1.1")

    def send(self, status: int, data: bytes, content_type: str, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def runtime_url():
    server = StandInServer(("127.0.0.1", 0), Runtime)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def run(runtime_url, tmp_path, monkeypatch):
    """`fish-sm ARGS --endpoint-url <stand-in>` with isolated AWS settings; (exit code, output)."""
    monkeypatch.setattr(fish_sm.clients.endpoint, "CAPACITY_FIRST_DELAY_S", 0.01)  # backoff in ms, not seconds
    Runtime.calls = []
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_PROFILE": None, "AWS_CONFIG_FILE": str(tmp_path / "config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "FISHSM_CONFIG": None,
           "XDG_CONFIG_HOME": str(tmp_path)}

    def invoke(*args):
        result = CliRunner().invoke(main, [*args, "--endpoint-url", runtime_url], env=env)
        return result.exit_code, result.output

    return invoke


def test_invoke_waits_for_a_copy_and_says_so_once(run, tmp_path):
    Runtime.no_copy_for = 3
    out_wav = tmp_path / "hello.wav"
    code, out = run("invoke", NAME, "Hello.", "--component", COMPONENT, "-o", str(out_wav))
    assert code == 0, out
    waiting = [line for line in out.splitlines() if "waiting" in line]
    assert waiting == [f"endpoint {NAME} component {COMPONENT} has no copy running (scaled to zero): waiting up to "
                       "600 s for capacity, retrying with backoff"]
    assert [(c["endpoint"], c["component"], c["body"]["text"]) for c in Runtime.calls] == [(NAME, COMPONENT, "Hello.")] * 4
    audio, rate = sf.read(out_wav)
    assert rate == 44100 and len(audio) == int(0.2 * 44100)


def test_no_wait_fails_at_once_in_one_line(run, tmp_path):
    Runtime.no_copy_for = 1
    code, out = run("invoke", NAME, "Hello.", "--component", COMPONENT, "--no-wait", "-o", str(tmp_path / "x.wav"))
    assert code == 1 and len(Runtime.calls) == 1
    assert out.splitlines() == [f"Error: endpoint {NAME} component {COMPONENT} has no copy to serve the call (scaled "
                                "to zero); SageMaker adds one when the component's no-capacity alarm fires, in "
                                f"minutes: {NO_CAPACITY}"]
    assert not (tmp_path / "x.wav").exists()


def test_a_wait_that_runs_out_fails_in_one_line(run, tmp_path, monkeypatch):
    monkeypatch.setattr(fish_sm.cli.invoke, "CAPACITY_WAIT_S", 0.05)
    Runtime.no_copy_for = 10**6
    code, out = run("invoke", NAME, "Hello.", "--component", COMPONENT, "-o", str(tmp_path / "x.wav"))
    assert code == 1 and len(Runtime.calls) >= 2
    assert out.splitlines()[-1].startswith(f"Error: endpoint {NAME} component {COMPONENT} still has no copy to serve "
                                           "the call after waiting")


def test_bench_loads_the_component(run, tmp_path):
    Runtime.no_copy_for = 0
    code, out = run("bench", NAME, "--component", COMPONENT, "--concurrency", "1", "--requests", "2", "--warmup", "0",
                    "-o", str(tmp_path / "bench"))
    assert code == 0, out
    assert [c["component"] for c in Runtime.calls] == [COMPONENT] * 2
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["levels"][0]["ok"] == 2 and report["device"] == "1 x ml.g6e.2xlarge"


def test_component_is_refused_with_url():
    result = CliRunner().invoke(main, ["invoke", "--url", "http://127.0.0.1:1", "Hi.", "--component", COMPONENT])
    assert result.exit_code == 2 and "--component is for real-time endpoints of inference components" in result.output

"""invoke and bench on an endpoint over real HTTP: InvokeEndpointWithResponseStream (--stream) and
InvokeEndpoint, also for a role that may invoke but not describe.

moto has no InvokeEndpointWithResponseStream, and botocore's Stubber cannot return its event
stream (it checks the response's Body against the model as a plain structure). So a small
stand-in for SageMaker's runtime speaks the operation's wire format — AWS event-stream
frames of PayloadPart events, or ModelStreamError / ModelError — relaying a real `fish-sm
serve` of the tiny package as SageMaker relays a container, and passes every other call
(DescribeEndpoint) on to moto. It relays InvokeEndpoint to the same server too (moto would
answer with a canned body). botocore serializes the request and parses the events with the
real service model.
"""

import binascii
import http.client
import io
import json
import re
import struct
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import boto3
import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from moto_helpers import moto_server
from standin_server import StandInServer
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from fish_sm.clients.endpoint import EndpointTarget
from fish_sm.clients.response import ServiceError

pytestmark = pytest.mark.skipif("serve" not in main.commands, reason="`fish-sm serve` is not part of this build")

NAME = "tts-stream"
ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
COMMON = ["--text", "Hello from the tiny model, streamed.", "--voice", "narrator", "--max-new-tokens", "20",
          "--seed", "1"]
BUSY = '{"error": "all 64 slots are busy and 64 requests wait already; retry after 1 s"}'


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One message of the AWS event-stream encoding: prelude, its CRC, string headers, payload, CRC."""
    head = b"".join(struct.pack("B", len(k)) + k.encode() + b"\x07" + struct.pack(">H", len(v)) + v.encode()
                    for k, v in headers.items())
    prelude = struct.pack(">II", 16 + len(head) + len(payload), len(head))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + head + payload
    return message + struct.pack(">I", binascii.crc32(message))


def payload_part(data: bytes) -> bytes:
    return frame({":message-type": "event", ":event-type": "PayloadPart", ":content-type": "application/octet-stream"},
                 data)


def stream_error(kind: str, message: str, code: str | None = None) -> bytes:
    body = {"Message": message, **({"ErrorCode": code} if code else {})}
    return frame({":message-type": "exception", ":exception-type": kind, ":content-type": "application/json"},
                 json.dumps(body).encode())


class Runtime(BaseHTTPRequestHandler):
    """SageMaker in miniature: /endpoints/NAME/invocations-response-stream relays the container."""

    protocol_version = "HTTP/1.1"
    container = ""  # the `fish-sm serve` URL
    moto = ""
    calls: list = []
    break_after: int | None = None  # parts relayed before a ModelStreamError
    reject = False  # answer as SageMaker does when the container says 503 (full)
    deny_describe = False  # a role allowed to invoke only: SageMaker's Describe* calls are refused
    control_calls: list = []  # the X-Amz-Target of each call passed on to moto

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = urlsplit(self.path).path
        match = re.fullmatch(r"/endpoints/([^/]+)/invocations-response-stream", path)
        whole = re.fullmatch(r"/endpoints/([^/]+)/invocations", path)
        if match:
            self.relay(match.group(1), body)
        elif whole:
            self.relay_whole(whole.group(1), body)
        else:
            target = self.headers.get("X-Amz-Target", "")
            if target:
                Runtime.control_calls.append(target)
            if Runtime.deny_describe and target.startswith("SageMaker.Describe"):
                return self.answer(400, "AccessDeniedException", {
                    "__type": "AccessDeniedException",
                    "Message": f"User is not authorized to perform: sagemaker:{target.split('.')[-1]}"})
            self.forward(body)

    def relay_whole(self, name: str, body: bytes):
        """InvokeEndpoint: the container's answer, with its content type, as SageMaker relays it."""
        accept = self.headers.get("Accept", "*/*")
        Runtime.calls.append({"name": name, "accept": accept, "content_type": self.headers["Content-Type"],
                              "body": json.loads(body)})
        req = urllib.request.Request(Runtime.container + "/invocations", data=body, method="POST",
                                     headers={"Content-Type": self.headers["Content-Type"], "Accept": accept})
        try:
            with urllib.request.urlopen(req, timeout=60) as upstream:
                data, content_type = upstream.read(), upstream.headers["Content-Type"]
        except urllib.error.HTTPError as exc:
            return self.answer(424, "ModelError", {"Message": f"Received client error ({exc.code}) from primary",
                                                   "OriginalStatusCode": exc.code,
                                                   "OriginalMessage": exc.read().decode()})
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("x-Amzn-Invoked-Production-Variant", "AllTraffic")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def forward(self, body: bytes):
        conn = http.client.HTTPConnection(urlsplit(self.moto).netloc, timeout=30)
        conn.request(self.command, self.path, body, {k: v for k, v in self.headers.items() if k.lower() != "host"})
        r = conn.getresponse()
        data = r.read()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(k, v)
        head = self.command == "HEAD"  # a HEAD answer says the length of the body it leaves out
        self.send_header("Content-Length", r.getheader("Content-Length", "0") if head else str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def do_PUT(self):  # S3 (asynchronous inference's request upload and results) goes to moto as it is
        self.forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def do_GET(self):
        self.forward(b"")

    def do_HEAD(self):
        self.forward(b"")

    def answer(self, status: int, error_type: str, doc: dict):
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("x-amzn-ErrorType", error_type)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def relay(self, name: str, body: bytes):
        accept = self.headers.get("X-Amzn-SageMaker-Accept", "*/*")
        Runtime.calls.append({"name": name, "accept": accept, "content_type": self.headers["Content-Type"],
                              "body": json.loads(body)})
        if Runtime.reject:
            return self.answer(424, "ModelError", {"Message": "Received server error (503) from primary",
                                                   "OriginalStatusCode": 503, "OriginalMessage": BUSY})
        req = urllib.request.Request(Runtime.container + "/invocations", data=body, method="POST",
                                     headers={"Content-Type": self.headers["Content-Type"], "Accept": accept})
        try:
            upstream = urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as exc:
            return self.answer(424, "ModelError", {"Message": f"Received client error ({exc.code}) from primary",
                                                   "OriginalStatusCode": exc.code,
                                                   "OriginalMessage": exc.read().decode()})
        with upstream:
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.amazon.eventstream")
            self.send_header("X-Amzn-SageMaker-Content-Type", upstream.headers["Content-Type"])
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for n, piece in enumerate(iter(lambda: upstream.read1(65536), b"")):
                if Runtime.break_after is not None and n >= Runtime.break_after:
                    self.chunk(stream_error("ModelStreamError", "the model server's stream broke", "StreamBroken"))
                    break
                self.chunk(payload_part(piece))
            self.chunk(b"")

    def chunk(self, data: bytes):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def runtime_url(tmp_path_factory, tiny_url):
    """moto (with endpoint NAME, born InService) behind the runtime stand-in; AWS settings from nowhere else."""
    with moto_server(tmp_path_factory) as moto:
        Runtime.moto, Runtime.container = moto, tiny_url
        sm = boto3.client("sagemaker", endpoint_url=Runtime.moto)
        sm.create_model(ModelName=f"{NAME}-1", ExecutionRoleArn=ROLE,
                        PrimaryContainer={"Image": "123.dkr/fish-sm:1", "ModelDataUrl": "s3://b/model.tar.gz"})
        sm.create_endpoint_config(EndpointConfigName=f"{NAME}-1", ProductionVariants=[{
            "VariantName": "AllTraffic", "ModelName": f"{NAME}-1", "InitialInstanceCount": 1,
            "InstanceType": "ml.m5.xlarge"}])
        sm.create_endpoint(EndpointName=NAME, EndpointConfigName=f"{NAME}-1")
        server = StandInServer(("127.0.0.1", 0), Runtime)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


@pytest.fixture(autouse=True)
def fresh_runtime():
    Runtime.calls, Runtime.break_after, Runtime.reject = [], None, False
    Runtime.deny_describe, Runtime.control_calls = False, []


def cli(url, *args, ok=True):
    result = CliRunner().invoke(main, [*map(str, args), "--endpoint-url", url])
    assert "Traceback" not in result.output
    assert result.exit_code == (0 if ok else 1), result.output
    return result.output


def test_invoke_stream_on_an_endpoint_writes_the_whole_responses_audio(runtime_url, tiny_url, tmp_path):
    CliRunner().invoke(main, ["invoke", "--url", tiny_url, *COMMON, "-o", str(tmp_path / "whole.wav")])
    whole, rate = sf.read(tmp_path / "whole.wav", dtype="int16")

    printed = cli(runtime_url, "invoke", NAME, *COMMON, "--stream", "-o", tmp_path / "ep.wav")
    call, = Runtime.calls
    assert call["name"] == NAME and call["accept"] == "audio/wav" and call["content_type"] == "application/json"
    assert call["body"] == {"text": COMMON[1], "voice": "narrator", "format": "wav", "stream": True,
                            "max_new_tokens": 20, "seed": 1}
    first, total = map(float, re.search(r"first audio after ([\d.]+) s, complete after ([\d.]+) s", printed).groups())
    assert 0 < first < total and "audio/wav" in printed
    streamed, rate2 = sf.read(tmp_path / "ep.wav", dtype="int16")
    assert rate2 == rate and len(streamed) == len(whole) and np.abs(streamed.astype(int) - whole).max() <= 2

    printed = cli(runtime_url, "invoke", NAME, *COMMON, "--stream", "-o", tmp_path / "ep.pcm")
    assert Runtime.calls[-1]["accept"] == "audio/pcm" and "audio/pcm;rate=44100" in printed
    pcm = np.frombuffer((tmp_path / "ep.pcm").read_bytes(), "<i2")
    assert len(pcm) == len(whole) and np.abs(pcm.astype(int) - whole).max() <= 2


def test_stream_errors_on_an_endpoint_are_one_line(runtime_url, tmp_path):
    Runtime.break_after = 1  # the header and perhaps some audio, then the stream breaks
    out = tmp_path / "broken.wav"
    printed = cli(runtime_url, "invoke", NAME, *COMMON, "--stream", "-o", out, ok=False)
    line, = printed.strip().splitlines()
    assert line == f"Error: endpoint {NAME}: ModelStreamError: the model server's stream broke"
    assert not out.exists()

    Runtime.break_after = None  # the container refuses before streaming: SageMaker's ModelError
    printed = cli(runtime_url, "invoke", NAME, "--text", "Hi.", "--temperature", "7", "--stream", ok=False)
    line, = printed.strip().splitlines()
    assert line.startswith(f"Error: endpoint {NAME} answered 400:") and "temperature" in line

    aws = AWS(region="us-east-1", endpoint_url=runtime_url)
    Runtime.reject = True
    with pytest.raises(ServiceError) as err:
        EndpointTarget(aws, NAME).send({"text": "Hi.", "stream": True})
    assert err.value.kind == "rejected" and err.value.status == 503 and "retry after 1 s" in str(err.value)


def test_bench_stream_on_an_endpoint(runtime_url, tmp_path):
    out = tmp_path / "bench"
    cli(runtime_url, "bench", NAME, "--stream", "--concurrency", "1,2", "--requests", "4", "--max-new-tokens", "20",
        "--seed", "0", "--warmup", "0", "-o", out)
    report = json.loads((out / "bench.json").read_text())
    assert report["stream"] is True and report["target"] == f"endpoint {NAME}"
    assert len(Runtime.calls) == 8 and all(c["body"]["stream"] is True for c in Runtime.calls)
    for level in report["levels"]:
        assert level["ok"] == 4 and level["errors"] == {} and level["rejected"] == 0
        assert 0 < level["first_audio_ms"]["p50"] < level["latency_s"]["p50"] * 1000
    assert all(0 < s["first_audio_s"] < s["latency_s"] for s in report["samples"])

    Runtime.reject = True  # a full container: counted per level, not errors, but no audio fails the run
    printed = cli(runtime_url, "bench", NAME, "--stream", "--concurrency", "2", "--requests", "3", "--warmup", "0",
                  "-o", out, ok=False)
    assert printed.strip().splitlines()[-1].startswith(
        "Error: 1 of 1 level(s) over --max-error-rate 0: concurrency 2 3/3 failed; "
        f"e.g. endpoint {NAME} answered 503")
    level, = json.loads((out / "bench.json").read_text())["levels"]
    assert level["rejected"] == 3 and level["ok"] == 0 and level["errors"] == {}


def test_a_role_allowed_only_to_invoke_can_invoke_and_bench(runtime_url, tmp_path):
    """invoke calls InvokeEndpoint and nothing else; bench reports the device as unknown."""
    Runtime.deny_describe = True
    out = tmp_path / "rt.wav"
    printed = cli(runtime_url, "invoke", NAME, "Hello from the tiny model.", "--voice", "narrator",
                  "--max-new-tokens", "8", "--seed", "1", "-o", out)
    assert Runtime.control_calls == [] and Runtime.calls[-1]["accept"] == "audio/wav"
    audio, rate = sf.read(out)
    assert rate == 44100 and len(audio) > 0 and f"{len(audio) / rate:.2f} s of audio" in printed

    # A refusal by the container is reported as it is, although the explanation may not be looked up.
    printed = cli(runtime_url, "invoke", NAME, "Hi.", "--temperature", "7", ok=False)
    line, = printed.strip().splitlines()
    assert line.startswith(f"Error: endpoint {NAME} answered 400:") and "temperature" in line
    assert Runtime.control_calls == ["SageMaker.DescribeEndpoint"]  # tried, refused, not fatal

    out_dir = tmp_path / "bench"
    cli(runtime_url, "bench", NAME, "--concurrency", "1", "--requests", "2", "--max-new-tokens", "8", "--warmup", "0",
        "--seed", "1", "-o", out_dir)  # (unseeded, the tiny model's random head now and then ends at the first frame)
    report = json.loads((out_dir / "bench.json").read_text())
    assert report["device"] == "unknown" and report["passed"] is True and report["levels"][0]["ok"] == 2

    Runtime.deny_describe = False
    cli(runtime_url, "bench", NAME, "--concurrency", "1", "--requests", "2", "--max-new-tokens", "8", "--warmup", "0",
        "--seed", "1", "-o", out_dir)  # (unseeded, the tiny model's random head now and then ends at the first frame)
    report = json.loads((out_dir / "bench.json").read_text())
    assert report["device"] == "1 x ml.m5.xlarge" and report["target"] == f"endpoint {NAME}"
    page = (out_dir / "bench.html").read_text()
    assert "<th>device</th><td>1 x ml.m5.xlarge</td>" in page and '<li class="pass">concurrency 1: pass' in page


def test_async_with_an_input_location_needs_no_describe(runtime_url, tmp_path):
    """--input-location names where the request goes, so nothing is described; the result is checked."""
    boto3.client("s3", endpoint_url=Runtime.moto).create_bucket(Bucket="fish-sm-async-in")
    Runtime.deny_describe = True
    wav = io.BytesIO()
    sf.write(wav, np.full(800, -0.25, np.float32), 8000, format="WAV", subtype="PCM_U8")
    data = wav.getvalue()
    assert max(data) < 0x80  # moto's queue carries text: these bytes pass it unchanged
    req = urllib.request.Request(f"{Runtime.moto}/moto-api/static/sagemaker/async-endpoint-results", method="POST",
                                 data=json.dumps({"results": [{"data": data.decode()}]}).encode())
    urllib.request.urlopen(req).close()
    out = tmp_path / "async.wav"
    printed = cli(runtime_url, "invoke", NAME, "Hello.", "--async", "--input-location", "s3://fish-sm-async-in/req/",
                  "-o", out, "--poll", "0.01")
    assert out.read_bytes() == data and "0.10 s of audio" in printed and Runtime.control_calls == []

    printed = cli(runtime_url, "invoke", NAME, "Hello again.", "--async", "-o", tmp_path / "b.wav", ok=False)
    assert printed.strip().splitlines()[-1] == (f"Error: may not describe endpoint {NAME} to find its output bucket "
                                                "(AccessDeniedException): give --input-location s3://...")

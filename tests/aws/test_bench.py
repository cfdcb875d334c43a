"""bench and invoke --url against a small HTTP server started here (WAV answers, some 400/500s),
plus the statistics on hand-made samples and the local-server lifecycle."""

import base64
import io
import json
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from standin_server import StandInServer
from fish_sm.aws import AWSError
from fish_sm.clients import bench as b
from fish_sm.clients import local_server as local
from fish_sm.clients.report import format_table, table_rows
from fish_sm.clients.request import build_request
from fish_sm.clients.response import ServiceError
from fish_sm.clients.url import UrlTarget
from fish_sm.cli import main

RATE = 16000
SECONDS_PER_CHAR = 0.01


def wav_for(text: str) -> bytes:
    n = int(len(text) * SECONDS_PER_CHAR * RATE)
    buf = io.BytesIO()
    sf.write(buf, (0.1 * np.sin(np.arange(n) / 8)).astype(np.float32), RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


STREAM_PAUSE_S = 0.15


class Handler(BaseHTTPRequestHandler):
    """The SageMaker container contract, in miniature: audio whose length follows the text; streamed
    (header first, then PCM after a pause) when asked; 503 with Retry-After for "busy503"."""

    protocol_version = "HTTP/1.1"
    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/ping" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.requests.append((body, self.headers.get("Accept")))
        text = body["text"]
        if body.get("stream") and "fail" not in text and "busy" not in text:
            return self.stream(wav_for(text))
        if "busy503" in text:
            payload = json.dumps({"error": "all 1 slots are busy and 0 requests wait already; retry after 2 s"}).encode()
            self.send_response(503)
            self.send_header("Retry-After", "2")
            self.send_header("Content-Type", "application/json")
        elif "fail503" in text:
            payload = json.dumps({"error": "the model is still loading"}).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
        elif "fail500" in text or "fail400" in text:
            code = 500 if "fail500" in text else 400
            payload = json.dumps({"error": f"refused: {text}"}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
        else:
            code, payload = 200, wav_for(text)
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def stream(self, wav: bytes):
        """As the batching server streams: an open-length WAV header, then PCM pieces as they are made."""
        header = wav[:40] + struct.pack("<I", 0xFFFFFFFF)
        header = header[:4] + struct.pack("<I", 0xFFFFFFFF) + header[8:]
        pcm = wav[44:]
        self.send_response(200)
        self.send_header("Content-Type", "audio/wav")
        self.send_header("X-Sample-Rate", str(RATE))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        half = len(pcm) // 2 & ~1
        for piece in (header, pcm[:half], pcm[half:]):
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.flush()
            time.sleep(STREAM_PAUSE_S)
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def server_url():
    server = StandInServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


TEXTS = ["Short one.", "A somewhat longer sentence for the benchmark.", "please fail500 now", "bad fail400 request",
         "The last and longest line of this small benchmark file, spoken slowly."]


def test_bench_url_reports_figures_errors_and_plots(server_url, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS[:4]) + "\n\n" + json.dumps({"text": TEXTS[4], "temperature": 0.5}) + "\n")
    out = tmp_path / "report"
    args = ["bench", "--url", server_url, "--concurrency", "3,1", "--requests", "10", "--texts", str(texts),
            "--warmup", "1", "--seed", "7", "-o", str(out)]
    result = CliRunner().invoke(main, [*args, "--max-error-rate", "0.4"])  # 4 of each level's 10 fail
    assert result.exit_code == 0, result.output
    assert "p50 s" in result.output and "audio s/s" in result.output and "HTTP 500: 2" in result.output
    assert "concurrency 3: pass: 4 of 10 request(s) brought no audio (40%; at most 40% may)" in result.output

    report = json.loads((out / "bench.json").read_text())
    assert report["passed"] is True and report["target"] == server_url and report["device"] == "unknown"
    assert report["settings"] == {"concurrency": [1, 3], "requests": 10, "format": "wav", "stream": False,
                                  "max_new_tokens": None, "seed": 7, "voice": None, "max_error_rate": 0.4,
                                  "warmup": 1, "texts": 5}
    assert report["fish_sm_version"] and report["started"] <= report["finished"]
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    good = [t for t in TEXTS if "fail" not in t]
    # 10 requests cycle over 5 texts: each text twice per level.
    expected_audio = 2 * sum(int(len(t) * SECONDS_PER_CHAR * RATE) / RATE for t in good)
    for lv in report["levels"]:
        assert lv["requests"] == 10 and lv["ok"] == 6
        assert lv["errors"] == {"HTTP 400": 2, "HTTP 500": 2}
        assert "refused: please fail500 now" in lv["error_examples"]["HTTP 500"]
        lat = lv["latency_s"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert lv["audio_seconds"] == pytest.approx(expected_audio, rel=1e-6)
        assert lv["rps"] == pytest.approx(6 / lv["wall_s"])
        assert lv["audio_seconds_per_wall_second"] == pytest.approx(expected_audio / lv["wall_s"])
        assert lv["rtf"]["p50"] > 0
    assert len(report["samples"]) == 20 and report["warmup"] == 1
    # Every request carried the shared options; JSON lines kept their own fields.
    sent = [r for r, accept in Handler.requests if accept == "audio/wav"]
    assert all(r["seed"] == 7 and r["format"] == "wav" for r in sent)
    assert any(r.get("temperature") == 0.5 for r in sent)

    page = (out / "bench.html").read_text()
    images = page.count('src="data:image/png;base64,')
    assert images == 3 and "Latency distribution per concurrency" in page and "Throughput against concurrency" in page
    first = page.split('src="data:image/png;base64,')[1].split('"')[0]
    assert base64.b64decode(first)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "refused: bad fail400 request" in page
    assert '<li class="pass">concurrency 1: pass: 4 of 10' in page and 'id="verdict">PASS' in page

    result = CliRunner().invoke(main, args)  # the default --max-error-rate is 0
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith(
        "Error: 2 of 2 level(s) over --max-error-rate 0: concurrency 1 4/10 failed, concurrency 3 4/10 failed; e.g. ")
    assert json.loads((out / "bench.json").read_text())["passed"] is False


def test_invoke_url_writes_audio_and_reports_server_errors(server_url, tmp_path):
    ref = tmp_path / "ref.wav"
    ref.write_bytes(wav_for("reference"))
    out = tmp_path / "out" / "hello.wav"
    result = CliRunner().invoke(main, ["invoke", "--url", server_url + "/invocations", "--text", "Hello there, world.",
                                       "-o", str(out), "--reference", str(ref), "--reference-text", "The reference.",
                                       "--seed", "3", "--temperature", "0.7"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == wav_for("Hello there, world.")
    assert "0.19 s of audio" in result.output and "audio/wav" in result.output
    body, accept = Handler.requests[-1]
    assert accept == "audio/wav" and body["seed"] == 3 and body["temperature"] == 0.7
    assert base64.b64decode(body["reference"]["audio"]) == ref.read_bytes()
    assert body["reference"]["text"] == "The reference."

    # The text as an argument, and one JSON object on stdout for a script.
    result = CliRunner().invoke(main, ["invoke", "--url", server_url, "Said plainly.", "-o", str(tmp_path / "p.wav"),
                                       "--output", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["output"] == str(tmp_path / "p.wav") and doc["target"] == server_url and doc["bytes"] == len(
        wav_for("Said plainly.")) and doc["audio_seconds"] == pytest.approx(int(13 * SECONDS_PER_CHAR * RATE) / RATE)
    assert Handler.requests[-1][0]["text"] == "Said plainly."

    result = CliRunner().invoke(main, ["invoke", "--url", server_url, "--text", "x fail400 y", "-o", str(tmp_path / "e.ogg")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == f"Error: {server_url} answered 400: refused: x fail400 y"
    assert Handler.requests[-1][1] == "audio/ogg"  # the format follows the output's extension


def test_invoke_and_bench_name_adapters(server_url, tmp_path):
    """invoke --adapter sends the field (a bad name never leaves); bench --adapters N spreads the
    requests over N adapters round-robin and says which."""
    run = lambda *args: CliRunner().invoke(main, [str(a) for a in args])
    Handler.requests.clear()
    result = run("invoke", "--url", server_url, "Hello.", "--adapter", "yasuo", "-o", tmp_path / "a.wav")
    assert result.exit_code == 0, result.output
    assert [body for body, _ in Handler.requests] == [{"text": "Hello.", "adapter": "yasuo", "format": "wav"}]
    result = run("invoke", "--url", server_url, "Hello.", "--adapter", "a/b")
    assert result.exit_code == 1 and "adapter name" in result.output and len(Handler.requests) == 1

    Handler.requests.clear()
    texts = tmp_path / "texts.txt"
    texts.write_text("One.\nTwo.\nThree.\n")
    result = run("bench", "--url", server_url, "--adapters", 2, "--adapter-names", "a,b,c", "--texts", texts,
                 "--requests", 5, "--concurrency", 1, "--warmup", 0, "-o", tmp_path / "report")
    assert result.exit_code == 0, result.output
    assert "requests spread over 2 adapter(s): a, b" in result.output
    assert [body["adapter"] for body, _ in Handler.requests] == ["a", "b", "a", "b", "a"]
    assert [body["text"] for body, _ in Handler.requests] == ["One.", "Two.", "Three.", "One.", "Two."]
    report = json.loads((tmp_path / "report" / "bench.json").read_text())
    assert report["settings"]["adapters"] == 2 and report["settings"]["adapter_names"] == ["a", "b"]
    result = run("bench", "--url", server_url, "--adapters", 4, "--adapter-names", "a,b")
    assert result.exit_code == 1
    assert result.output.strip().endswith("--adapters 4: --adapter-names has only 2 adapter(s) (a, b)")
    assert "--adapters with --url needs the names" in run("bench", "--url", server_url, "--adapters", 2).output


def test_url_target_error_kinds(server_url):
    with pytest.raises(ServiceError) as err:
        UrlTarget(server_url).send({"text": "fail500"})
    assert err.value.kind == "HTTP 500" and err.value.status == 500
    port = local.free_port()  # nothing listens there
    with pytest.raises(ServiceError) as err:
        UrlTarget(f"http://127.0.0.1:{port}").send({"text": "hi"})
    assert err.value.kind == "connection"


def test_summarize_on_known_samples():
    samples = [b.Sample(4, i, 0.0, lat, True, "ok", audio, 10) for i, (lat, audio) in
               enumerate([(1.0, 2.0), (2.0, 4.0), (3.0, 3.0), (4.0, None)])]
    samples += [b.Sample(4, 9, 0.0, 0.5, False, "timeout", None, 10, "no answer"),
                b.Sample(4, 10, 0.0, 0.1, False, "HTTP 503", None, 10, "busy"),
                b.Sample(4, 11, 0.0, 0.1, False, "HTTP 503", None, 10, "busy again")]
    s = b.summarize(samples, wall_s=5.0, concurrency=4)
    assert s["requests"] == 7 and s["ok"] == 4
    assert s["errors"] == {"HTTP 503": 2, "timeout": 1} and s["error_examples"]["HTTP 503"] == "busy"
    assert s["latency_s"]["p50"] == pytest.approx(2.5) and s["latency_s"]["mean"] == pytest.approx(2.5)
    assert s["latency_s"]["p95"] == pytest.approx(np.percentile([1, 2, 3, 4], 95))
    assert s["latency_s"]["p99"] == pytest.approx(3.97)
    assert s["rps"] == pytest.approx(4 / 5) and s["audio_seconds"] == pytest.approx(9.0)
    assert s["audio_seconds_per_wall_second"] == pytest.approx(9.0 / 5)
    assert s["rtf"]["p50"] == pytest.approx(0.5) and s["rtf"]["mean"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    empty = b.summarize([b.Sample(1, 0, 0.0, 0.1, False, "connection", None, 3, "refused")], 0.1, 1)
    assert empty["latency_s"]["p50"] is None and empty["rps"] == 0.0
    table = format_table({"levels": [s, empty]})
    assert "4/7" in table and "HTTP 503: 2, timeout: 1" in table and "0/1" in table


def test_summarize_first_audio_and_rejections():
    samples = [b.Sample(2, i, 0.0, lat, True, "ok", 1.0, 10, first_audio_s=first)
               for i, (lat, first) in enumerate([(1.0, 0.1), (2.0, 0.2), (3.0, 0.3), (4.0, 0.4)])]
    samples += [b.Sample(2, 8, 0.0, 0.01, False, "rejected", None, 10, "full; retry after 1 s")]
    s = b.summarize(samples, wall_s=4.0, concurrency=2)
    assert s["requests"] == 5 and s["ok"] == 4 and s["rejected"] == 1 and s["errors"] == {}
    assert s["first_audio_ms"]["p50"] == pytest.approx(250) and s["first_audio_ms"]["mean"] == pytest.approx(250)
    assert s["first_audio_ms"]["p95"] == pytest.approx(np.percentile([100, 200, 300, 400], 95))
    assert s["error_examples"] == {"rejected": "full; retry after 1 s"}
    row, = table_rows({"stream": True, "levels": [s]})
    assert row[5:7] == ["250", "385*"] and row[-2:] == ["1", "-"]  # *: p95 of 4 samples


def test_bench_input_checks(tmp_path):
    with pytest.raises(Exception, match="at least 1"):
        b.parse_concurrency("0,2")
    with pytest.raises(Exception, match="numbers separated by commas"):
        b.parse_concurrency("one")
    assert b.parse_concurrency("16, 1,4,4") == [1, 4, 16]
    bad = tmp_path / "bad.txt"
    bad.write_text('{"text": ""}\n')
    with pytest.raises(Exception, match="non-empty"):
        b.load_texts(bad)
    with pytest.raises(Exception, match="empty"):
        build_request("   ")


SERVER_SCRIPT = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
print("ready", flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_local_server_is_started_and_always_stopped(tmp_path, monkeypatch):
    script = tmp_path / "server.py"
    script.write_text(SERVER_SCRIPT)
    port = local.free_port()
    monkeypatch.setattr(local, "free_port", lambda: port)
    procs = []
    real_popen = local.subprocess.Popen

    def popen(*args, **kwargs):
        procs.append(real_popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="bench blew up"):
        with local.local_server(tmp_path, log_path=tmp_path / "serve.log", startup_timeout_s=30,
                                command=[sys.executable, str(script), str(port)]) as url:
            assert url == f"http://127.0.0.1:{port}" and procs[0].poll() is None
            raise RuntimeError("bench blew up")
    assert procs[0].poll() is not None  # stopped although the block failed
    assert "ready" in (tmp_path / "serve.log").read_text()

    with pytest.raises(AWSError, match="exited with code 3 before it was ready: boom"):
        with local.local_server(tmp_path, log_path=tmp_path / "serve2.log", startup_timeout_s=30,
                                command=[sys.executable, "-c", "print('boom'); raise SystemExit(3)"]):
            pass
    # By default the server is `python -m fish_sm.cli serve MODEL_DIR --port N`.
    monkeypatch.setattr(local, "ping", lambda url, timeout_s: False)
    with pytest.raises(AWSError):
        with local.local_server(tmp_path, log_path=tmp_path / "serve3.log", startup_timeout_s=0.5):
            pass
    assert procs[-1].args[:4] == [sys.executable, "-m", "fish_sm.cli", "serve"]
    assert procs[-1].args[4:] == [str(tmp_path), "--port", str(port)] and procs[-1].poll() is not None


def test_stream_first_audio_is_the_first_byte_after_the_header(server_url, tmp_path):
    """The header comes at once and the audio a pause later: first audio counts from the audio."""
    texts = tmp_path / "texts.txt"
    texts.write_text("A streamed sentence of some length.\nAnother one, a little longer than the first.\n")
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["bench", "--url", server_url, "--stream", "--concurrency", "1,2",
                                       "--requests", "4", "--texts", str(texts), "--warmup", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    for s in report["samples"]:
        assert s["ok"] and STREAM_PAUSE_S <= s["first_audio_s"] < s["latency_s"] - STREAM_PAUSE_S
    for lv in report["levels"]:
        assert lv["first_audio_ms"]["p50"] >= STREAM_PAUSE_S * 1000
        assert lv["audio_seconds"] == pytest.approx(2 * sum(int(len(t) * SECONDS_PER_CHAR * RATE) / RATE
                                                            for t in texts.read_text().split("\n") if t))
    assert all(r.get("stream") is True for r, _ in Handler.requests[-8:])
    header = next(ln for ln in result.output.splitlines() if ln.startswith("conc "))
    assert header.split() == ["conc", "ok/n", "p50", "s", "p95", "s", "p99", "s", "1st", "p50", "ms", "1st", "p95", "ms",
                              "req/s", "audio", "s/s", "RTF", "p50", "rejected", "errors"]

    # invoke --stream writes a WAV whose header says its real length.
    wav = tmp_path / "s.wav"
    result = CliRunner().invoke(main, ["invoke", "--url", server_url, "--text", "Streamed to a file.", "--stream",
                                       "-o", str(wav)])
    assert result.exit_code == 0, result.output
    assert wav.read_bytes() == wav_for("Streamed to a file.")


def test_full_server_503_with_retry_after_is_counted_as_rejected(server_url, tmp_path):
    with pytest.raises(ServiceError) as err:
        UrlTarget(server_url).send({"text": "busy503"})
    assert err.value.kind == "rejected" and err.value.retry_after == "2" and err.value.status == 503
    with pytest.raises(ServiceError) as err:
        UrlTarget(server_url).send({"text": "fail503"})  # a 503 without Retry-After stays an error
    assert err.value.kind == "HTTP 503"

    texts = tmp_path / "texts.txt"
    texts.write_text("Short one.\nbusy503 please\nfail503 loading\n")
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["bench", "--url", server_url, "--concurrency", "1,2", "--requests", "6",
                                       "--texts", str(texts), "--warmup", "0", "-o", str(out),
                                       "--max-error-rate", "0.7"])  # 2 rejected and 2 errors of 6
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    for lv in report["levels"]:
        assert (lv["ok"], lv["rejected"], lv["errors"]) == (2, 2, {"HTTP 503": 2})
        assert "retry after 2 s" in lv["error_examples"]["rejected"]
    rows = format_table(report).splitlines()[2:]
    assert len(rows) == 2 and all(row.split()[-4:] == ["2", "HTTP", "503:", "2"] for row in rows)  # rejected, errors
    assert "rejected (server full)" in result.output

"""invoke --url and bench against a real `fish-sm serve` of a package of the tiny random checkpoint (CPU).
The package (`tiny_model`) comes from tests/aws/conftest.py."""

import json
import shutil
import tempfile

import pytest
import soundfile as sf
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.clients.local_server import local_server
from fish_sm.clients.url import ping

pytestmark = pytest.mark.skipif("serve" not in main.commands, reason="`fish-sm serve` is not part of this build")


@pytest.fixture(autouse=True)
def private_tmpdir(monkeypatch):
    """The Java model server keeps one pid file (and socket) per machine under $TMPDIR and refuses to
    start while another one runs: a private TMPDIR lets these tests run beside other servers."""
    path = tempfile.mkdtemp(prefix="fsm-", dir="/tmp")  # short: unix socket paths are limited to ~100 bytes
    monkeypatch.setenv("TMPDIR", path)
    yield
    shutil.rmtree(path, ignore_errors=True)


def test_bench_local_starts_measures_and_stops_the_server(tiny_model, tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, ["bench", "--local", str(tiny_model), "--concurrency", "1,2", "--requests", "4",
                                       "--max-new-tokens", "8", "--seed", "0", "-o", str(out), "--startup-timeout", "120"])
    assert result.exit_code == 0, result.output
    url = result.output.split("serving at ")[1].split()[0]
    assert not ping(url)  # stopped when the benchmark ended
    report = json.loads((out / "bench.json").read_text())
    assert report["target"] == f"local {tiny_model} (served at {url})" and report["passed"] is True
    assert report["server"]["status"] == "Healthy" and report["device"] == "unknown"  # /ping names no device
    assert report["levels"][0]["warnings"][:2] == ["p95 from 4 samples", "p99 from 4 samples"]
    for level in report["levels"]:
        assert level["ok"] == level["requests"] == 4 and level["errors"] == {}
        assert level["audio_seconds"] > 0 and level["audio_seconds_per_wall_second"] > 0
        assert level["latency_s"]["p99"] >= level["latency_s"]["p50"] > 0
    assert (out / "bench.html").read_text().count("data:image/png;base64,") == 3
    assert (out / "serve.log").stat().st_size > 0


def test_invoke_url_against_fish_sm_serve(tiny_model, tmp_path):
    with local_server(tiny_model, log_path=tmp_path / "serve.log", startup_timeout_s=120) as url:
        out = tmp_path / "hello.wav"
        result = CliRunner().invoke(main, ["invoke", "--url", url, "--text", "Hello from the tiny model.",
                                           "--voice", "narrator", "--max-new-tokens", "8", "--seed", "1", "-o", str(out)])
        assert result.exit_code == 0, result.output
        audio, rate = sf.read(out)
        assert rate == 44100 and len(audio) > 0 and f"{len(audio) / rate:.2f} s of audio" in result.output

        result = CliRunner().invoke(main, ["invoke", "--url", url, "--text", "Hi.", "--temperature", "7",
                                           "-o", str(tmp_path / "bad.wav")])
        assert result.exit_code == 1 and "Traceback" not in result.output
        line, = result.output.strip().splitlines()
        assert line.startswith(f"Error: {url} answered 400:") and "temperature" in line
    assert not ping(url)

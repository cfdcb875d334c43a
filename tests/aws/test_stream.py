"""invoke --stream and bench --stream against a real `fish-sm serve` (the batching server) of the tiny
package: the streamed audio is the whole response's audio, first audio comes before the end, and a
full server's 503 + Retry-After is counted as rejected."""

import io
import json
import re
import struct

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from fish_sm.clients import bench as b
from fish_sm.clients.local_server import local_server
from fish_sm.clients.report import format_table
from fish_sm.clients.stream import close_wav, pcm_offset, read_stream
from fish_sm.clients.url import UrlTarget
from fish_sm.cli import main

pytestmark = pytest.mark.skipif("serve" not in main.commands, reason="`fish-sm serve` is not part of this build")

TEXT = "Hello from the tiny model, streamed."
COMMON = ["--text", TEXT, "--voice", "narrator", "--max-new-tokens", "20", "--seed", "1"]


def invoke(*args):
    result = CliRunner().invoke(main, ["invoke", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def timings(output: str) -> tuple[float, float]:
    """(first audio, complete) seconds from invoke --stream's line."""
    first, total = re.search(r"first audio after ([\d.]+) s, complete after ([\d.]+) s", output).groups()
    return float(first), float(total)


def test_invoke_stream_writes_the_same_audio_as_a_whole_response(tiny_url, tmp_path):
    invoke("--url", tiny_url, *COMMON, "-o", tmp_path / "whole.wav")
    whole, rate = sf.read(tmp_path / "whole.wav", dtype="int16")
    assert rate == 44100 and len(whole) > 0

    printed = invoke("--url", tiny_url, *COMMON, "--stream", "-o", tmp_path / "streamed.wav")
    first, total = timings(printed)
    assert 0 < first < total
    data = (tmp_path / "streamed.wav").read_bytes()
    # The open-length header (0xFFFFFFFF sizes) was closed with the real sizes.
    assert struct.unpack_from("<I", data, 4)[0] == len(data) - 8
    assert struct.unpack_from("<I", data, 40)[0] == len(data) - 44 == 2 * len(whole)
    streamed, rate = sf.read(tmp_path / "streamed.wav", dtype="int16")
    assert rate == 44100 and len(streamed) == len(whole)
    assert np.abs(streamed.astype(int) - whole).max() <= 2  # rounding differs by at most 2 LSB
    assert f"{len(whole) / rate:.2f} s of audio" in printed

    # Bare PCM: by the output's extension (.pcm, .raw) or --format pcm.
    for out, extra in ((tmp_path / "streamed.pcm", []), (tmp_path / "streamed.raw", []),
                       (tmp_path / "pcm.bin", ["--format", "pcm"])):
        printed = invoke("--url", tiny_url, *COMMON, "--stream", "-o", out, *extra)
        assert "audio/pcm;rate=44100" in printed and f"{len(whole) / rate:.2f} s of audio" in printed
        pcm = np.frombuffer(out.read_bytes(), "<i2")
        assert len(pcm) == len(whole) and np.abs(pcm.astype(int) - whole).max() <= 2


def test_bench_stream_reports_first_audio(tiny_url, tmp_path):
    """--url here; --local is the same once its server is up (test_real_server starts one)."""
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, ["bench", "--url", tiny_url, "--stream", "--concurrency", "1,3",
                                       "--requests", "6", "--max-new-tokens", "20", "--seed", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "1st p50 ms" in result.output and "1st p95 ms" in result.output and "first audio p50" in result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["stream"] is True
    for level in report["levels"]:
        assert level["ok"] == level["requests"] == 6 and level["errors"] == {} and level["rejected"] == 0
        first, lat = level["first_audio_ms"], level["latency_s"]
        assert 0 < first["p50"] <= first["p95"] < lat["p95"] * 1000
        assert first["p50"] < lat["p50"] * 1000
        assert level["audio_seconds"] > 0
    samples = report["samples"]
    assert len(samples) == 12 and all(0 < s["first_audio_s"] < s["latency_s"] for s in samples)
    page = (out / "bench.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "Time to first audio against concurrency" in page


def test_bench_without_stream_is_unchanged(tiny_url):
    report = b.run_bench(UrlTarget(tiny_url), concurrencies=[2], requests_per_level=2, texts=[{"text": TEXT}],
                         base={"max_new_tokens": 8, "seed": 0}, warmup=0)
    level, = report["levels"]
    assert report["stream"] is False and level["ok"] == 2
    assert level["first_audio_ms"] == {"p50": None, "p95": None, "mean": None}
    assert all(s["first_audio_s"] is None for s in report["samples"])
    assert "1st p50 ms" not in format_table(report)


def test_a_full_server_rejects_and_the_bench_counts_it(tiny_model, tmp_path, monkeypatch):
    """One slot and no queue: while one request decodes the others get 503 with Retry-After at once."""
    monkeypatch.setenv("FISH_SM_MAX_BATCH", "1")
    monkeypatch.setenv("FISH_SM_MAX_QUEUE", "0")
    with local_server(tiny_model, log_path=tmp_path / "serve.log", startup_timeout_s=120) as url:
        report = b.run_bench(UrlTarget(url), concurrencies=[1, 4], requests_per_level=8, texts=[{"text": TEXT}],
                             base={"max_new_tokens": 40, "seed": 0}, warmup=0, stream=True)
    alone, crowded = report["levels"]
    assert alone["ok"] == 8 and alone["rejected"] == 0
    assert crowded["rejected"] >= 1 and crowded["ok"] >= 1 and crowded["ok"] + crowded["rejected"] == 8
    assert crowded["errors"] == {}  # a rejection is not an error
    assert "retry after" in crowded["error_examples"]["rejected"]
    rejected = [s for s in report["samples"] if s["kind"] == "rejected"]
    assert all(not s["ok"] and "answered 503" in s["error"] for s in rejected)
    table = format_table(report)
    assert "rejected" in table.splitlines()[0]


def test_stream_reading_on_pieces():
    """The first audio byte is the first byte after the WAV header, however the pieces fall."""
    header = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 16000, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))
    pcm = np.arange(-50, 50, dtype="<i2").tobytes()
    assert pcm_offset(header[:30], "audio/wav") is None and pcm_offset(header, "audio/wav") == 44
    assert pcm_offset(b"", "audio/pcm;rate=8000") == 0
    body, first = read_stream(iter([header[:10], header[10:], pcm[:2], pcm[2:]]), "audio/wav", 0.0)
    assert body == header + pcm and first is not None
    body, first = read_stream(iter([header]), "audio/wav", 0.0)
    assert first is None  # a header alone is no audio
    closed = close_wav(header + pcm)
    audio, rate = sf.read(io.BytesIO(closed), dtype="int16")
    assert rate == 8000 and audio.tolist() == list(range(-50, 50))

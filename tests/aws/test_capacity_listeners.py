"""fish-sm capacity --listeners: the closed-loop population's scheduling (each listener asks again
when its answer has played), a level of it against a stand-in server streaming WAV at real time
(the asyncio client and the threads), the verdict and report of a closed-loop run, and the
CLI's refusal of --streams with --listeners."""

import json
import struct
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler

import pytest
from click.testing import CliRunner

from standin_server import StandInServer
from fish_sm.cli import main
from fish_sm.clients import capacity as cap
from fish_sm.clients.report import capacity_lines, format_capacity_table
from fish_sm.clients.url import UrlTarget
from fish_sm.errors import InputError

RATE = 44100
FRAME = 2048  # samples a frame: the server sends one a frame's time, as a real-time stream
SPEAKING = 40.0  # characters a second: "Hello there." is 0.3 s, 6 frames


def wav_header(pcm_bytes: int | None) -> bytes:
    """A 16-bit mono 44.1 kHz WAV header; None: the open length of a stream."""
    data = 0xFFFFFFFF if pcm_bytes is None else pcm_bytes
    riff = 0xFFFFFFFF if pcm_bytes is None else 36 + pcm_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, RATE, 2 * RATE, 2, 16)
            + b"data" + struct.pack("<I", data))


class Paced(BaseHTTPRequestHandler):
    """max_new_tokens frames of audio: streamed one frame per frame's time (the first at once),
    or whole; a text with "busy" is refused at once as a full server refuses (503, Retry-After)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/ping" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        frames = body["max_new_tokens"]
        pcm = (b"\x10\x00\xf0\xff" * (FRAME // 2))
        if "busy" in body["text"]:
            payload = json.dumps({"error": "all slots are busy; retry after 1 s"}).encode()
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "audio/wav")
        if not body.get("stream"):
            payload = wav_header(frames * len(pcm)) + pcm * frames
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        header = wav_header(None)
        self.wfile.write(f"{len(header):x}\r\n".encode() + header + b"\r\n")
        t0 = time.perf_counter()
        for k in range(frames):  # frame k goes when the audio before it has played
            delay = t0 + k * FRAME / RATE - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self.wfile.write(f"{len(pcm):x}\r\n".encode() + pcm + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def paced_url():
    server = StandInServer(("127.0.0.1", 0), Paced)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


MIX = cap.Mix(texts=("Hello there.", "A second, longer line.", "busy, go away"), chars_per_second=SPEAKING,
              whole_share=0.3)


def frames_of(text: str) -> int:
    return max(1, round(len(text) / SPEAKING * RATE / FRAME))


# -- the schedule, as a unit ------------------------------------------------------------------

def _sample(p: cap.Planned, *, ok=True, mode="stream", first=0.2, audio=2.0, underrun=0.0, latency=2.5):
    return cap.StreamSample(None, p.index, p.at_s, mode, p.voice, len(p.body["text"]), p.intended_s, ok,
                            "ok" if ok else "rejected", latency, 0.0, first if ok else None, audio if ok else None,
                            underrun if ok else None, 0, None if ok else "full", 3, p.listener)


def test_each_listener_asks_again_when_its_answer_has_played():
    population = cap.Population(MIX, 3, 10.0, seed=5)
    first = population.first()
    assert [p.listener for p in first] == [0, 1, 2] and len({p.index for p in first}) == 3
    assert all(0 <= p.at_s < min(MIX.mean_seconds, 10.0) for p in first) and len({p.at_s for p in first}) == 3
    a, b, c = first
    # A stream: first audio, its audio, and the underruns its playback waited out.
    nxt = population.after(_sample(a, first=0.2, audio=2.0, underrun=0.3))
    assert nxt.listener == 0 and nxt.at_s == pytest.approx(a.at_s + 0.2 + 2.0 + 0.3)
    # A whole answer: once it has come, and played.
    nxt_b = population.after(_sample(b, mode="whole", first=1.0, latency=1.0, audio=2.0))
    assert nxt_b.listener == 1 and nxt_b.at_s == pytest.approx(b.at_s + 1.0 + 2.0)
    # No audio: the listener waits what it asked to hear, from the failure on.
    nxt_c = population.after(_sample(c, ok=False, latency=0.01))
    assert nxt_c.at_s == pytest.approx(c.at_s + 0.01 + c.intended_s)
    # Nobody asks at or after the duration.
    assert population.after(_sample(nxt, first=0.5, audio=10.0)) is None
    # Seeded per listener: its k-th request is the same whatever order the answers came in.
    again = cap.Population(MIX, 3, 10.0, seed=5)
    f2 = again.first()
    assert [p.at_s for p in f2] == [p.at_s for p in first] and [p.body for p in f2] == [p.body for p in first]
    later_c = again.after(_sample(f2[2], ok=False, latency=0.01))
    later_a = again.after(_sample(f2[0], first=0.2, audio=2.0, underrun=0.3))
    assert later_a.body == nxt.body and later_c.body == nxt_c.body
    assert cap.Population(MIX, 3, 10.0, seed=6).starts != population.starts
    with pytest.raises(InputError, match="--listeners levels must be at least 1"):
        cap.parse_streams("4,0", "--listeners")


def test_a_fake_clock_keeps_every_listener_busy_back_to_back():
    """A server that answers every stream 0.1 s after it is asked and then at real time: each
    listener's requests follow one another with no gap but the first audio, until the duration."""
    mix = cap.Mix(texts=("Hello there.", "A second, longer line."), chars_per_second=SPEAKING, whole_share=0.0)
    population = cap.Population(mix, 4, 5.0, seed=1)
    pending = population.first()
    asked = defaultdict(list)
    while pending:
        p = pending.pop()
        asked[p.listener].append(p)
        seconds = frames_of(p.body["text"]) * FRAME / RATE
        nxt = population.after(_sample(p, first=0.1, audio=seconds, latency=0.1 + seconds))
        if nxt is not None:
            pending.append(nxt)
    assert sorted(asked) == [0, 1, 2, 3]
    for requests in asked.values():
        for before, after in zip(requests, requests[1:]):
            assert after.at_s == pytest.approx(before.at_s + 0.1 + frames_of(before.body["text"]) * FRAME / RATE)
        last = requests[-1]
        assert last.at_s < 5.0 <= last.at_s + 0.1 + frames_of(last.body["text"]) * FRAME / RATE
    indexes = sorted(p.index for requests in asked.values() for p in requests)
    assert indexes == list(range(len(indexes)))


# -- a level against a server streaming at real time --------------------------------------------

def _check_level(samples, population):
    """What either client must have recorded: every listener's requests chained by played_at."""
    by_listener = defaultdict(list)
    for s in samples:
        assert s.listeners == population.listeners and s.streams is None and s.late_s >= 0
        by_listener[s.listener].append(s)
    assert sorted(by_listener) == list(range(population.listeners))
    assert [s.index for s in samples] == list(range(len(samples)))
    for listener, mine in by_listener.items():
        mine.sort(key=lambda s: s.at_s)
        assert mine[0].at_s == population.starts[listener]
        for before, after in zip(mine, mine[1:]):
            assert after.at_s == cap.played_at(before)  # exactly the time it was scheduled for
        assert all(s.at_s < population.duration_s for s in mine)
        assert cap.played_at(mine[-1]) >= population.duration_s
    for s in samples:
        text = next(t for t in MIX.texts if len(t) == s.text_chars)
        if "busy" in text:
            assert not s.ok and s.kind == "rejected" and "503" in s.error
            continue
        assert s.ok, s.error
        assert s.audio_seconds == pytest.approx(frames_of(text) * FRAME / RATE)
        if s.mode == "stream":
            assert 0 < s.first_audio_s <= s.latency_s and s.underrun_s >= 0 and s.underruns >= 0
            # Played: the server sends its last frame a frame short of the audio's length after the
            # request came, so the answer took at least that; when the first frame arrived depends on
            # the machine's load, so the bound does not count from it.
            assert s.latency_s >= s.audio_seconds - FRAME / RATE
        else:
            assert s.first_audio_s == s.latency_s
    assert {s.mode for s in samples} == {"stream", "whole"}


def test_a_closed_loop_level_on_the_asyncio_client(paced_url):
    population = cap.Population(MIX, 6, 0.7, seed=2)
    samples, wall = cap.run_population_async(paced_url, population, timeout_s=30)
    _check_level(samples, population)
    assert wall >= max(s.at_s + s.latency_s for s in samples) - 1e-6  # it ended when the answers were in


def test_a_closed_loop_level_on_threads(paced_url):
    population = cap.Population(MIX, 3, 0.5, seed=3)
    samples, _ = cap.run_population(UrlTarget(paced_url, timeout_s=30), population)
    _check_level(samples, population)


# -- the verdict and the report -------------------------------------------------------------------

def test_a_closed_loop_verdict_and_report_are_keyed_by_listeners():
    def sample(first, underrun=0.0):
        return cap.StreamSample(None, 0, 0.0, "stream", "none", 10, 2.0, True, "ok", 2.5, 0.0, first, 2.0, underrun,
                                1 if underrun else 0, listeners=256, listener=0)

    good = cap.summarize_level([sample(0.1)] * 9 + [sample(0.2)], 10.0, 256, 1.0, 10.0, population="closed loop")
    assert good["listeners"] == 256 and "streams" not in good and good["passed"]
    bad = cap.summarize_level([sample(0.9, 0.5)] * 10, 10.0, 512, 1.0, 10.0, population="closed loop")
    assert not bad["passed"] and bad["listeners"] == 512
    assert cap.capacity_level([bad, good])["listeners"] == 256
    figures = cap.capacity_figures(256, gpus=2, unit="listeners", usd_per_hour=4.0)
    assert figures["listeners"] == 256 and figures["listeners_per_gpu"] == 128 and "streams" not in figures
    report = {"population": "closed loop", "levels": [good, bad], "capacity": figures, "lengths": "forced",
              "settings": {"slo_first_audio_ms": 500.0, "slo_underrun": 0.001, "duration_s": 10.0,
                           "client": "asyncio", "spread_s": 1.0}}
    table = format_capacity_table(report)
    assert table.splitlines()[0].startswith("closed loop: each listener asks again as soon as its answer has played")
    assert table.splitlines()[1].split()[:2] == ["listeners", "requests/s"]
    lines = capacity_lines(report)
    assert lines[0].startswith("512 listeners: FAIL: first audio p99")
    assert lines[1].startswith("capacity: 256 listeners (closed loop) keep real-time playback within the SLO")
    assert "128.0 per GPU" in lines[1] and "$0.0156 per audio-hour" in lines[1]


def test_capacity_listeners_end_to_end(paced_url, tmp_path):
    out = tmp_path / "report"
    # The built-in texts at 600 characters a second: 1 to 11 frames (at most half a second).
    args = ["capacity", "--url", paced_url, "--listeners", "4,2", "--duration", "0.3", "--chars-per-second", "600",
            "--whole-share", "0.3", "--slo-first-audio-ms", "30000", "--slo-underrun", "1",
            "--max-error-rate", "0", "--warmup", "0", "--price", "3", "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "closed loop: each listener asks again" in result.output and "2 listeners (" in result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["population"] == "closed loop" and report["settings"]["listeners"] == [2, 4]
    assert report["settings"]["client"] == "asyncio" and "streams" not in report["settings"]
    assert [lv["listeners"] for lv in report["levels"]] == [2, 4] and all(lv["passed"] for lv in report["levels"])
    assert report["capacity"]["listeners"] == 4 and report["capacity"]["listeners_per_gpu"] == 4
    assert {s["listeners"] for s in report["samples"]} == {2, 4}
    page = (out / "bench.html").read_text()
    assert "Capacity curve (closed loop)" in page and "<th>listeners</th>" in page
    assert "First audio against listeners" in page


def test_streams_and_listeners_are_one_or_the_other(tmp_path):
    result = CliRunner().invoke(main, ["capacity", "--url", "http://127.0.0.1:9", "--streams", "8",
                                       "--listeners", "8", "-o", str(tmp_path / "r")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        "Error: give either --streams (an open loop of offered streams) or --listeners (a closed loop of "
        "listeners), not both"]
    result = CliRunner().invoke(main, ["capacity", "--url", "http://127.0.0.1:9", "--listeners", "0",
                                       "-o", str(tmp_path / "r")])
    assert result.exit_code != 0 and "--listeners levels must be at least 1" in result.output
    assert not (tmp_path / "r").exists()

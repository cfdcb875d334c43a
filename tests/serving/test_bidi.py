"""`GET /invocations-bidirectional-stream` on `fish-sm serve --server batching`, for real on
loopback with a real WebSocket client (aiohttp): text in pieces, audio per sentence, barge-in,
bad parts, many sessions at once (CPU, tiny package)."""

import asyncio
import base64
import io
import json
import time

import aiohttp
import pytest
import soundfile as sf

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd

from fish_sm.clients.bidi import WebSocketChannel, run_session, split_pieces

pytestmark = pytest.mark.integration

# Each sentence is over half of CHUNK, so a long text of them is spoken one sentence per chunk.
CHUNK = 50
SENTENCES = ["Hello there, this is the first one.", "And here comes the second sentence!",
             "The third sentence ends it all?"]
SETTINGS = {"voice": "narrator", "seed": 7, "max_new_tokens": 12, "chunk_length": CHUNK, "format": "pcm"}


def start(package_dir, tmp, **env) -> Server:
    port = free_port()
    s = Server(serve_cmd(package_dir, port, "batching"), port,
               {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp / "cache"), "FISH_SM_MAX_TEXT_CHARS": "200", **env},
               tmp / "server.log")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def server(package_dir, tmp_path_factory):
    s = start(package_dir, tmp_path_factory.mktemp("bidi"), FISH_SM_MAX_BATCH="8", FISH_SM_MAX_QUEUE="16",
              FISH_SM_MAX_NEW_TOKENS="64")
    yield s
    s.stop()


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/invocations-bidirectional-stream"


def session(server, settings, pieces, **kw):
    async def go():
        async with WebSocketChannel(server.url, timeout_s=120) as channel:
            return await run_session(channel, settings, pieces, **kw)

    return asyncio.run(go())


async def raw_session(server, messages: list, until_close=True) -> list:
    """Send `messages` (str, bytes, or dicts as JSON) and collect what comes back until the close:
    ("json", doc) and ("binary", n_bytes)."""
    got = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(ws_url(server)) as ws:
            for m in messages:
                if isinstance(m, bytes):
                    await ws.send_bytes(m)
                else:
                    await ws.send_str(m if isinstance(m, str) else json.dumps(m))
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    got.append(("json", json.loads(msg.data)))
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    got.append(("binary", len(msg.data)))
    return got


def docs(got, key):
    return [doc for kind, doc in got if kind == "json" and key in doc]


def test_text_in_pieces_is_spoken_sentence_by_sentence_as_the_long_text_is(server):
    text = " ".join(SENTENCES)
    result = session(server, SETTINGS, split_pieces(text, 7))  # mid-word splits
    assert [s.text for s in result.sentences] == SENTENCES
    assert all(s.spoken_at is not None and s.samples > 0 for s in result.sentences)
    assert [s.index for s in result.sentences] == [0, 1, 2]
    assert result.done["sentences"] == 3 and not result.errors
    # The same sentences as one long text, same seed, a chunk per sentence: the same frames.
    body = {**SETTINGS, "text": text, "format": "wav"}
    status, _, out = request(server.url + "/invocations", body, accept="application/json")
    assert status == 200, out
    whole = json.loads(out)
    assert result.done["frames"] == whole["frames"]
    audio, rate = sf.read(io.BytesIO(base64.b64decode(whole["audio"])), dtype="int16")
    assert rate == result.sample_rate and len(result.audio) // 2 == len(audio)
    # Each sentence's audio is whole frames of the codec.
    hop = len(audio) // whole["frames"]
    assert all(s.samples % hop == 0 for s in result.sentences)


def test_wav_framing_and_a_sentence_per_message(server):
    result = session(server, {**SETTINGS, "format": "wav"}, ["One sentence here.", "Two sentences now."])
    assert [s.text for s in result.sentences] == ["One sentence here.", "Two sentences now."]
    assert [s.part for s in result.sentences] == [1, 2]
    assert result.audio_seconds > 0


def test_flush_speaks_what_is_buffered(server):
    got = asyncio.run(raw_session(server, [SETTINGS, "no sentence end yet", {"flush": True}, "and more",
                                           {"end": True}]))
    assert [d["text"] for d in docs(got, "queued")] == ["no sentence end yet", "and more"]
    assert [d["spoken"] for d in docs(got, "spoken")] == [0, 1]
    assert docs(got, "done")


def active_rows(server) -> int:
    status, _, body = request(server.url + "/ping")
    assert status == 200
    return sum(core["active"] for core in json.loads(body)["load"])


def rows_freed(server, deadline_s: float = 10.0) -> bool:
    """Whether the server's rows are all free again before the deadline (polled through /ping)."""
    end = time.monotonic() + deadline_s
    while active_rows(server):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_closing_the_input_speaks_what_was_sent_then_ends(server):
    """A client that closes its side after its text (as AWS's samples end a stream) still gets
    that text's audio, then "done" and the server's close; the row is freed."""
    async def go():
        got = []
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(ws_url(server)) as ws:
                await ws.send_str(json.dumps(SETTINGS))
                await ws.send_str("Spoken after the input closes. And this part has no end")
                # Close our side and read on (aiohttp's own close() would discard what follows).
                await ws._writer.close(1000, b"")
                async for msg in ws:
                    got.append(("json", json.loads(msg.data)) if msg.type == aiohttp.WSMsgType.TEXT
                               else ("binary", len(msg.data)))
        return got

    got = asyncio.run(go())
    assert [d["text"] for d in docs(got, "queued")] == ["Spoken after the input closes.", "And this part has no end"]
    assert [d["spoken"] for d in docs(got, "spoken")] == [0, 1] and docs(got, "done")
    assert any(kind == "binary" for kind, _ in got)
    assert rows_freed(server)


def test_an_idle_session_holds_no_row_and_leaving_it_frees_everything(server):
    """Set up, or done with a sentence and waiting for the next: the session holds no batch row
    (/ping's load says so). A polite close and a dropped connection both end it cleanly."""
    async def go(polite: bool, speak: bool):
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(ws_url(server))
            await ws.send_str(json.dumps(SETTINGS))
            assert "ready" in json.loads((await ws.receive()).data)
            if speak:
                await ws.send_str("One sentence, then silence.")
                while True:
                    msg = await ws.receive()
                    if msg.type == aiohttp.WSMsgType.TEXT and "spoken" in json.loads(msg.data):
                        break
            assert rows_freed(server)  # idle: parked without a row
            if polite:
                await ws.close()
            else:
                ws._response.connection.transport.abort()

    for polite in (True, False):
        for speak in (False, True):
            asyncio.run(go(polite, speak))
            assert rows_freed(server), polite
    assert request(server.url + "/ping")[0] == 200


@pytest.fixture(scope="module")
def timed(package_dir, tmp_path_factory):
    s = start(package_dir, tmp_path_factory.mktemp("bidi-timed"), FISH_SM_MAX_BATCH="2",
              FISH_SM_SESSION_IDLE_S="1", FISH_SM_SESSION_MAX_S="4")
    yield s
    s.stop()


def test_idle_and_overlong_sessions_are_closed_with_a_reason(timed):
    """No message for FISH_SM_SESSION_IDLE_S with nothing to speak: closed as idle (pings do
    not count). Messages that keep coming do not keep a session past FISH_SM_SESSION_MAX_S."""
    async def idle():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(ws_url(timed), heartbeat=0.2) as ws:  # pings, which do not count
                await ws.send_str(json.dumps(SETTINGS))
                return [json.loads(m.data) for m in [await ws.receive() for _ in range(2)]
                        if m.type == aiohttp.WSMsgType.TEXT]

    async def chatty():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(ws_url(timed)) as ws:
                await ws.send_str(json.dumps(SETTINGS))
                got = []
                for _ in range(100):  # a word every 0.1 s, never a sentence's end, until the server closes
                    try:
                        msg = await ws.receive(timeout=0.1)
                    except asyncio.TimeoutError:
                        await ws.send_str("word ")
                        continue
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        return got
                    got.append(json.loads(msg.data))
                return got

    ready, closing = asyncio.run(idle())
    assert "ready" in ready and closing["status"] == 408 and closing["reason"] == "idle"
    assert "idle for 1 s" in closing["error"]
    got = asyncio.run(chatty())
    assert got[-1]["status"] == 408 and got[-1]["reason"] == "max_length" and "4 s limit" in got[-1]["error"]
    assert rows_freed(timed)


@pytest.mark.parametrize("first, message", [
    ("not json", "is not valid JSON"),
    ([1, 2], "must be a JSON object"),
    ({"text": "Hi."}, "has no 'text'"),
    ({"voice": "nobody"}, "unknown voice 'nobody'"),
    ({"format": "mp3"}, "cannot be streamed"),
    ({"seed": -1}, "seed"),
    ({"bogus": 1}, "unknown field(s): bogus"),
])
def test_a_bad_first_message_ends_the_session_cleanly(server, first, message):
    got = asyncio.run(raw_session(server, [first]))
    assert len(got) == 1 and message in got[0][1]["error"] and got[0][1]["status"] >= 400
    assert request(server.url + "/ping")[0] == 200


def test_settings_may_come_in_the_query_string(server):
    """SageMaker's ModelQueryString reaches the WebSocket's URL: its settings count as the first
    message's (which win), checked the same way."""
    async def go(query: str, first: dict) -> list:
        got = []
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(ws_url(server) + query) as ws:
                await ws.send_str(json.dumps(first))
                await ws.send_str("From the query.")
                await ws.send_str(json.dumps({"end": True}))
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        got.append(("json", json.loads(msg.data)))
        return got

    settings = {k: v for k, v in SETTINGS.items() if k not in ("voice", "seed")}
    got = asyncio.run(go("?voice=narrator&seed=7", settings))
    assert docs(got, "ready") and docs(got, "done")
    for query, message in [("?voice=nobody", "unknown voice 'nobody'"), ("?seed=seven", "'seven'"),
                           ("?bogus=1", "unknown field(s): bogus"), ("?seed=1&seed=2", "given 2 times"),
                           ("?text=Hi", "not in the query")]:
        got = asyncio.run(go(query, settings))
        assert len(got) == 1 and message in got[0][1]["error"], (query, got)
    assert request(server.url + "/ping")[0] == 200


def test_bad_parts_get_errors_and_the_session_lives_on(server):
    got = asyncio.run(raw_session(server, [
        SETTINGS, "{not json", {"bogus": True}, {"end": "yes"}, b"\xff\xfe", "x" * 201,
        "This one is fine.", {"end": True}]))
    errors = [d["error"] for d in docs(got, "error")]
    assert len(errors) == 5
    assert "not valid JSON" in errors[0] and "unknown control field(s): bogus" in errors[1]
    assert "'end' must be true" in errors[2] and "not UTF-8" in errors[3]
    assert "limit is 200" in errors[4] and docs(got, "error")[4]["status"] == 413
    assert [d["text"] for d in docs(got, "queued")] == ["This one is fine."]
    assert docs(got, "done")


def test_twenty_sessions_at_once_all_complete(server):
    async def go():
        async def one(i):
            async with WebSocketChannel(server.url, timeout_s=300) as channel:
                return await run_session(channel, {**SETTINGS, "seed": i, "max_new_tokens": 6},
                                         split_pieces(f"Session {i} says hello. And goodbye.", 5))
        return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(go())
    assert all(r.done and len(r.sentences) == 2 and r.audio_seconds > 0 for r in results)


@pytest.fixture(scope="module")
def one_slot(package_dir, tmp_path_factory):
    """One batch row and one queue place."""
    s = start(package_dir, tmp_path_factory.mktemp("bidi1"), FISH_SM_MAX_BATCH="1", FISH_SM_MAX_QUEUE="1",
              FISH_SM_MAX_NEW_TOKENS="512")
    yield s
    s.stop()


LONG = " ".join(f"This is sentence number {i} of a long answer." for i in range(8))


def test_barge_in_stops_the_audio_and_frees_the_row(one_slot):
    cancelled = session(one_slot, {**SETTINGS, "max_new_tokens": 512}, split_pieces(LONG, 40),
                        cancel_after_s=0.0)
    assert cancelled.cancelled and cancelled.done is None and cancelled.audio
    assert all(s.spoken_at is None for s in cancelled.sentences[1:])  # 8 sentences of up to 512 frames: cut short
    # The next session takes the freed row at once and completes.
    result = session(one_slot, {**SETTINGS, "max_new_tokens": 4}, ["Right after the barge-in."])
    assert result.done and result.sentences[0].samples > 0
    assert result.sentences[0].first_audio_at - result.started < 10


def test_a_full_server_refuses_a_session_and_nothing_follows_a_cancel(one_slot):
    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(ws_url(one_slot)) as a, http.ws_connect(ws_url(one_slot)) as b:
                await a.send_str(json.dumps({**SETTINGS, "max_new_tokens": 512}))
                assert "ready" in json.loads((await a.receive()).data)  # the row
                for piece in split_pieces(LONG, 40):
                    await a.send_str(piece)
                while (await a.receive()).type != aiohttp.WSMsgType.BINARY:
                    pass  # until its audio flows
                await b.send_str(json.dumps({**SETTINGS, "max_new_tokens": 4}))
                assert "ready" in json.loads((await b.receive()).data)  # the queue place
                refused = await raw_session(one_slot, [{**SETTINGS, "max_new_tokens": 4}])
                await a.send_str(json.dumps({"cancel": True}))
                rest = [m async for m in a]
                await b.send_str(json.dumps({"cancel": True}))
                [m async for m in b]
        return refused, rest

    refused, rest = asyncio.run(go())
    assert len(refused) == 1 and refused[0][1]["status"] == 503 and "retry after" in refused[0][1]["error"]
    texts = [json.loads(m.data) for m in rest if m.type == aiohttp.WSMsgType.TEXT]
    assert {"cancelled": True} in texts
    after = rest[[i for i, m in enumerate(rest) if m.type == aiohttp.WSMsgType.TEXT
                  and json.loads(m.data) == {"cancelled": True}][0] + 1:]
    assert not [m for m in after if m.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT)]
    assert request(one_slot.url + "/ping")[0] == 200


def test_invoke_bidi_writes_the_audio_as_it_arrives_with_a_line_per_sentence(server, tmp_path):
    from click.testing import CliRunner

    from fish_sm.cli import main

    story = tmp_path / "story.txt"
    story.write_text(" ".join(SENTENCES) + "\n")
    out = tmp_path / "said.wav"
    result = CliRunner().invoke(main, ["invoke", "--url", server.url, "--bidi", str(story), "--piece-chars", "6",
                                       "--voice", "narrator", "--seed", "3", "--max-new-tokens", "8",
                                       "--chunk-length", str(CHUNK), "-o", str(out)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("sentence ")]
    assert [line.split(":")[0] for line in lines] == ["sentence 1", "sentence 2", "sentence 3"]
    assert all("first audio" in line and " ms " in line for line in lines)
    audio, rate = sf.read(out, dtype="int16")
    assert rate == 44100 and len(audio) > 0
    assert f"wrote {out}: {len(audio) / rate:.2f} s of audio in 3 sentence(s)" in result.stdout


def test_invoke_bidi_from_stdin_and_its_errors_in_one_line(server, tmp_path):
    from click.testing import CliRunner

    from fish_sm.cli import main

    out = tmp_path / "said.pcm"
    ok = CliRunner().invoke(main, ["invoke", "--url", server.url, "--bidi", "-", "--max-new-tokens", "6",
                                   "-o", str(out)], input="Piped in. Line by line.\n")
    assert ok.exit_code == 0, ok.output
    assert out.stat().st_size > 0 and out.stat().st_size % 2 == 0
    bad = CliRunner().invoke(main, ["invoke", "--url", server.url, "--bidi", "-", "--voice", "nobody"], input="Hi.")
    assert bad.exit_code == 1 and bad.output.strip().splitlines() == [
        "Error: the server refused the session (400): unknown voice 'nobody'; packaged voices: narrator"]


def test_bench_bidi_reports_first_sentence_audio_and_gaps(server, tmp_path):
    from click.testing import CliRunner

    from fish_sm.cli import main

    result = CliRunner().invoke(main, ["bench", "--url", server.url, "--bidi", "--concurrency", "1,4", "--requests", "4",
                                       "--max-new-tokens", "6", "--piece-interval", "0", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench-bidi.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for lv in report["levels"]:
        assert lv["ok"] == lv["sessions"] == 4 and not lv["errors"]
        assert lv["sentences"] == 4 * 4  # BENCH_TEXT has four sentences
        assert 0 < lv["first_sentence_audio_ms"]["p50"] <= lv["first_sentence_audio_ms"]["p99"]
        assert lv["sentence_gap_ms"]["p50"] is not None
    assert "1st p50 ms" in result.output and "gap p50 ms" in result.output


def test_bench_bidi_times_a_barge_in_that_keeps_the_session(server, tmp_path):
    from click.testing import CliRunner

    from fish_sm.cli import main

    result = CliRunner().invoke(main, ["bench", "--url", server.url, "--bidi", "--concurrency", "2", "--requests", "2",
                                       "--max-new-tokens", "40", "--piece-interval", "0", "--clear-after", "0",
                                       "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (level,) = json.loads((tmp_path / "bench-bidi.json").read_text())["levels"]
    assert level["ok"] == 2 and not level["errors"]
    assert level["clear_ms"]["p50"] > 0 and level["after_clear_first_audio_ms"]["p50"] > 0
    assert "clear p50 ms" in result.output
    assert CliRunner().invoke(main, ["bench", "--url", server.url, "--clear-after", "1"]).output.strip().endswith(
        "--clear-after is for --bidi sessions")

"""The bidirectional session's parts that need no server: sentence splitting, the image label,
the endpoint path's request parts and its one-line error where AWS's HTTP/2 client is missing."""

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.clients.bidi import SDK_PACKAGE, endpoint_parts, split_pieces
from fish_sm.serving.bidi import SentenceBuffer

REPO = Path(__file__).resolve().parents[2]


def feed(pieces):
    buffer, out = SentenceBuffer(), []
    for piece in pieces:
        out.append(buffer.add(piece))
    return out, buffer


def test_sentences_end_at_punctuation_before_space_or_the_end_of_a_part():
    out, buffer = feed(["Hel", "lo there. How a", "re you? It costs 3.", "5 dollars.", "Next一句。好", "\nok"])
    assert out == [[], ["Hello there."], ["How are you?"], ["It costs 3.5 dollars."], ["Next一句。"], ["好"]]
    assert buffer.flush() == ["ok"] and buffer.flush() == []


def test_a_part_may_hold_several_sentences_and_mid_word_splits_join():
    text = "One. Two! Three? Four… five"
    assert sum(feed(split_pieces(text, 3))[0], []) == ["One.", "Two!", "Three?", "Four…"]
    assert feed([text])[0] == [["One.", "Two!", "Three?", "Four…"]]


def test_the_image_declares_bidirectional_streaming():
    lines = (REPO / "deploy" / "Dockerfile").read_text().splitlines()
    assert "LABEL com.amazonaws.sagemaker.capabilities.bidirectional-streaming=true" in lines


def test_endpoint_parts_are_whole_utf8_messages_the_last_complete():
    parts = endpoint_parts(['{"voice": "narrator"}', "Héllo. ", '{"end": true}'])
    assert [p["Bytes"].decode() for p in parts] == ['{"voice": "narrator"}', "Héllo. ", '{"end": true}']
    assert {p["DataType"] for p in parts} == {"UTF8"}
    assert [p["CompletionState"] for p in parts] == ["PARTIAL", "PARTIAL", "COMPLETE"]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="AWS's HTTP/2 client may be installed on 3.12+")
def test_invoke_bidi_on_an_endpoint_says_what_is_missing(tmp_path):
    story = tmp_path / "story.txt"
    story.write_text("Hello.")
    result = CliRunner().invoke(main, ["invoke", "tts", "--bidi", str(story), "--region", "us-east-1"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: invoke --bidi against an endpoint needs AWS's {SDK_PACKAGE} client (it needs Python 3.12 or newer; "
        f"this is 3.11): pip install {SDK_PACKAGE}; or call a server with --url"]


@pytest.mark.parametrize("args, message", [
    (["--url", "http://x", "--bidi", "-", "Hello"], "give no TEXT"),
    (["--url", "http://x", "--bidi", "-", "--stream"], "not with --stream"),
    (["--url", "http://x", "--bidi", "nothing-here.txt"], "no such file"),
    (["--url", "http://x", "--bidi", "-", "-o", "x.mp3"], "writes wav, or bare pcm"),
])
def test_invoke_bidi_usage_errors(args, message):
    result = CliRunner().invoke(main, ["invoke", *args])
    assert result.exit_code == 2 and message in result.output


def test_bench_bidi_is_for_servers():
    result = CliRunner().invoke(main, ["bench", "tts", "--bidi"])
    assert result.exit_code == 2 and "--bidi benchmarks a server" in result.output

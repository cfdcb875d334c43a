"""Request parsing: every field checked, every problem a clear status and message."""

import base64
import json

import pytest

from fish_sm.serving.errors import HTTPError
from fish_sm.serving.request import parse_body, response_format
from fish_sm.settings import Settings

S = Settings(max_text_chars=100, max_reference_bytes=1000, allowed_buckets=("voices-ok",))
B64 = base64.b64encode(b"RIFF....WAVEfmt ").decode()


def parse(body, ctype="application/json"):
    return parse_body(json.dumps(body) if not isinstance(body, (str, bytes)) else body, ctype, S)


def test_defaults_and_types():
    (r,) = parse({"text": "Hello"})
    assert r.text == "Hello" and r.voice is None and r.format is None and r.chunk_length == 200
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.repetition_penalty) == (0.8, 0.8, 1.1)
    (r,) = parse({"text": "Hi", "temperature": 1, "top_p": 0.5, "seed": 7, "format": "FLAC", "sample_rate": 16000,
                  "max_new_tokens": 50, "chunk_length": 120, "voice": "narrator"})
    assert r.sampling.temperature == 1.0 and r.sampling.seed == 7 and r.format == "flac" and r.sample_rate == 16000
    assert r.sampling.max_new_tokens == 50 and r.chunk_length == 120 and r.voice == "narrator"


def test_text_plain_and_jsonlines():
    assert parse("Just text, 你好", "text/plain; charset=utf-8")[0].text == "Just text, 你好"
    lines = "\n".join(json.dumps({"text": f"line {i}"}) for i in range(3)) + "\n\n"
    assert [r.text for r in parse(lines, "application/jsonlines")] == ["line 0", "line 1", "line 2"]


def test_references():
    (r,) = parse({"text": "x", "reference": {"audio": B64, "text": "ref words"}})
    assert r.reference.audio.startswith(b"RIFF") and r.reference.text == "ref words"
    (r,) = parse({"text": "x", "reference": {"audio": "s3://voices-ok/a/b.wav", "text": "t"}})
    assert (r.reference.s3_bucket, r.reference.s3_key) == ("voices-ok", "a/b.wav")


BAD = [
    ("{not json", "application/json", 400, "not valid JSON"),
    ([1, 2], "application/json", 400, "JSON object"),
    ({}, "application/json", 400, "'text' is required"),
    ({"text": 5}, "application/json", 400, "'text' is required"),
    ({"text": "   "}, "application/json", 400, "'text' is empty"),
    ({"text": "x" * 101}, "application/json", 413, "limit is 100"),
    ({"text": "x", "temprature": 0.5}, "application/json", 400, "unknown field(s): temprature"),
    ({"text": "x", "temperature": "hot"}, "application/json", 400, "'temperature' must be a number"),
    ({"text": "x", "temperature": 3.0}, "application/json", 400, "temperature must be a number in [0.1, 1.0]"),
    ({"text": "x", "top_p": 0}, "application/json", 400, "top_p"),
    ({"text": "x", "repetition_penalty": 5}, "application/json", 400, "repetition_penalty"),
    ({"text": "x", "max_new_tokens": 0}, "application/json", 400, "max_new_tokens must be in"),
    ({"text": "x", "max_new_tokens": 1.5}, "application/json", 400, "'max_new_tokens' must be an integer"),
    ({"text": "x", "seed": "abc"}, "application/json", 400, "'seed' must be an integer"),
    ({"text": "x", "chunk_length": 10}, "application/json", 400, "chunk_length must be in"),
    ({"text": "x", "format": "aiff"}, "application/json", 400, "format 'aiff' is not supported"),
    ({"text": "x", "sample_rate": 12345}, "application/json", 400, "sample_rate 12345"),
    ({"text": "x", "voice": 3}, "application/json", 400, "'voice' must be a string"),
    ({"text": "x", "reference": "abc"}, "application/json", 400, "'reference' must be an object"),
    ({"text": "x", "reference": {"audio": "!!!notbase64", "text": "t"}}, "application/json", 400, "not valid base64"),
    ({"text": "x", "reference": {"audio": B64}}, "application/json", 400, "transcript"),
    ({"text": "x", "reference": {"audio": B64, "text": "t", "lang": "en"}}, "application/json", 400, "unknown field(s) in 'reference'"),
    ({"text": "x", "reference": {"audio": "s3://other-bucket/k.wav", "text": "t"}}, "application/json", 403, "not allowed"),
    ({"text": "x", "reference": {"audio": "s3://x", "text": "t"}}, "application/json", 400, "not a valid S3 URI"),
    ({"text": "x", "reference": {"audio": "A" * 2000, "text": "t"}}, "application/json", 413, "byte limit"),
    ({"text": "x", "voice": "a", "reference": {"audio": B64, "text": "t"}}, "application/json", 400, "not both"),
    ("<xml/>", "application/xml", 415, "not supported"),
    ("", "application/jsonlines", 400, "no requests"),
    ('{"text": "ok"}\n{"text": 1}', "application/jsonlines", 400, "line 2: field 'text'"),
    (b"\xff\xfe", "text/plain", 400, "not UTF-8"),
]


@pytest.mark.parametrize("body, ctype, status, message", BAD, ids=[m for *_, m in BAD])
def test_bad_requests(body, ctype, status, message):
    with pytest.raises(HTTPError) as err:
        parse(body, ctype)
    assert err.value.status == status and message in err.value.message
    assert json.loads(err.value.body()) == {"error": err.value.message}


@pytest.mark.parametrize("accept, fmt, expected", [
    (None, None, ("audio/wav", "wav")),
    ("*/*", "flac", ("audio/flac", "flac")),
    ("audio/mpeg", None, ("audio/mpeg", "mp3")),
    ("application/json", "ogg", ("application/json", "ogg")),
    ("text/html, audio/x-wav;q=0.9", None, ("audio/wav", "wav")),
])
def test_response_format(accept, fmt, expected):
    (r,) = parse({"text": "x", **({"format": fmt} if fmt else {})})
    assert response_format(accept, r) == expected


def test_response_format_errors():
    (r,) = parse({"text": "x", "format": "flac"})
    with pytest.raises(HTTPError, match="conflicts|asks for") as err:
        response_format("audio/wav", r)
    assert err.value.status == 400
    with pytest.raises(HTTPError) as err:
        response_format("text/html", r)
    assert err.value.status == 406


def test_settings_from_env_are_validated():
    from fish_sm.errors import ConfigError

    s = Settings.from_env({"FISH_SM_ALLOWED_BUCKETS": "a, b", "FISH_SM_WARMUP": "0", "FISH_SM_QUANTIZE": "INT8", "PATH": "/bin",
                           "FISH_SM_CODEC_PRECISION": "float32"})
    assert s.allowed_buckets == ("a", "b") and s.warmup == 0 and s.quantize == "int8" and s.codec_precision == "float32"
    assert Settings.from_env({}).codec_precision == "auto"
    assert Settings.from_env({}).capture == "early" and Settings.from_env({"FISH_SM_CAPTURE": "all"}).capture == "all"
    assert Settings.from_env({}).piece_repeats == 3 and Settings.from_env({"FISH_SM_PIECE_REPEATS": "1"}).piece_repeats == 1
    for env, message in [({"FISH_SM_WARMUP": "two"}, "FISH_SM_WARMUP='two' is not a valid int"),
                         ({"FISH_SM_QUANTISE": "int8"}, "unknown setting FISH_SM_QUANTISE"),
                         ({"FISH_SM_COMPILE": "maybe"}, "FISH_SM_COMPILE='maybe'"),
                         ({"FISH_SM_CODEC_PRECISION": "float16"}, "FISH_SM_CODEC_PRECISION='float16': choose one of auto, float32"),
                         ({"FISH_SM_CAPTURE": "late"}, "FISH_SM_CAPTURE='late': choose one of early, all"),
                         ({"FISH_SM_MAX_TEXT_CHARS": "0"}, "FISH_SM_MAX_TEXT_CHARS must be at least 1"),
                         ({"FISH_SM_PIECE_REPEATS": "0"}, "FISH_SM_PIECE_REPEATS must be 1 to 4"),
                         ({"FISH_SM_SESSION_IDLE_S": "0"}, "FISH_SM_SESSION_IDLE_S must be in (0, 3600] seconds"),
                         ({"FISH_SM_SESSION_MAX_S": "100000"}, "FISH_SM_SESSION_MAX_S in (0, 86400]")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Settings.from_env(env)


def test_benchmark_lengths_is_an_off_by_default_server_setting():
    """FISH_SM_BENCHMARK_LENGTHS (benchmarks only) comes from the environment alone, never from a request."""
    from fish_sm.errors import ConfigError

    assert Settings.from_env({}).benchmark_lengths is False
    assert Settings.from_env({"FISH_SM_BENCHMARK_LENGTHS": "TRUE"}).benchmark_lengths is True
    assert Settings.from_env({"FISH_SM_BENCHMARK_LENGTHS": "false"}).benchmark_lengths is False
    with pytest.raises(ConfigError, match="FISH_SM_BENCHMARK_LENGTHS='yes' is not a valid bool"):
        Settings.from_env({"FISH_SM_BENCHMARK_LENGTHS": "yes"})
    with pytest.raises(HTTPError) as err:
        parse({"text": "Hi.", "benchmark_lengths": True})
    assert err.value.status == 400 and "benchmark_lengths" in err.value.message

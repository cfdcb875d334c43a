"""Results a pipeline can trust: invoke, bench and transform against moto's server over HTTP fail,
in one line, on answers that are not audio and on missing results, and pass on real audio.

moto answers InvokeEndpoint with a canned body ("body", content type "content_type") unless
results are queued, and asynchronous inference with {"default": "response"}; its transform
jobs complete at once without writing anything. The good paths queue a real WAV: 8-bit PCM at
8 kHz, whose bytes are all below 0x80 so that they pass moto's JSON queue (text) unchanged.
"""

import io
import json
import struct
import urllib.request

import boto3
import numpy as np
import pytest
import soundfile as sf
from botocore.config import Config
from click.testing import CliRunner

from moto_helpers import moto_server
from fish_sm.cli import main
from fish_sm.clients import bench as b
from fish_sm.clients.report import format_table, table_rows, verdict_lines, write_html
from fish_sm.clients.request import format_for
from fish_sm.clients.response import NOT_AUDIO, Response, check_audio
from fish_sm.errors import InputError

pytestmark = pytest.mark.integration

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-checked"


def ascii_wav(n: int = 80) -> bytes:
    """A valid WAV (8-bit unsigned PCM, mono, 8 kHz) whose every byte is below 0x80."""
    samples = bytes(0x40 + (i % 32) for i in range(n))
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, 8000, 8000, 1, 8)
    wav = b"RIFF" + struct.pack("<I", 36 + n) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", n) + samples
    assert max(wav) < 0x80
    return wav


def client(url, service):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    """moto with a bucket, a real-time endpoint "rt" and an asynchronous one "asy" (both born InService)."""
    with moto_server(tmp_path_factory) as url:
        client(url, "s3").create_bucket(Bucket=BUCKET)
        sm = client(url, "sagemaker")
        for name, extra in (("rt", {}), ("asy", {"AsyncInferenceConfig": {
                "OutputConfig": {"S3OutputPath": f"s3://{BUCKET}/async/out/"}}})):
            sm.create_model(ModelName=f"{name}-m", ExecutionRoleArn=ROLE,
                            PrimaryContainer={"Image": "123.dkr/fish-sm:1", "ModelDataUrl": f"s3://{BUCKET}/m.tar.gz"})
            sm.create_endpoint_config(EndpointConfigName=f"{name}-c", ProductionVariants=[{
                "VariantName": "AllTraffic", "ModelName": f"{name}-m", "InitialInstanceCount": 2,
                "InstanceType": "ml.g4dn.xlarge"}], **extra)
            sm.create_endpoint(EndpointName=name, EndpointConfigName=f"{name}-c")
        yield url


def queue(url, path, results):
    """moto's queue of answers for InvokeEndpoint ("endpoint-results") or the async kind."""
    req = urllib.request.Request(f"{url}/moto-api/static/sagemaker/{path}", method="POST",
                                 data=json.dumps({"results": results}).encode())
    urllib.request.urlopen(req).close()


def run(*args):
    result = CliRunner().invoke(main, [*map(str, args)])
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception, SystemExit))
    return result


def fails(*args) -> str:
    """The command exits 1 with exactly one line, 'Error: ...'; returns that line."""
    result = run(*args)
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: "), result.output
    return line


# -- invoke -------------------------------------------------------------------------------


def test_invoke_refuses_motos_canned_body_and_writes_nothing(moto_url, tmp_path):
    out = tmp_path / "out.wav"
    result = run("invoke", "rt", "Hello.", "-o", out, "--endpoint-url", moto_url)
    assert result.exit_code == 1
    line, = result.output.strip().splitlines()
    assert line == ("Error: endpoint rt answered content_type, 4 B, starting b'body'; "
                    "not the wav audio asked for: its type is not audio/wav")
    assert not out.exists()


def test_invoke_names_a_json_error_and_a_body_that_does_not_decode(moto_url, tmp_path):
    queue(moto_url, "endpoint-results", [
        {"Body": '{"error": "text is too long"}', "ContentType": "application/json",
         "InvokedProductionVariant": "AllTraffic", "CustomAttributes": ""},
        {"Body": "RIFF but not really", "ContentType": "audio/wav", "InvokedProductionVariant": "AllTraffic",
         "CustomAttributes": ""},
        {"Body": "", "ContentType": "audio/flac", "InvokedProductionVariant": "AllTraffic", "CustomAttributes": ""}])
    line = fails("invoke", "rt", "One.", "-o", tmp_path / "a.wav", "--endpoint-url", moto_url)
    assert "application/json" in line and "error 'text is too long'" in line
    line = fails("invoke", "rt", "Two.", "-o", tmp_path / "b.wav", "--endpoint-url", moto_url)
    assert "audio/wav, 19 B, starting b'RIFF but not really'" in line and "it does not decode" in line
    line = fails("invoke", "rt", "Three.", "-o", tmp_path / "c.flac", "--endpoint-url", moto_url)
    assert "audio/flac, 0 B, empty" in line and "it is empty" in line
    assert not list(tmp_path.iterdir())


def test_invoke_writes_real_audio_and_prints_json(moto_url, tmp_path):
    queue(moto_url, "endpoint-results", [{"Body": ascii_wav().decode(), "ContentType": "audio/wav",
                                          "InvokedProductionVariant": "AllTraffic", "CustomAttributes": ""}])
    out = tmp_path / "ok.wav"
    result = run("invoke", "rt", "--text", "Fine.", "-o", out, "--output", "json", "--endpoint-url", moto_url)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["output"] == str(out) and doc["format"] == "wav" and doc["content_type"] == "audio/wav"
    assert doc["bytes"] == len(ascii_wav()) and doc["audio_seconds"] == pytest.approx(80 / 8000)
    assert doc["target"] == "endpoint rt" and doc["stream"] is False
    audio, rate = sf.read(out)
    assert rate == 8000 and len(audio) == 80


def test_invoke_async_refuses_motos_default_result(moto_url, tmp_path):
    out = tmp_path / "async.wav"
    line = fails("invoke", "asy", "Hello.", "--async", "-o", out, "--poll", 0.01, "--endpoint-url", moto_url)
    assert line.startswith("Error: endpoint asy answered ") and "starting b'{\"default\": \"response\"}'" in line
    assert "it does not decode" in line and not out.exists()


def test_invoke_async_writes_real_audio(moto_url, tmp_path):
    queue(moto_url, "async-endpoint-results", [{"data": ascii_wav().decode()}])
    out = tmp_path / "async.wav"
    result = run("invoke", "asy", "Hello.", "--async", "-o", out, "--poll", 0.01, "--endpoint-url", moto_url)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == ascii_wav() and "0.01 s of audio" in result.output


def test_invoke_explains_a_missing_endpoint(moto_url, tmp_path):
    """moto answers InvokeEndpoint for any name; the error then says why, from DescribeEndpoint."""
    line = fails("invoke", "nobody", "Hi.", "-o", tmp_path / "x.wav", "--endpoint-url", moto_url)
    assert line == "Error: endpoint 'nobody' does not exist in us-east-1"


def test_invoke_checks_its_arguments_before_any_request(tmp_path):
    """Nothing listens on port 9: each of these is refused before a request would fail to connect."""
    url = ["--url", "http://127.0.0.1:9"]
    line = fails("invoke", *url, "Hi.", "-o", tmp_path / "x.xyz")
    assert line == (f"Error: -o {tmp_path / 'x.xyz'}: .xyz names no audio format; use .wav, .flac, .ogg, .mp3, "
                    ".pcm, .raw, or give --format wav|flac|ogg|mp3|pcm")
    assert "a name without an extension" in fails("invoke", *url, "Hi.", "-o", tmp_path / "noext")
    assert "names wav audio but --format is ogg" in fails("invoke", *url, "Hi.", "-o", tmp_path / "a.wav",
                                                         "--format", "ogg")
    result = run("invoke", "some-endpoint", "Hi.", "--text", "Hi.")
    assert result.exit_code == 2 and "give the text to speak once" in result.output
    result = run("invoke", *url)
    assert result.exit_code == 2 and "give the text to speak once" in result.output
    result = run("invoke", "some-endpoint", *url, "Hi.")
    assert result.exit_code == 2 and "exactly one of NAME, --url" in result.output
    assert not list(tmp_path.iterdir())
    help_text = run("invoke", "--help").output
    assert "[wav|flac|ogg|mp3|pcm]" in help_text and "[text|json]" in help_text and "[NAME] [TEXT]" in help_text


def test_format_for():
    assert format_for(None, None) == "wav" and format_for(None, "ogg") == "ogg"
    assert format_for("a.RAW", None) == "pcm" and format_for("a.bin", "pcm") == "pcm"
    assert format_for("a.flac", "flac") == "flac"
    with pytest.raises(InputError, match="names no audio format"):
        format_for("a.txt", None)


# -- bench --------------------------------------------------------------------------------


def test_bench_on_motos_answers_fails_and_says_why(moto_url, tmp_path):
    out = tmp_path / "bench"
    result = run("bench", "rt", "--concurrency", "1,2", "--requests", 3, "--warmup", 0, "-o", out,
                 "--endpoint-url", moto_url)
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: 2 of 2 level(s) over --max-error-rate 0: concurrency 1 3/3 failed, "
                           "concurrency 2 3/3 failed; e.g. endpoint rt answered content_type, 4 B")
    assert "concurrency 1: FAIL: 3 of 3 request(s) brought no audio (100%; at most 0% may)" in result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["passed"] is False and report["target"] == "endpoint rt" and report["device"] == "2 x ml.g4dn.xlarge"
    for level in report["levels"]:
        assert level["ok"] == 0 and level["errors"] == {NOT_AUDIO: 3} and level["passed"] is False
        assert level["error_rate"] == 1.0 and level["audio_seconds_per_wall_second"] == 0
    page = (out / "bench.html").read_text()
    assert "<img" not in page and "No request brought audio: nothing to plot." in page
    assert "FAIL: concurrency 1, concurrency 2 over the error rate allowed" in page
    assert page.count('<li class="fail">concurrency ') == 2


def test_bench_stream_on_moto_fails(moto_url, tmp_path):
    """moto has no InvokeEndpointWithResponseStream: every request is an error, and the run fails."""
    out = tmp_path / "bench"
    result = run("bench", "rt", "--stream", "--concurrency", "1", "--requests", 2, "--warmup", 0, "-o", out,
                 "--endpoint-url", moto_url)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: 1 of 1 level(s) over --max-error-rate 0: "
                                                             "concurrency 1 2/2 failed")
    level, = json.loads((out / "bench.json").read_text())["levels"]
    assert level["ok"] == 0 and sum(level["errors"].values()) == 2


def test_bench_max_error_rate_passes_a_level_within_it(moto_url, tmp_path):
    """Half the answers are real audio: --max-error-rate 0.5 passes, 0.4 fails; --output json is one object."""
    good = {"Body": ascii_wav().decode(), "ContentType": "audio/wav", "InvokedProductionVariant": "AllTraffic",
            "CustomAttributes": ""}
    texts = tmp_path / "texts.txt"
    texts.write_text("First text.\nSecond text.\n")
    out = tmp_path / "bench"
    # moto keeps each distinct request's answer: the first text gets the WAV, the second the canned body.
    queue(moto_url, "endpoint-results", [good])
    # --price: moto has no Pricing API, and its server's complaint would land in this process's stdout.
    common = ["bench", "rt", "--texts", texts, "--concurrency", "1", "--requests", 4, "--warmup", 0, "-o", out,
              "--price", 1.0, "--endpoint-url", moto_url]
    result = run(*common, "--max-error-rate", 0.5, "--output", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["passed"] is True and doc["settings"]["max_error_rate"] == 0.5 and "samples" not in doc
    level, = doc["levels"]
    assert (level["ok"], level["error_rate"], level["passed"]) == (2, 0.5, True)
    assert doc["json"] == str(out / "bench.json") and doc["html"] == str(out / "bench.html")
    assert '<li class="pass">concurrency 1: pass: 2 of 4' in (out / "bench.html").read_text()
    result = run(*common, "--max-error-rate", 0.4)
    assert result.exit_code == 1 and "concurrency 1 2/4 failed" in result.output.strip().splitlines()[-1]
    result = run(*common, "--max-error-rate", 1.5)
    assert result.exit_code == 2 and "1.5 is not in the range" in result.output


def test_percentiles_on_too_few_samples_are_marked():
    def samples(n):
        return [b.Sample(1, i, 0.0, 1.0 + i / 100, True, "ok", 2.0, 10, first_audio_s=0.1) for i in range(n)]

    six = b.summarize(samples(6), wall_s=6.0, concurrency=1)
    assert six["warnings"] == ["p95 from 6 samples", "p99 from 6 samples", "first audio p95 from 6 samples",
                               "RTF p95 from 6 samples"]
    twenty = b.summarize(samples(20), wall_s=20.0, concurrency=4)
    assert twenty["warnings"] == ["p99 from 20 samples"]
    hundred = b.summarize(samples(100), wall_s=50.0, concurrency=8)
    assert hundred["warnings"] == []
    report = {"stream": True, "levels": [six, twenty, hundred], "settings": {"max_error_rate": 0.0}}
    rows = table_rows(report)
    assert rows[0][3].endswith("*") and rows[0][4].endswith("*") and rows[0][6].endswith("*")
    assert not rows[1][3].endswith("*") and rows[1][4].endswith("*") and not rows[1][6].endswith("*")
    assert not any(cell.endswith("*") for cell in rows[2])
    assert "*" in format_table(report)
    notes = verdict_lines(report)
    assert notes[:3] == [f"concurrency {c}: pass: 0 of {n} request(s) brought no audio (0%; at most 0% may)"
                         for c, n in ((1, 6), (4, 20), (8, 100))]
    assert notes[3] == ("* too few samples for the percentile (p95 needs 20, p99 needs 100): concurrency 1: "
                        "p95 from 6 samples, p99 from 6 samples, first audio p95 from 6 samples, RTF p95 from 6 "
                        "samples; concurrency 4: p99 from 20 samples")


def test_html_report_names_what_was_measured_and_marks_a_failed_level(tmp_path):
    good = [b.Sample(1, i, 0.0, 1.0, True, "ok", 2.0, 10) for i in range(3)]
    bad = [b.Sample(4, i, 0.0, 0.1, False, NOT_AUDIO, None, 10, "http://x answered text/html") for i in range(3)]
    levels = [b.summarize(good, 3.0, 1), b.summarize(bad, 1.0, 4)]
    report = {"target": "http://127.0.0.1:1", "device": "cpu", "fish_sm_version": "9.9",
              "started": "2026-01-01T00:00:00+00:00", "finished": "2026-01-01T00:01:00+00:00", "accept": "audio/wav", "stream": False, "passed": False,
              "settings": {"concurrency": [1, 4], "requests": 3, "format": "wav", "stream": False, "max_new_tokens": 8,
                           "seed": 0, "max_error_rate": 0.0},
              "requests_per_level": 3, "texts": 1, "warmup": 0, "levels": levels,
              "samples": [s.__dict__ for s in good + bad]}
    page = write_html(report, tmp_path / "bench.html").read_text()
    for text in ("<th>device</th><td>cpu</td>", "<th>fish-sm</th><td>9.9</td>", "<th>max new tokens</th><td>8</td>",
                 "<th>max error rate</th><td>0.0</td>", "<th>seed</th><td>0</td>", "2026-01-01T00:00:00+00:00 UTC",
                 '<li class="pass">concurrency 1: pass', '<li class="fail">concurrency 4: FAIL: 3 of 3',
                 'id="verdict">FAIL: concurrency 4 over', "<td>FAIL</td>"):
        assert text in page, text
    assert page.count("data:image/png;base64,") == 3  # the failed level is labelled on the plots, not left empty
    assert "http://127.0.0.1:1" in page and 'src="http' not in page and "<script" not in page and "<link" not in page


def test_check_audio_on_each_format(tone, encode_audio):
    wave = tone(0.1, 16000)
    for fmt, container in (("wav", "WAV"), ("flac", "FLAC"), ("ogg", "OGG"), ("mp3", "MP3")):
        body = encode_audio(wave, 16000, container)
        seconds = check_audio(Response(body, {"mp3": "audio/mpeg"}.get(fmt, f"audio/{fmt}"), 0.1), fmt, "here")
        assert seconds == pytest.approx(0.1, abs=0.06), fmt
    flac = encode_audio(wave, 16000, "FLAC")
    with pytest.raises(Exception, match="it decodes as flac"):
        check_audio(Response(flac, "audio/wav", 0.1), "wav", "here")
    empty = io.BytesIO()
    sf.write(empty, np.zeros((0, 1), np.float32), 16000, format="WAV")
    with pytest.raises(Exception, match="it holds no samples"):
        check_audio(Response(empty.getvalue(), "audio/wav", 0.1), "wav", "here")
    assert check_audio(Response(b"\0\0" * 441, "audio/pcm;rate=44100", 0.1), "pcm", "here") == pytest.approx(0.01)
    with pytest.raises(Exception, match="an odd number of bytes"):
        check_audio(Response(b"\0\0\0", "audio/pcm", 0.1), "pcm", "here")
    # An asynchronous result kept without its type: the bytes decide.
    wav = encode_audio(wave, 16000, "WAV")
    assert check_audio(Response(wav, "binary/octet-stream", 0.1), "wav", "s3", type_stated=False) > 0
    with pytest.raises(Exception, match="its type is not audio/wav"):
        check_audio(Response(wav, "binary/octet-stream", 0.1), "wav", "here")


# -- transform ----------------------------------------------------------------------------


def test_transform_fails_naming_the_inputs_without_results(moto_url, tmp_path):
    s3 = client(moto_url, "s3")
    for key in ("batch/in/a.jsonl", "batch/in/b.jsonl", "batch/in/c.jsonl"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b'{"text": "One."}\n')
    s3.put_object(Bucket=BUCKET, Key="batch/out/a.jsonl.out", Body=b"{}\n")  # as SageMaker writes it
    result = run("transform", "rt", "--input", f"s3://{BUCKET}/batch/in/", "--output", f"s3://{BUCKET}/batch/out/",
                 "--poll", 0.01, "--download", tmp_path / "results", "--endpoint-url", moto_url)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert any(ln.endswith(": Completed") for ln in lines)  # the progress line
    assert any("Completed: 1 result file(s) for 3 input(s)" in ln for ln in lines)
    assert lines[-1].startswith("Error: transform job rt-") and lines[-1].endswith(
        "Completed but wrote no result for some inputs; no result for 2 of 3 input(s): "
        "batch/in/b.jsonl, batch/in/c.jsonl")
    assert (tmp_path / "results" / "a.jsonl.out").read_bytes() == b"{}\n"  # what did come is fetched first

    s3.put_object(Bucket=BUCKET, Key="batch/out/b.jsonl.out", Body=b"{}\n")
    s3.put_object(Bucket=BUCKET, Key="batch/out/c.jsonl.out", Body=b"{}\n")
    result = run("transform", "rt", "--input", f"s3://{BUCKET}/batch/in/", "--output", f"s3://{BUCKET}/batch/out/",
                 "--poll", 0.01, "--endpoint-url", moto_url)
    assert result.exit_code == 0, result.output
    assert "Completed: 3 result file(s) for 3 input(s)" in result.output


def test_transform_of_a_failed_job_fails(moto_url, monkeypatch):
    """moto's jobs complete; this one fails, as a container that crashes makes it on AWS."""
    from moto.sagemaker import models as sagemaker_models

    original = sagemaker_models.FakeTransformJob.__init__

    def born_failed(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.transform_job_status = "Failed"
        self.failure_reason = "ClientError: See job logs for more information"

    monkeypatch.setattr(sagemaker_models.FakeTransformJob, "__init__", born_failed)
    client(moto_url, "s3").put_object(Bucket=BUCKET, Key="failing/in/x.jsonl", Body=b'{"text": "One."}\n')
    line = fails("transform", "rt", "--input", f"s3://{BUCKET}/failing/in/", "--output", f"s3://{BUCKET}/failing/out/",
                 "--poll", 0.01, "--endpoint-url", moto_url)
    assert line.endswith("Failed: ClientError: See job logs for more information; no result for 1 of 1 input(s): "
                         "failing/in/x.jsonl")

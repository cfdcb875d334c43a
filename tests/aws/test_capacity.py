"""fish-sm capacity: the listener's playback and its underruns, the seeded open-loop plan, the
SLO search, the instance's price from the Pricing API (botocore's Stubber against the real
service model), and end to end against a real tiny `fish-sm serve` whose request lengths are
forced by the benchmark-only setting."""

import base64
import io
import json

import boto3
import numpy as np
import pytest
import soundfile as sf
from botocore.stub import Stubber
from click.testing import CliRunner

from fish_sm.aws import AWSError
from fish_sm.aws.pricing import on_demand_price
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from fish_sm.clients import capacity as cap
from fish_sm.clients.bench import BUILTIN_TEXTS
from fish_sm.clients.local_server import local_server
from fish_sm.clients.url import UrlTarget, server_info
from fish_sm.errors import InputError

FRAME = 2048  # audio samples a frame, at 44.1 kHz


# -- the listener ----------------------------------------------------------------------------

def test_underrun_is_exact_for_pieces_late_by_known_amounts():
    # 0.5 s of audio at 1.0 s plays out at 1.5 s: the next piece, at 2.0 s, is 0.5 s late.
    # At 2.5 s the listener is at 1.0 s of 1.5 s received: no wait. The 2.5 s received by then
    # play out at 4.0 s; the last piece, at 5.0 s, is 1.0 s late.
    pieces = [(1.0, 0.5), (2.0, 1.0), (2.5, 1.0), (5.0, 0.25)]
    assert cap.playback_underrun(pieces) == (pytest.approx(1.5), 2, pytest.approx(2.75))
    # The same from bytes: a 44-byte WAV header arriving alone, 100 bytes a second of audio.
    arrivals = [(0.2, 44), (1.0, 50), (2.0, 100), (2.5, 100), (5.0, 25)]
    timeline = cap.audio_pieces(arrivals, 44, 100.0)
    assert timeline == [(0.2, 0.0), (1.0, 0.5), (2.0, 1.0), (2.5, 1.0), (5.0, 0.25)]
    assert cap.playback_underrun(timeline) == (pytest.approx(1.5), 2, pytest.approx(2.75))
    # Header and audio in one piece; a stream that keeps ahead of its listener never waits.
    assert cap.audio_pieces([(0.3, 94)], 44, 100.0) == [(0.3, 0.5)]
    assert cap.playback_underrun([(0.1, 1.0), (0.5, 1.0), (1.9, 1.0)]) == (0.0, 0, 3.0)
    assert cap.playback_underrun([]) == (0.0, 0, 0.0)


def test_plan_is_seeded_open_loop_and_follows_the_mix():
    mix = cap.Mix(voice="narrator", voice_share=0.25, reference=("QUJD", "A voice."), reference_share=0.1,
                  whole_share=0.1)
    plan = cap.plan_level(mix, 64, 60.0, "poisson", seed=3)
    assert [p.body for p in plan] == [p.body for p in cap.plan_level(mix, 64, 60.0, "poisson", seed=3)]
    assert [p.at_s for p in plan] != [p.at_s for p in cap.plan_level(mix, 64, 60.0, "poisson", seed=4)]
    # Little's law: 64 listeners of mean_seconds each arrive at 64 / mean_seconds a second.
    rate = 64 / mix.mean_seconds
    assert mix.mean_seconds == pytest.approx(np.mean([len(t) for t in BUILTIN_TEXTS]) / 15)
    assert len(plan) == pytest.approx(rate * 60, rel=0.1)
    assert all(0 <= p.at_s < 60 for p in plan) and [p.at_s for p in plan] == sorted(p.at_s for p in plan)
    n = len(plan)
    voices = {kind: sum(p.voice == kind for p in plan) / n for kind in ("packaged", "reference", "none")}
    assert voices["packaged"] == pytest.approx(0.25, abs=0.05) and voices["reference"] == pytest.approx(0.1, abs=0.04)
    assert sum(not p.body.get("stream") for p in plan) / n == pytest.approx(0.1, abs=0.04)
    for p in plan:
        assert p.body["text"] in BUILTIN_TEXTS and p.body["format"] == "wav" and p.body["chunk_length"] == 1000
        assert p.body["max_new_tokens"] == max(1, round(len(p.body["text"]) / 15 * 44100 / FRAME))
        assert (p.body.get("voice") == "narrator") == (p.voice == "packaged")
        assert (p.body.get("reference") == {"audio": "QUJD", "text": "A voice."}) == (p.voice == "reference")
    fixed = cap.plan_level(mix, 8, 10.0, "fixed")
    assert np.allclose(np.diff([p.at_s for p in fixed]), mix.mean_seconds / 8)
    with pytest.raises(InputError, match="--voice-share needs --voice"):
        cap.Mix(voice_share=0.5)
    with pytest.raises(InputError, match="add up to more than 1"):
        cap.Mix(voice="v", voice_share=0.7, reference=("a", "b"), reference_share=0.5)
    with pytest.raises(InputError, match="--streams levels must be at least 1"):
        cap.parse_streams("0,4")
    assert cap.parse_streams("32, 8,16,8") == [8, 16, 32]


def _level(streams, passed):
    return {"streams": streams, "passed": passed}


def test_capacity_is_the_largest_level_before_the_first_failure():
    levels = [_level(8, True), _level(16, True), _level(32, False), _level(64, True)]
    assert cap.capacity_level(levels)["streams"] == 16  # 64 passing after 32 failed is noise
    assert cap.capacity_level([_level(8, False), _level(16, True)]) is None
    figures = cap.capacity_figures(32, gpus=4, instances=2, usd_per_hour=10.0)
    assert figures["streams_per_gpu"] == 4 and figures["audio_hours_per_instance_hour"] == 16
    assert figures["usd_per_audio_hour"] == pytest.approx(10.0 / 16)
    assert cap.capacity_figures(None, gpus=1)["usd_per_audio_hour"] is None


def test_level_summary_judges_the_slo():
    def sample(first, underrun, audio=2.0, ok=True, kind="ok", mode="stream"):
        return cap.StreamSample(8, 0, 0.0, mode, "none", 10, audio, ok, kind, 1.0, 0.0, first, audio if ok else None,
                                underrun, 1 if underrun else 0)

    good = [sample(0.1, 0.0) for _ in range(9)] + [sample(0.2, 0.002)]
    level = cap.summarize_level(good, 10.0, 8, 1.0, 10.0)
    assert level["passed"] and level["underrun"]["share"] == pytest.approx(0.002 / 20)
    assert level["underrun"]["streams"] == 1 and level["audio_seconds_per_wall_second"] == pytest.approx(2.0)
    slow = cap.summarize_level(good + [sample(0.9, 0.5)], 10.0, 8, 1.0, 10.0)
    assert not slow["passed"] and any(r.startswith("first audio p99") for r in slow["slo_failures"])
    assert any(r.startswith("underrun") for r in slow["slo_failures"])
    rejected = cap.summarize_level(good + [sample(None, None, ok=False, kind="rejected")], 10.0, 8, 1.0, 10.0,
                                   max_error_rate=0.0)
    assert not rejected["passed"] and not rejected["broken"]  # a full server fails the level, not the run
    broken = cap.summarize_level(good + [sample(None, None, ok=False, kind="HTTP 500")], 10.0, 8, 1.0, 10.0)
    assert broken["broken"] and broken["errors"] == {"HTTP 500": 1}


# -- the price ---------------------------------------------------------------------------------

def _product(component, usage, usd):
    return json.dumps({
        "serviceCode": "AmazonSageMaker",
        "product": {"productFamily": "ML Instance", "sku": usage,
                    "attributes": {"instanceType": "ml.g5.xlarge", "regionCode": "eu-west-1", "component": component,
                                   "usagetype": usage}},
        "terms": {"OnDemand": {f"{usage}.JRTCKXETXF": {"priceDimensions": {f"{usage}.JRTCKXETXF.6YS6EN2CT7": {
            "unit": "Hrs", "pricePerUnit": {"USD": usd}, "description": f"${usd} per Hour for {usage}"}}}}}})


@pytest.fixture
def pricing():
    """An AWS in eu-west-1 whose Pricing client (always us-east-1's) is a real botocore client answered by a Stubber."""
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="eu-west-1")
    aws = AWS(region="eu-west-1")
    aws._session = session
    client = session.client("pricing", region_name="us-east-1")
    aws._clients[("pricing", "us-east-1")] = client
    with Stubber(client) as stub:
        yield aws, stub


def _query(token=None):
    params = {"ServiceCode": "AmazonSageMaker", "FormatVersion": "aws_v1", "MaxResults": 100,
              "Filters": [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": "ml.g5.xlarge"},
                          {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "eu-west-1"}]}
    return {**params, "NextToken": token} if token else params


def test_price_is_the_on_demand_hosting_hour_across_pages(pricing):
    aws, stub = pricing
    stub.add_response("get_products", {"FormatVersion": "aws_v1", "NextToken": "page2",
                                       "PriceList": [_product("Training", "EU-Train:ml.g5.xlarge", "1.7200000000")]},
                      _query())
    stub.add_response("get_products", {"FormatVersion": "aws_v1",
                                       "PriceList": [_product("Hosting", "EU-Host:ml.g5.xlarge", "1.5810000000")]},
                      _query("page2"))
    price = on_demand_price(aws, "ml.g5.xlarge", "eu-west-1")
    assert price.usd_per_hour == pytest.approx(1.581) and "EU-Host:ml.g5.xlarge" in price.description
    stub.assert_no_pending_responses()


def test_price_not_listed_or_denied_is_one_line(pricing):
    aws, stub = pricing
    stub.add_response("get_products", {"FormatVersion": "aws_v1",
                                       "PriceList": [_product("Notebook", "EU-Notebk:ml.g5.xlarge", "1.90")]}, _query())
    with pytest.raises(AWSError, match="no on-demand inference price for ml.g5.xlarge in eu-west-1; pass --price"):
        on_demand_price(aws, "ml.g5.xlarge", "eu-west-1")
    stub.add_client_error("get_products", "AccessDeniedException", "not allowed", expected_params=_query())
    with pytest.raises(AWSError, match="pricing:GetProducts is denied .* pass --price USD_PER_HOUR"):
        on_demand_price(aws, "ml.g5.xlarge", "eu-west-1")


def test_endpoint_hardware_is_its_instance_type_and_count():
    """An endpoint's capacity is per GPU of its instance type, over the instances in service."""
    import datetime

    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    aws = AWS(region="us-east-1")
    aws._session = session
    client = aws._clients["sagemaker"] = session.client("sagemaker")
    with Stubber(client) as stub:
        stub.add_response("describe_endpoint", {
            "EndpointName": "tts", "EndpointArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint/tts",
            "EndpointConfigName": "tts-1", "EndpointStatus": "InService", "CreationTime": now, "LastModifiedTime": now,
            "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": 3, "DesiredInstanceCount": 3}]},
            {"EndpointName": "tts"})
        stub.add_response("describe_endpoint_config", {
            "EndpointConfigName": "tts-1", "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint-config/tts-1",
            "CreationTime": now, "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "m",
                                                         "InstanceType": "ml.g6e.12xlarge", "InitialInstanceCount": 1}]},
            {"EndpointConfigName": "tts-1"})
        assert cap.endpoint_hardware(aws, "tts") == ("ml.g6e.12xlarge", 3)


# -- against a real server whose lengths are forced ---------------------------------------------

@pytest.fixture(scope="module")
def forced_url(tiny_model, tmp_path_factory):
    """`fish-sm serve` of the tiny package with FISH_SM_BENCHMARK_LENGTHS=true (in its environment only)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("FISH_SM_BENCHMARK_LENGTHS", "true")
    server = local_server(tiny_model, log_path=tmp_path_factory.mktemp("forced") / "serve.log", startup_timeout_s=120)
    try:
        url = server.__enter__()
    finally:
        patch.undo()  # the child has its environment; nothing else here should see the setting
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@pytest.mark.integration
def test_benchmark_setting_forces_lengths(forced_url, tiny_model):
    """A request that the tiny model ends early by itself runs to exactly its max_new_tokens.

    Seed 9 draws <|im_end|> for "Hello." at once (random weights give it about 1 in 3,000 a
    frame, so an early stop further in takes thousands of frames to find): unforced, the
    request ends with no frame at all (the server's 422), forced it speaks all 24."""
    from fish_sm.engine import Engine

    text, seed, n = "Hello.", 9, 24
    engine = Engine.from_pretrained(tiny_model.parent / "ckpt", device="cpu")
    assert engine.synthesize(text, seed=seed, max_new_tokens=n).frames < n
    response = UrlTarget(forced_url).send({"text": text, "seed": seed, "max_new_tokens": n}, "application/json")
    doc = json.loads(response.body)
    audio, rate = sf.read(io.BytesIO(base64.b64decode(doc["audio"])))
    assert doc["frames"] == n and rate == 44100 and len(audio) == n * FRAME
    assert server_info(forced_url)[1]["benchmark_lengths"] is True


@pytest.mark.integration
def test_capacity_end_to_end_writes_the_curve(forced_url, tmp_path, tone, encode_audio):
    ref = tmp_path / "ref.wav"
    ref.write_bytes(encode_audio(tone(1.0, 16000), 16000, "WAV"))
    out = tmp_path / "report"
    # 200 characters a second: every text is 1 to 32 frames, so a level is a few seconds on a CPU.
    args = ["capacity", "--url", forced_url, "--streams", "2,1", "--duration", "1", "--chars-per-second", "200",
            "--slo-first-audio-ms", "30000", "--slo-underrun", "1", "--voice", "narrator",
            "--reference", str(ref), "--reference-text", "A tone.", "--reference-share", "0.3", "--whole-share", "0.3",
            "--price", "2.5", "--warmup", "1", "-o", str(out), "--output", "json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["passed"] and "samples" not in summary and summary["json"] == str(out / "bench.json")
    report = json.loads((out / "bench.json").read_text())
    assert report["kind"] == "capacity" and [lv["streams"] for lv in report["levels"]] == [1, 2]
    assert all(lv["passed"] and lv["ok"] == lv["requests"] for lv in report["levels"])
    assert report["lengths"].startswith("forced by the server's benchmark setting")
    figures = report["capacity"]
    assert figures["streams"] == 2 and figures["gpus"] == 1 and figures["streams_per_gpu"] == 2
    assert figures["usd_per_audio_hour"] == pytest.approx(2.5 / 2) and figures["price_source"] == "--price"
    samples = report["samples"]
    assert {s["mode"] for s in samples} <= {"stream", "whole"} and any(s["mode"] == "stream" for s in samples)
    for s in samples:  # forced lengths: each answer is exactly its intended frames
        frames = max(1, round(s["text_chars"] / 200 * 44100 / FRAME))
        assert s["audio_seconds"] == pytest.approx(frames * FRAME / 44100)
        if s["mode"] == "stream":
            assert 0 < s["first_audio_s"] <= s["latency_s"] and s["underrun_s"] >= 0
    for lv in report["levels"]:
        mine = [s for s in samples if s["streams"] == lv["streams"]]
        assert lv["audio_vs_intended"] == pytest.approx(sum(s["audio_seconds"] for s in mine)
                                                        / sum(s["text_chars"] / 200 for s in mine))
        assert lv["first_audio_ms"]["p50"] <= lv["first_audio_ms"]["p99"]
    page = (out / "bench.html").read_text()
    assert "Capacity curve" in page and page.count('src="data:image/png;base64,') == 3
    assert "http://" not in page.replace(forced_url, "") and "<script" not in page


@pytest.mark.integration
def test_failed_level_shows_as_failed_and_exits_with_one_line(forced_url, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["capacity", "--url", forced_url, "--streams", "1,2", "--duration", "0.5",
                                       "--chars-per-second", "400", "--slo-first-audio-ms", "1", "--warmup", "0",
                                       "-o", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: no level meets the SLO: 1 streams: first audio p99 ") and "> 1 ms" in last
    assert "stopping the ramp: 1 streams fail the SLO" in result.output and "FAIL" in result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["passed"] is False and [lv["passed"] for lv in report["levels"]] == [False]
    assert report["capacity"]["streams"] is None and "no price" in " ".join(report["notes"])
    page = (out / "bench.html").read_text()
    assert 'id="verdict">capacity: no level meets the SLO' in page and '<tr class="fail">' in page


def test_capacity_input_checks(tmp_path):
    runner = CliRunner()
    for args, expected in [
        (["capacity", "--url", "http://127.0.0.1:9", "--streams", "0"], "--streams levels must be at least 1"),
        (["capacity", "--url", "http://127.0.0.1:9", "--voice-share", "0.5"], "--voice-share needs --voice"),
        (["capacity", "--url", "http://127.0.0.1:9", "--reference", __file__], "--reference and --reference-text go"),
        (["capacity", "x", "--url", "http://127.0.0.1:9"], "give exactly one of NAME, --url, --local"),
    ]:
        result = runner.invoke(main, [*args, "-o", str(tmp_path / "r")])
        assert result.exit_code != 0 and "Traceback" not in result.output, (args, result.output)
        assert result.output.strip().splitlines()[-1].startswith("Error") and expected in result.output, result.output
    assert not (tmp_path / "r").exists()

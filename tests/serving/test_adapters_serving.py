"""LoRA adapters on the serving side (issue 37), without a server: the settings, the registry of
packaged adapters and of S3 sources (on moto's standalone server, through a real boto3 client whose
every call is recorded), the MMS handler path through sagemaker-inference's real Transformer, and
the metrics lines that carry an adapter or a bidirectional session."""

import hashlib
import importlib.util
import io
import json
from pathlib import Path

import boto3
import pytest
import soundfile as sf
from botocore.config import Config
from mms.context import Context, RequestProcessor

from test_emf_metrics import check_emf

from fish_sm.cloudwatch_metrics import REQUEST_METRICS
from fish_sm.contract import TTSRequest
from fish_sm.errors import AdapterError, CheckpointError, ConfigError
from fish_sm.model.config import ModelConfig
from fish_sm.model.lora import random_adapter, write_packaged
from fish_sm.serving import adapters as adapters_module
from fish_sm.serving.adapters import AdapterRegistry, S3Source
from fish_sm.serving.errors import Busy, HTTPError
from fish_sm.serving.metrics import (ADAPTER_ERROR_HEADER, ADAPTER_HEADER, ADAPTER_METRICS, SESSION_METRICS,
                                     STARTED_HEADER, WORKER_HEADERS, Metrics, RequestFigures, SessionFigures)
from fish_sm.serving.mms import handler
from fish_sm.serving.mms.handler_service import JSONErrorTransformer
from fish_sm.settings import Settings

BUCKET, OTHER = "adapters-ok", "not-a-source"


def _moto_helpers():
    """tests/aws/moto_helpers.py (the AWS tests' moto server, isolated from this machine's AWS settings)."""
    path = Path(__file__).parents[1] / "aws" / "moto_helpers.py"
    spec = importlib.util.spec_from_file_location("adapters_moto_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


moto_server = _moto_helpers().moto_server


# -- settings ----------------------------------------------------------------------------

def test_adapter_settings_parse_sizes_and_refuse_bad_sources_in_one_line():
    s = Settings.from_env({"FISH_SM_ADAPTER_SOURCES": "s3://a-bucket/team/voices/, s3://b.bucket/",
                           "FISH_SM_ADAPTER_MEMORY": "512MiB", "FISH_SM_ADAPTER_RANK": "16",
                           "FISH_SM_ADAPTER_REFRESH_S": "5"})
    assert s.adapter_sources == ("s3://a-bucket/team/voices/", "s3://b.bucket/")
    assert (s.adapter_memory, s.adapter_rank, s.adapter_refresh_s) == (512 << 20, 16, 5.0)
    assert Settings().adapter_memory == 2 << 30 and Settings().adapter_refresh_s == 60
    for raw, size in (("2GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("4096", 4096)):
        assert Settings.from_env({"FISH_SM_ADAPTER_MEMORY": raw}).adapter_memory == size
    for env, message in [
        ({"FISH_SM_ADAPTER_SOURCES": "s3://a-bucket/no-slash"}, "is not an s3://bucket/prefix/ URI"),
        ({"FISH_SM_ADAPTER_SOURCES": "https://a-bucket/p/"}, "is not an s3://bucket/prefix/ URI"),
        ({"FISH_SM_ADAPTER_SOURCES": "s3://a-bucket/p/../q/"}, "is not an s3://bucket/prefix/ URI"),
        ({"FISH_SM_ADAPTER_SOURCES": "s3://Upper/p/"}, "is not an s3://bucket/prefix/ URI"),
        ({"FISH_SM_ADAPTER_MEMORY": "lots"}, "is not a valid size"),
        ({"FISH_SM_ADAPTER_MEMORY": "0"}, "ADAPTER_MEMORY must be positive"),
        ({"FISH_SM_ADAPTER_RANK": "512"}, "ranks up to 256"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            Settings.from_env(env)
        assert "\n" not in str(info.value)


# -- the packaged adapters ------------------------------------------------------------------

@pytest.fixture(scope="module")
def config(adapter_package):
    return ModelConfig.from_file(adapter_package / "config.json")


def test_packaged_adapters_voices_imply_theirs_and_unknown_names_are_400(adapter_package, config):
    registry = AdapterRegistry.from_package(adapter_package, config, Settings())
    assert registry.enabled and registry.names() == ["kiri", "yasuo", "zz-broken"]
    assert registry.rank() == 8 and registry.rank(32) == 32
    yasuo = registry.load("yasuo")
    assert (yasuo.name, yasuo.rank, yasuo.alpha) == ("yasuo", 8, 16.0)
    assert registry.resolve(TTSRequest(text="x", voice="yasuo")).adapter == "yasuo"
    assert registry.resolve(TTSRequest(text="x", voice="yasuo", adapter="kiri")).adapter == "kiri"  # explicit wins
    assert registry.resolve(TTSRequest(text="x")).adapter is None
    assert registry.resolve(TTSRequest(text="x"), default_voice="yasuo").adapter == "yasuo"
    for name in ("nobody", "../yasuo", "yasuo.safetensors/..", "s3://adapters-ok/yasuo", "yasuo\n"):
        with pytest.raises(HTTPError) as info:
            registry.resolve(TTSRequest(text="x", adapter=name))
        assert info.value.status == 400 and "unknown adapter" in info.value.message
        assert "known adapters: kiri, yasuo, zz-broken" in info.value.message
    with pytest.raises(AdapterError) as info:  # listed and verified, but not shaped for the model
        registry.load("zz-broken")
    assert "packaged adapter zz-broken" in str(info.value) and str(adapter_package) not in str(info.value)
    # A plain checkpoint directory has no packaged adapters; without sources, nothing is enabled.
    assert not AdapterRegistry.from_package(adapter_package / "voices", config, Settings()).enabled


@pytest.mark.parametrize("entry", [
    {"file": "../model.pth", "rank": 8},
    {"file": "adapters/other.safetensors", "rank": 8},
    "adapters/yasuo.safetensors",
])
def test_a_manifest_entry_cannot_point_a_read_elsewhere(adapter_package, config, tmp_path, entry):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "yasuo.safetensors").write_bytes((adapter_package / "adapters" / "yasuo.safetensors").read_bytes())
    (tmp_path / "manifest.json").write_text(json.dumps({"adapters": {"yasuo": entry}}))
    with pytest.raises(CheckpointError, match="must be a valid name whose file is adapters/<name>.safetensors"):
        AdapterRegistry.from_package(tmp_path, config, Settings())


# -- S3 sources ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        s3 = client(url)
        for bucket in (BUCKET, OTHER):
            s3.create_bucket(Bucket=bucket)
        yield url


def client(url):
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))


class Recorded:
    """A real boto3 client whose every call's operation and bucket is recorded (botocore's own event hook)."""

    def __init__(self, url):
        self.client = client(url)
        self.calls = []
        self.client.meta.events.register("provide-client-params.s3.*", self._record)

    def _record(self, params, model, **_):
        self.calls.append((model.name, params.get("Bucket"), params.get("Key") or params.get("Prefix")))

    def buckets(self):
        return {bucket for _, bucket, _ in self.calls}


def put_adapter(s3, bucket, key, data: bytes, sha256: str | None = None):
    meta = {"sha256": sha256 or hashlib.sha256(data).hexdigest()}
    s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata=meta)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def adapter_bytes(config, tmp_path_factory):
    path = tmp_path_factory.mktemp("s3-adapter") / "a.safetensors"
    write_packaged(random_adapter(config, "s3voice", rank=4, seed=5), path)
    return path.read_bytes()


def test_s3_adapters_are_found_verified_forgotten_when_removed_and_never_read_elsewhere(
        moto_url, config, adapter_bytes, tmp_path, monkeypatch):
    s3 = client(moto_url)
    put_adapter(s3, BUCKET, "team/s3voice.safetensors", adapter_bytes)
    put_adapter(s3, BUCKET, "team/tampered.safetensors", adapter_bytes, sha256="0" * 64)
    s3.put_object(Bucket=BUCKET, Key="team/unsigned.safetensors", Body=adapter_bytes)  # no sha256 metadata
    put_adapter(s3, BUCKET, "team/garbage.safetensors", b"\x80\x04not an adapter")
    put_adapter(s3, OTHER, "team/rogue.safetensors", adapter_bytes)
    put_adapter(s3, BUCKET, "rogue.safetensors", adapter_bytes)  # outside the source's prefix
    monkeypatch.setattr(adapters_module.tempfile, "tempdir", str(tmp_path))  # downloads land here, and go
    recorded, clock = Recorded(moto_url), Clock()
    registry = AdapterRegistry(config, {}, [S3Source.parse(f"s3://{BUCKET}/team/")], refresh_s=10,
                               s3=recorded.client, clock=clock)
    changed = []
    registry.on_change = changed.append
    assert registry.enabled and registry.known("s3voice")
    adapter = registry.load("s3voice")
    assert (adapter.name, adapter.rank) == ("s3voice", 4)
    assert list(tmp_path.iterdir()) == []  # the download is gone once read
    for name, message in (("tampered", "does not match its sha256 metadata"), ("unsigned", "has no sha256 metadata"),
                          ("garbage", f"s3://{BUCKET}/team/garbage.safetensors: is a torch pickle")):
        assert registry.known(name)
        with pytest.raises(AdapterError, match=message):
            registry.load(name)
    assert list(tmp_path.iterdir()) == []
    # A name S3 has not got, and hostile names, which are never turned into a key at all.
    before = len(recorded.calls)
    for name in ("rogue", "../rogue", "s3://not-a-source/team/rogue", "team/rogue", ".."):
        assert not registry.known(name)
    assert recorded.calls[before:] == [("HeadObject", BUCKET, "team/rogue.safetensors")]
    assert not registry.known("rogue") and len(recorded.calls) == before + 1  # remembered for a few seconds
    assert "s3voice" in registry.names() and "rogue" not in registry.names()
    assert recorded.buckets() == {BUCKET}  # the bucket outside the allow-list was never touched
    # Replaced at its source: once the refresh interval has passed, the engine is told to read it afresh.
    put_adapter(s3, BUCKET, "team/s3voice.safetensors", adapter_bytes + b" ")
    clock.now += 11
    assert registry.known("s3voice") and changed == ["s3voice"]
    # Removed from its source: known until the refresh interval has passed, then unknown again.
    s3.delete_object(Bucket=BUCKET, Key="team/s3voice.safetensors")
    clock.now += 5
    assert registry.known("s3voice")
    clock.now += 6
    assert not registry.known("s3voice") and changed == ["s3voice", "s3voice"]
    with pytest.raises(HTTPError, match="unknown adapter 's3voice'"):
        registry.resolve(TTSRequest(text="x", adapter="s3voice"))


def test_lookups_of_unknown_names_are_rate_limited(moto_url, config):
    recorded, clock = Recorded(moto_url), Clock()
    registry = AdapterRegistry(config, {}, [S3Source.parse(f"s3://{BUCKET}/flood/")], s3=recorded.client, clock=clock)
    for i in range(adapters_module.LOOKUP_BURST):
        assert not registry.known(f"bogus-{i}")
    with pytest.raises(Busy) as info:
        registry.known("one-more")
    assert info.value.status == 503 and info.value.retry_after_s == 1
    assert len(recorded.calls) == adapters_module.LOOKUP_BURST
    clock.now += 1  # tokens come back at LOOKUPS_PER_S
    assert not registry.known("one-more")
    assert len(recorded.calls) == adapters_module.LOOKUP_BURST + 1


# -- the MMS handler's path ------------------------------------------------------------------

class Handlers:
    default_model_fn = staticmethod(handler.model_fn)
    default_input_fn = staticmethod(handler.input_fn)
    default_predict_fn = staticmethod(handler.predict_fn)
    default_output_fn = staticmethod(handler.output_fn)


@pytest.fixture(scope="module")
def worker_context(adapter_package):
    """One context for the worker's life, as MMS's service keeps it (each request gets a new request processor)."""
    return Context("model", str(adapter_package), None, 1, None, "1.1.11")


@pytest.fixture(scope="module")
def transformer(adapter_package, tmp_path_factory, worker_context):
    mp = pytest.MonkeyPatch()
    for key, value in {"FISH_SM_WARMUP": "1", "FISH_SM_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
                       "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "*/*", "SAGEMAKER_PROGRAM": "fish_sm_no_user_module",
                       "FISH_SM_ADAPTER_MEMORY": "64MiB"}.items():
        mp.setenv(key, value)
    t = JSONErrorTransformer(default_inference_handler=Handlers())  # our container's, errors as JSON
    worker_context.request_processor = [RequestProcessor({})]
    t.validate_and_initialize(model_dir=str(adapter_package), context=worker_context)
    yield t
    mp.undo()


def invoke(transformer, ctx, body):
    ctx.request_processor = [RequestProcessor({"Content-Type": "application/json", "Accept": "application/json"})]
    out = transformer.transform([{"body": json.dumps(body).encode()}], ctx)
    status = ctx.get_response_status(0)[0] if ctx.get_response_status(0) else 200
    return status, json.loads(out[0]), ctx.request_processor[0].get_response_headers().get(ADAPTER_HEADER)


def test_the_handler_applies_adapters_and_says_which_in_a_header(transformer, worker_context):
    model = transformer._model
    stats = model.engine.adapter_stats()
    assert stats["rank"] == 8 and stats["resident"] == ["kiri"]  # the warm-up's packaged adapter stays
    base = {"text": "Hello there.", "max_new_tokens": 8, "seed": 3}
    status, plain, header = invoke(transformer, worker_context, base)
    assert status == 200 and header is None
    status, tuned, header = invoke(transformer, worker_context, {**base, "adapter": "yasuo"})
    assert status == 200 and header == "yasuo" and tuned["audio"] != plain["audio"]
    status, implied, header = invoke(transformer, worker_context, {**base, "voice": "yasuo"})
    assert status == 200 and header == "yasuo"
    status, explicit, _ = invoke(transformer, worker_context, {**base, "voice": "yasuo", "adapter": "yasuo"})
    assert explicit["audio"] == implied["audio"]
    status, doc, header = invoke(transformer, worker_context, {**base, "adapter": "nobody"})
    assert status == 400 and "unknown adapter 'nobody'" in doc["error"] and header is None
    status, doc, header = invoke(transformer, worker_context, {**base, "adapter": "zz-broken"})
    assert status == 422 and "zz-broken" in doc["error"] and header == "zz-broken"
    assert worker_context.request_processor[0].get_response_headers().get(ADAPTER_ERROR_HEADER) == "1"
    status, doc, _ = invoke(transformer, worker_context, {**base, "adapter": "kiri"})
    assert status == 200 and len(sf.read(io.BytesIO(__import__("base64").b64decode(doc["audio"])))[0])


# -- metrics --------------------------------------------------------------------------------

def test_metric_lines_carry_a_known_adapter_and_sessions_have_their_own():
    written = []
    metrics = Metrics("batching", env={"SAGEMAKER_ENDPOINT_NAME": "tts"}, write=written.append)
    figures = RequestFigures(status=200, stream=True, first_audio_ms=40.0, latency_ms=90.0, adapter="yasuo")
    figures.add_synthesis(20, 0.93, 0.5)
    metrics.request(figures)
    metrics.request(RequestFigures(status=400, latency_ms=2.0))  # an unknown adapter is no dimension
    session = SessionFigures(adapter="kiri", sentences_spoken=3, first_audio_ms=120.5)
    metrics.session(session, "done")
    metrics.session(SessionFigures(rejected=True, status=503), "refused")
    tuned, plain, spoken, refused = map(json.loads, written)
    base, per_adapter = tuned["_aws"]["CloudWatchMetrics"]
    assert base["Dimensions"] == [["EndpointName", "Server"]]
    assert [m["Name"] for m in base["Metrics"]] == ["Requests", "Rejected", "Errors", "AdapterErrors", "Latency",
                                                   "FirstAudio", "RealTimeFactor", "Frames", "AudioSeconds"]
    assert tuned["AdapterErrors"] == 0
    assert per_adapter["Dimensions"] == [["EndpointName", "Server", "Adapter"]] and tuned["Adapter"] == "yasuo"
    assert [m["Name"] for m in per_adapter["Metrics"]] == [n for n in ADAPTER_METRICS if n in tuned]
    assert check_emf(plain, REQUEST_METRICS)["Errors"] == 0 and "Adapter" not in plain
    assert spoken["Adapter"] == "kiri" and spoken["Outcome"] == "done"
    values = {m["Name"]: spoken[m["Name"]] for m in spoken["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert {k: values[k] for k in ("Sessions", "SentencesSpoken", "SessionFirstAudio", "SessionsCancelled")} == {
        "Sessions": 1, "SentencesSpoken": 3, "SessionFirstAudio": 120.5, "SessionsCancelled": 0}
    assert set(values) <= set(SESSION_METRICS) and values["SessionSeconds"] >= 0
    assert (refused["SessionsRejected"], refused["SessionErrors"], refused["StatusCode"]) == (1, 0, 503)
    assert "Adapter" not in refused
    # The mms worker's header: a name becomes the dimension, anything else is dropped; the client never sees it.
    assert ADAPTER_HEADER.lower() in WORKER_HEADERS
    for value, adapter in (("yasuo", "yasuo"), ("../x", None), ("a" * 80, None)):
        figures = RequestFigures()
        assert figures.add_worker_answer({STARTED_HEADER: "1.0", ADAPTER_HEADER: value}, 1.0)
        assert figures.adapter == adapter
    # A request (or session) its adapter failed: AdapterErrors 1, per adapter too; from the mms
    # worker, its header says so.
    assert ADAPTER_ERROR_HEADER.lower() in WORKER_HEADERS
    failed = RequestFigures()
    assert failed.add_worker_answer({STARTED_HEADER: "1.0", ADAPTER_HEADER: "yasuo", ADAPTER_ERROR_HEADER: "1"}, 1.0)
    failed.status = 422
    metrics.request(failed)
    metrics.session(SessionFigures(adapter="kiri", status=422, adapter_failed=True), "failed")
    for line in map(json.loads, written[-2:]):
        assert line["AdapterErrors"] == 1 and line["Errors" if "Errors" in line else "SessionErrors"] == 0
        assert "AdapterErrors" in [m["Name"] for m in line["_aws"]["CloudWatchMetrics"][1]["Metrics"]]

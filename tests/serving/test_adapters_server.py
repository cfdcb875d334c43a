"""LoRA adapters (issue 37) through `fish-sm serve --server batching` for real on loopback: a package
with two adapters (and one that does not fit the model), an S3 source on moto's standalone server,
requests by adapter and by voice, unknown and broken adapters, an adapter removed from its source,
the bidirectional stream, and the metrics lines each writes (CPU, tiny package)."""

import asyncio
import base64
import hashlib
import io
import json
import time

import aiohttp
import boto3
import numpy as np
import pytest
import soundfile as sf
from botocore.config import Config

from server_helpers import QUICK_ENV, Server, free_port, request, serve_cmd
from test_adapters_serving import moto_server
from test_emf_metrics import emf_lines

from fish_sm.model.config import ModelConfig
from fish_sm.model.lora import random_adapter, write_packaged

pytestmark = pytest.mark.integration

BUCKET, OTHER, PREFIX = "adapters-ok", "not-a-source", "team/"
BASE = {"text": "Hello there, fine tuned.", "max_new_tokens": 10, "seed": 11}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}))
        for bucket in (BUCKET, OTHER):
            s3.create_bucket(Bucket=bucket)
        yield url, s3


@pytest.fixture(scope="module")
def s3_adapter(adapter_package, tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("s3-adapter") / "a.safetensors"
    config = ModelConfig.from_file(adapter_package / "config.json")
    write_packaged(random_adapter(config, "s3voice", rank=8, seed=9, scale=0.2), path)
    return path.read_bytes()


def put(s3, key: str, data: bytes, bucket: str = BUCKET, sha256: str | None = None) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata={"sha256": sha256 or hashlib.sha256(data).hexdigest()})


@pytest.fixture(scope="module")
def server(adapter_package, s3_server, s3_adapter, tmp_path_factory):
    url, s3 = s3_server
    put(s3, PREFIX + "s3voice.safetensors", s3_adapter)
    put(s3, PREFIX + "tampered.safetensors", s3_adapter, sha256="f" * 64)
    put(s3, PREFIX + "rogue.safetensors", s3_adapter, bucket=OTHER)  # a bucket the server may not read
    tmp = tmp_path_factory.mktemp("adapters-server")
    port = free_port()
    s = Server(serve_cmd(adapter_package, port, "batching"), port,
               {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp / "cache"), "FISH_SM_MAX_BATCH": "8",
                "FISH_SM_MAX_NEW_TOKENS": "64", "FISH_SM_ADAPTER_SOURCES": f"s3://{BUCKET}/{PREFIX}",
                "FISH_SM_ADAPTER_REFRESH_S": "1", "FISH_SM_ADAPTER_MEMORY": "64MiB",
                "SAGEMAKER_ENDPOINT_NAME": "tts-lora", "AWS_ENDPOINT_URL": url}, tmp / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def invoke(server, body):
    status, _, out = request(server.url + "/invocations", body, accept="application/json")
    return status, json.loads(out)


def samples(doc) -> np.ndarray:
    return sf.read(io.BytesIO(base64.b64decode(doc["audio"])), dtype="int16")[0].astype(np.int32)


def same(a, b) -> bool:
    """The same codes: the same audio up to a 16-bit step (pieces decoded in another batch round differently)."""
    x, y = samples(a), samples(b)
    return len(x) == len(y) and (len(x) == 0 or np.abs(x - y).max() <= 1)


def lines_for(server, before: int, count: int) -> list[dict]:
    """The `count` request lines written since there were `before` (a line follows its answer)."""
    deadline = time.monotonic() + 10
    while True:
        new = [d for d in emf_lines(server.log.read_text()) if "Requests" in d][before:]
        if len(new) >= count or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def request_lines(server) -> int:
    return len([d for d in emf_lines(server.log.read_text()) if "Requests" in d])


def test_adapters_by_name_and_by_voice_change_the_codes_and_unknown_ones_are_400(server):
    assert "adapters: 3 packaged, sources s3://adapters-ok/team/" in server.log.read_text()
    before = request_lines(server)
    status, plain = invoke(server, BASE)
    assert status == 200
    status, tuned = invoke(server, {**BASE, "adapter": "yasuo"})
    assert status == 200 and not same(tuned, plain)
    status, again = invoke(server, {**BASE, "adapter": "yasuo"})
    assert same(again, tuned)
    # A packaged voice implies its adapter; an explicit one wins over the voice's.
    status, by_voice = invoke(server, {**BASE, "voice": "yasuo"})
    status2, both = invoke(server, {**BASE, "voice": "yasuo", "adapter": "yasuo"})
    status3, other = invoke(server, {**BASE, "voice": "yasuo", "adapter": "kiri"})
    assert status == status2 == status3 == 200 and same(by_voice, both) and not same(other, by_voice)
    status, doc = invoke(server, {**BASE, "adapter": "nobody"})
    assert status == 400 and doc["error"].startswith("unknown adapter 'nobody'; known adapters: kiri, yasuo, zz-broken")
    assert "s3voice" in doc["error"]  # the source's, as listed
    status, doc = invoke(server, {**BASE, "adapter": "../yasuo"})
    assert status == 400 and "adapter name" in doc["error"]
    lines = lines_for(server, before, 8)
    assert [(d["StatusCode"], d.get("Adapter")) for d in lines] == [
        (200, None), (200, "yasuo"), (200, "yasuo"), (200, "yasuo"), (200, "yasuo"), (200, "kiri"), (400, None), (400, None)]
    directives = lines[1]["_aws"]["CloudWatchMetrics"]
    assert [d["Dimensions"] for d in directives] == [[["EndpointName", "Server"]], [["EndpointName", "Server", "Adapter"]]]
    assert len(lines[0]["_aws"]["CloudWatchMetrics"]) == 1


def test_a_broken_adapter_is_422_and_other_requests_carry_on(server):
    before = request_lines(server)
    for name, message in (("zz-broken", "packaged adapter zz-broken"),
                          ("tampered", "s3://adapters-ok/team/tampered.safetensors does not match its sha256")):
        status, doc = invoke(server, {**BASE, "adapter": name})
        assert status == 422 and message in doc["error"]
        status, doc = invoke(server, {**BASE, "adapter": "kiri"})
        assert status == 200 and doc["frames"] > 0
    status, doc = invoke(server, {**BASE, "adapter": "zz-broken"})  # tried again: still 422, never a dead engine
    assert status == 422
    status, _, _ = request(server.url + "/ping")
    assert status == 200
    lines = lines_for(server, before, 5)
    # An adapter that cannot be read is no 5xx, but an adapter error (deploy's alarm watches those).
    assert [(d["StatusCode"], d.get("Adapter"), d["Errors"], d["AdapterErrors"]) for d in lines] == [
        (422, "zz-broken", 0, 1), (200, "kiri", 0, 0), (422, "tampered", 0, 1), (200, "kiri", 0, 0),
        (422, "zz-broken", 0, 1)]


def test_an_s3_adapter_is_served_and_unknown_again_once_removed_from_its_source(server, s3_server, s3_adapter):
    _, s3 = s3_server
    status, plain = invoke(server, BASE)
    status, tuned = invoke(server, {**BASE, "adapter": "s3voice"})
    assert status == 200 and not same(tuned, plain)
    # A bucket outside FISH_SM_ADAPTER_SOURCES holds "rogue": the server only ever looks in its source.
    status, doc = invoke(server, {**BASE, "adapter": "rogue"})
    assert status == 400 and "unknown adapter 'rogue'" in doc["error"]
    s3.delete_object(Bucket=BUCKET, Key=PREFIX + "s3voice.safetensors")
    deadline = time.monotonic() + 30  # FISH_SM_ADAPTER_REFRESH_S=1
    while True:
        status, doc = invoke(server, {**BASE, "adapter": "s3voice", "max_new_tokens": 2})
        if status != 200 or time.monotonic() > deadline:
            break
    assert status == 400 and "unknown adapter 's3voice'" in doc["error"]
    put(s3, PREFIX + "s3voice.safetensors", s3_adapter)  # `fish-sm adapters add` again: known after a few seconds
    deadline = time.monotonic() + 30
    while True:
        status, again = invoke(server, {**BASE, "adapter": "s3voice"})
        if status == 200 or time.monotonic() > deadline:
            break
    assert status == 200 and same(again, tuned)


async def bidi(server, first: dict, text: str | None) -> list:
    """A session: the first message, then `text` and the end; what came back, as ("json", doc) or ("binary", n)."""
    got = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server.url.replace("http://", "ws://") + "/invocations-bidirectional-stream") as ws:
            await ws.send_str(json.dumps(first))
            if text is not None:
                await ws.send_str(text)
                await ws.send_str(json.dumps({"end": True}))
            async for msg in ws:
                got.append(("json", json.loads(msg.data)) if msg.type == aiohttp.WSMsgType.TEXT else ("binary", len(msg.data)))
    return got


def session_lines(server) -> list[dict]:
    return [d for d in emf_lines(server.log.read_text()) if "Sessions" in d]


def test_a_bidirectional_session_speaks_with_its_voices_adapter_and_writes_its_line(server):
    before = len(session_lines(server))
    got = asyncio.run(bidi(server, {"voice": "yasuo", "seed": 3, "max_new_tokens": 8}, "One sentence. And another."))
    done = [doc["done"] for kind, doc in got if kind == "json" and "done" in doc]
    assert done and done[0]["sentences"] == 2 and any(kind == "binary" for kind, _ in got)
    got = asyncio.run(bidi(server, {"adapter": "nobody"}, None))
    assert got == [("json", {"error": got[0][1]["error"], "status": 400})] and "unknown adapter 'nobody'" in got[0][1]["error"]
    got = asyncio.run(bidi(server, {"adapter": "zz-broken", "max_new_tokens": 8}, "Hello."))
    errors = [doc for kind, doc in got if kind == "json" and "error" in doc]
    assert [e["status"] for e in errors] == [422] and "zz-broken" in errors[0]["error"]
    assert not any(kind == "binary" for kind, _ in got)
    deadline = time.monotonic() + 10
    while len(session_lines(server)) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    spoken, refused, failed = session_lines(server)[before:]
    assert (failed["Adapter"], failed["Outcome"], failed["StatusCode"], failed["SentencesSpoken"],
            failed["AdapterErrors"]) == ("zz-broken", "failed", 422, 0, 1)
    assert spoken["AdapterErrors"] == 0
    assert (spoken["Adapter"], spoken["Outcome"], spoken["SentencesSpoken"], spoken["Sessions"]) == ("yasuo", "done", 2, 1)
    assert spoken["SessionFirstAudio"] > 0 and spoken["SessionSeconds"] > 0 and spoken["EndpointName"] == "tts-lora"
    assert (refused["Outcome"], refused["StatusCode"], refused["SessionErrors"]) == ("refused", 400, 0)
    assert "Adapter" not in refused and "SessionFirstAudio" not in refused

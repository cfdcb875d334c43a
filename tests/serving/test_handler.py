"""The handler module driven by sagemaker-inference's real Transformer, in this process."""

import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
from mms.context import Context, RequestProcessor
from sagemaker_inference.transformer import Transformer

from fish_sm.serving.mms import handler
from fish_sm.serving.mms.errors import install_json_errors


class Handlers:
    """What the Transformer would find in code/inference.py."""

    default_model_fn = staticmethod(handler.model_fn)
    default_input_fn = staticmethod(handler.input_fn)
    default_predict_fn = staticmethod(handler.predict_fn)
    default_output_fn = staticmethod(handler.output_fn)


@pytest.fixture(scope="module")
def transformer(package_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FISH_SM_WARMUP", "1")
    mp.setenv("FISH_SM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT", "*/*")
    mp.setenv("SAGEMAKER_PROGRAM", "fish_sm_no_user_module")
    t = Transformer(default_inference_handler=Handlers())
    t.validate_and_initialize(model_dir=str(package_dir), context=context(package_dir, {}))
    yield t
    mp.undo()


def context(model_dir, headers):
    ctx = Context("model", str(model_dir), None, 1, None, "1.1.11")
    ctx.request_processor = [RequestProcessor(headers)]
    return ctx


def invoke(transformer, package_dir, body, content_type="application/json", accept=None):
    headers = {"Content-Type": content_type, **({"Accept": accept} if accept else {})}
    ctx = context(package_dir, headers)
    data = [{"body": body if isinstance(body, bytes) else json.dumps(body).encode()}]
    out = transformer.transform(data, ctx)
    status = ctx.get_response_status(0)[0] if ctx.get_response_status(0) else 200
    return status, out[0], ctx.get_response_content_type(0)


def test_model_fn_loads_the_package(transformer):
    model = transformer._model
    assert set(model.voices) == {"narrator"}
    assert {"load", "voices", "warmup"} <= set(model.timings)
    assert model.engine.device.type == "cpu" and not model.engine.compiled and not model.engine.quantized


def test_wav_by_default_with_the_packaged_voice(transformer, package_dir):
    status, body, ctype = invoke(transformer, package_dir, {"text": "Hello.", "voice": "narrator", "max_new_tokens": 6, "seed": 1})
    audio, rate = sf.read(io.BytesIO(body))
    assert status == 200 and ctype == "audio/wav" and rate == 44100 and len(audio) == 6 * 2048


@pytest.mark.parametrize("accept, fmt", [("audio/flac", "FLAC"), ("audio/ogg", "OGG"), ("audio/mpeg", "MP3")])
def test_each_audio_format(transformer, package_dir, accept, fmt):
    status, body, ctype = invoke(transformer, package_dir, {"text": "Format test.", "max_new_tokens": 4, "seed": 0}, accept=accept)
    assert status == 200 and ctype == accept
    info = sf.info(io.BytesIO(body))
    assert info.format == fmt and info.samplerate == 44100


def test_json_response_with_resampling(transformer, package_dir):
    status, body, ctype = invoke(transformer, package_dir,
                                 {"text": "JSON please.", "max_new_tokens": 5, "format": "flac", "sample_rate": 16000,
                                  "seed": 1},  # seeded: random weights stop early for ~1 in 150 unseeded requests
                                 accept="application/json")
    doc = json.loads(body)
    assert status == 200 and ctype == "application/json"
    assert doc["format"] == "flac" and doc["sample_rate"] == 16000 and doc["frames"] == 5
    assert doc["seconds"] == pytest.approx(5 * 2048 / 44100, abs=1e-3) and doc["rtf"] > 0 and "generate" in doc["timings"]
    audio, rate = sf.read(io.BytesIO(base64.b64decode(doc["audio"])))
    assert rate == 16000 and len(audio) == int(np.ceil(5 * 2048 * 16000 / 44100))


def test_jsonlines_batch(transformer, package_dir):
    lines = "\n".join(json.dumps({"text": f"Line {i}.", "max_new_tokens": 3 + i, "seed": i}) for i in range(3)).encode()
    status, body, ctype = invoke(transformer, package_dir, lines, "application/jsonlines", accept="application/jsonlines")
    assert status == 200, body
    docs = [json.loads(line) for line in body.decode().splitlines()]
    assert status == 200 and ctype == "application/jsonlines" and [d["frames"] for d in docs] == [3, 4, 5]


def test_zero_shot_reference(transformer, package_dir, tone, encode_audio):
    ref = base64.b64encode(encode_audio(tone(1.0, 16000), 16000, "WAV")).decode()
    status, body, _ = invoke(transformer, package_dir,
                             {"text": "Clone me.", "reference": {"audio": ref, "text": "A reference."}, "max_new_tokens": 4,
                              "seed": 2})
    assert status == 200 and len(sf.read(io.BytesIO(body))[0]) == 4 * 2048


@pytest.mark.parametrize("body, status, message", [
    ({"text": "x", "voice": "nobody"}, 400, "unknown voice 'nobody'; packaged voices: narrator"),
    ({"text": "x", "reference": {"audio": base64.b64encode(b"garbage bytes").decode(), "text": "t"}}, 422, "cannot be decoded"),
    ({"text": "x", "temperature": 9}, 400, "temperature"),
])
def test_errors_are_json_without_traceback(transformer, package_dir, body, status, message):
    install_json_errors()
    got, out, ctype = invoke(transformer, package_dir, body)
    assert got == status and ctype == "application/json"
    assert message in json.loads(out)["error"] and b"Traceback" not in out


def test_silent_reference_is_422(transformer, package_dir, encode_audio):
    install_json_errors()
    silent = base64.b64encode(encode_audio(np.zeros((16000, 1), np.float32), 16000, "WAV")).decode()
    status, out, _ = invoke(transformer, package_dir, {"text": "x", "reference": {"audio": silent, "text": "t"}})
    assert status == 422 and "silent" in json.loads(out)["error"]


def test_the_handler_speaks_through_the_one_engine_with_a_batched_request_s_codes(transformer, package_dir):
    """`predict_fn` runs the engine's one-slot batching engine (the same engine as the batching
    server's cores): a request through the handler has the codes and audio it has batched among
    others on an engine of several slots (CPU, float32)."""
    from fish_sm.contract import SamplingParams
    from fish_sm.engine import Engine
    from fish_sm.engine.batching import BatchEngine, Job

    model = transformer._model
    assert model.engine.batching().slots == 1
    body = {"text": "One engine for every path.", "voice": "narrator", "max_new_tokens": 9, "seed": 3,
            "temperature": 0.7}
    prediction = handler.predict_fn(handler.input_fn(json.dumps(body), "application/json"), model)
    (alone,) = prediction.results
    engine = Engine.from_pretrained(package_dir, device="cpu")
    params = SamplingParams(seed=3, max_new_tokens=9, temperature=0.7)
    voice = model.voices["narrator"]
    with BatchEngine(engine, max_batch=4) as batcher:
        others = [batcher.submit(Job(f"Another request, number {i}.", params=SamplingParams(seed=i, max_new_tokens=12)))
                  for i in range(2)]
        batched = batcher.submit(Job(body["text"], references=(voice,), params=params)).result()
        for ticket in others:
            ticket.result()
    assert alone.frames == batched.frames == 9
    assert np.array_equal(alone.codes.numpy(), batched.codes.numpy())
    np.testing.assert_allclose(alone.audio, batched.audio, atol=1e-5)

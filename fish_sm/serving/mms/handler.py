"""The SageMaker inference contract: `model_fn`, `input_fn`, `predict_fn`, `output_fn`.

The signatures are the ones sagemaker-inference's `Transformer` calls (context last and
optional), so the same module runs in our container and in the stock PyTorch inference
container. Each is a thin layer over `fish_sm.serving.runtime`: `model_fn` does all the slow
work — load, quantize, compile, warm up — so that the server reports healthy only when the
first request will be fast; errors leave as the toolkit's type, with their status.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fish_sm.contract import TTSRequest
from fish_sm.serving import runtime
from fish_sm.serving.adapters import adapter_label
from fish_sm.serving.errors import AdapterFailed, bad_request
from fish_sm.serving.metrics import ADAPTER_ERROR_HEADER, ADAPTER_HEADER, AUDIO_HEADER, audio_header
from fish_sm.serving.mms.errors import toolkit_errors
from fish_sm.serving.request import JSONLINES_ALIASES, media_type, parse_body
from fish_sm.serving.response import Prediction, encode_prediction
from fish_sm.serving.runtime import ServingModel
from fish_sm.settings import Settings


@dataclass
class Batch:
    requests: list[TTSRequest]
    jsonlines: bool


def worker_device(context) -> str:
    """The device MMS gave this worker: its GPU, or the CPU on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    props = getattr(context, "system_properties", None) or {}
    gpu = props.get("gpu_id")
    return f"cuda:{int(gpu) if gpu is not None else 0}"


_settings: Settings | None = None  # read and validated once, by model_fn


def model_fn(model_dir, context=None) -> ServingModel:
    """Load the package in `model_dir` on this worker's GPU (or the CPU) and make it ready."""
    global _settings
    settings = _settings = Settings.from_env()
    return runtime.start_model(Path(model_dir), worker_device(context), settings)


def input_fn(input_data, content_type, context=None) -> Batch:
    """Parse and validate the body; nothing reaches the GPU unless the whole request is valid."""
    with toolkit_errors():
        requests = parse_body(input_data, content_type, _settings or Settings.from_env())
        if any(r.stream for r in requests):
            raise bad_request("streaming is answered by the batching server (fish-sm serve --server batching, "
                              "the default in the fish-sm container); this server returns whole responses")
        return Batch(requests, jsonlines=media_type(content_type) in JSONLINES_ALIASES)


def predict_fn(data: Batch, model: ServingModel, context=None) -> Prediction:
    """Synthesize every request; in JSON Lines, a line without audio answers with its own error.
    The adapter the requests use goes in a response header first, so that the gate's metrics line
    counts the answer under it, an adapter's failure too (and that it was the adapter's, in another)."""
    headers = hasattr(context, "set_response_header")
    with toolkit_errors():
        requests = runtime.resolve_adapters(model, data.requests)
        adapter = adapter_label(requests)
        if adapter is not None and headers:
            context.set_response_header(0, ADAPTER_HEADER, adapter)
        try:
            return runtime.predict(model, requests, data.jsonlines)
        except AdapterFailed:
            if headers:
                context.set_response_header(0, ADAPTER_ERROR_HEADER, "1")
            raise


def output_fn(prediction: Prediction, accept, context=None) -> tuple[bytes, str]:
    """Encode the result for the Accept header; JSON Lines in, JSON Lines out. The audio's figures
    go in a response header, from which the mms server's gate writes the request's metrics line."""
    with toolkit_errors():
        encoded = encode_prediction(prediction, accept)
    figures = audio_header(prediction.results)
    if figures is not None and hasattr(context, "set_response_header"):
        context.set_response_header(0, AUDIO_HEADER, figures)
    return encoded

"""A response body from synthesized audio: the format an Accept header and the request ask for,
JSON Lines for JSON Lines. No torch: both servers encode with it (the batching server in its
front end), from results that carry `audio`, `sample_rate`, `seconds`, `frames`, `rtf`, `timings`."""

from __future__ import annotations

from dataclasses import dataclass

from fish_sm.contract import TTSRequest
from fish_sm.serving import audio as audio_out
from fish_sm.serving.errors import HTTPError
from fish_sm.serving.request import JSON, JSONLINES, check_accept, response_format


@dataclass
class Prediction:
    results: list  # one per request: a synthesis (engine Synthesis, or the batching server's result), or
    # the HTTPError a JSON Lines line answers with on its own
    requests: list[TTSRequest]
    jsonlines: bool


def encode_prediction(prediction: Prediction, accept) -> tuple[bytes, str]:
    """(body, media type) for the Accept header; JSON Lines in, JSON Lines out."""
    if prediction.jsonlines:
        check_accept(accept, jsonlines=True)
        lines = [_json(request, result, request.format or "wav") for request, result in zip(prediction.requests, prediction.results)]
        return b"\n".join(lines) + b"\n", JSONLINES
    request, result = prediction.requests[0], prediction.results[0]
    kind, fmt = response_format(accept, request)
    if kind == JSON:
        return _json(request, result, fmt), kind
    if kind == JSONLINES:
        return _json(request, result, fmt) + b"\n", kind
    return audio_out.encode_audio(result.audio, result.sample_rate, fmt, request.sample_rate)[0], kind


def _json(request: TTSRequest, result, fmt: str) -> bytes:
    if isinstance(result, HTTPError):  # a JSON Lines line that failed on its own
        return audio_out.json_bytes({"error": result.message, "status": result.status})
    body, rate = audio_out.encode_audio(result.audio, result.sample_rate, fmt, request.sample_rate)
    return audio_out.json_bytes(audio_out.json_document(body, fmt, rate, result))

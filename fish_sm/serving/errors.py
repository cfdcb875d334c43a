"""HTTP errors as sagemaker-inference's error type, so the model server answers with the
right status; the body is a JSON object `{"error": message}`.

The toolkit's own error handler appends a Python traceback to the body; `json_error_body`
and `install_json_errors` replace that with the JSON message alone (the trace goes to the log).
"""

from __future__ import annotations

import json
import logging

from sagemaker_inference.errors import BaseInferenceToolkitError

logger = logging.getLogger("fish_sm.serving")


class HTTPError(BaseInferenceToolkitError):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(status, message, _PHRASES.get(status, "Error"))

    def body(self) -> bytes:
        return json.dumps({"error": self.message}).encode()


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, message)


class NoAudio(HTTPError):
    """A synthesis that ended before its first frame: nothing to answer with but an error."""

    def __init__(self):
        super().__init__(422, "the model ended the utterance before any audio; try another seed, or rephrase the text")


def engine_error(exc: Exception) -> HTTPError:
    """The answer to a synthesis that failed: the request's own fault (400), the GPU's memory
    (503: this request only; a retry or a shorter one may fit), the engine's state (503), or ours (500)."""
    import torch

    from fish_sm.errors import FishSMError, InputError

    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InputError):
        return bad_request(str(exc))
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return HTTPError(503, "the GPU ran out of memory for this request; retry, or send a shorter text or reference")
    if isinstance(exc, FishSMError):
        return HTTPError(503, str(exc))
    logger.error("request failed: %r", exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}")


_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    408: "Request Timeout",
    413: "Payload Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Entity",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def json_error_body(exc: BaseException) -> tuple[int, str, bytes]:
    """(status, phrase, JSON body) for any exception raised while handling a request."""
    if isinstance(exc, BaseInferenceToolkitError):
        status, phrase, message = exc.status_code, exc.phrase, exc.message
    else:
        status, phrase, message = 500, "Internal Server Error", f"internal error: {type(exc).__name__}"
    return int(status), str(phrase).replace("\r", " ").replace("\n", " "), json.dumps({"error": message}).encode()


def handle_error(context, inference_exception, trace):
    logger.error("request failed: %s", trace)
    status, phrase, body = json_error_body(inference_exception)
    context.set_response_status(code=status, phrase=phrase)
    try:
        context.set_response_content_type(0, "application/json")
    except Exception:  # older contexts without per-request content types
        pass
    return [body]


def install_json_errors() -> None:
    """Make the toolkit's Transformer answer errors with our JSON body and no traceback.

    Used where the container owns the handler service (the stock PyTorch image): its
    Transformer is the one that formats errors, so the formatter is replaced on the class.
    """
    from sagemaker_inference import transformer

    transformer.Transformer.handle_error = staticmethod(handle_error)

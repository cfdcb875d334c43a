"""Our HTTP errors as sagemaker-inference's error type, so the model server answers with the
right status; the body is a JSON object `{"error": message}`.

The toolkit's Transformer answers any exception that is not a `BaseInferenceToolkitError` with
a 500, so the contract functions raise `ToolkitHTTPError` (`toolkit_errors`). Its own error
handler appends a Python traceback to the body; `handle_error` and `install_json_errors`
replace that with the JSON message alone (the trace goes to the log).
"""

from __future__ import annotations

import contextlib
import json
import logging

from sagemaker_inference.errors import BaseInferenceToolkitError

from fish_sm.serving.errors import HTTPError

logger = logging.getLogger("fish_sm.serving")

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


class ToolkitHTTPError(HTTPError, BaseInferenceToolkitError):
    """An `HTTPError` the toolkit's Transformer recognises, with its status and phrase."""

    def __init__(self, status: int, message: str):
        BaseInferenceToolkitError.__init__(self, status, message, _PHRASES.get(status, "Error"))
        self.status = status


@contextlib.contextmanager
def toolkit_errors():
    """Re-raise an `HTTPError` from the block as a `ToolkitHTTPError` with the same status and message."""
    try:
        yield
    except ToolkitHTTPError:
        raise
    except HTTPError as exc:
        raise ToolkitHTTPError(exc.status, exc.message) from exc


def json_error_body(exc: BaseException) -> tuple[int, str, bytes]:
    """(status, phrase, JSON body) for any exception raised while handling a request."""
    if isinstance(exc, BaseInferenceToolkitError):
        status, phrase, message = exc.status_code, exc.phrase, exc.message
    elif isinstance(exc, HTTPError):
        status, phrase, message = exc.status, _PHRASES.get(exc.status, "Error"), exc.message
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

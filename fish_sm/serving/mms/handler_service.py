"""The model server's entry point in our own container: `handle(data, context)`.

The multi-model server calls `handle(None, context)` once when a worker starts (the
model is loaded then, and a failure stops the worker instead of leaving it half-alive),
then `handle(batch, context)` per request. It runs sagemaker-inference's `Transformer`
around our handler module, with errors answered as JSON without a traceback.
"""

from __future__ import annotations

import logging
import os
import time

from sagemaker_inference.default_inference_handler import DefaultInferenceHandler
from sagemaker_inference.transformer import Transformer

from fish_sm.serving.errors import HTTPError, start_up_failure
from fish_sm.serving.metrics import STARTED_HEADER
from fish_sm.serving.mms import handler
from fish_sm.serving.mms.errors import handle_error
from fish_sm.serving.mms.gate import mark_failed, mark_ready
from fish_sm.serving.request import check_accept


class _Handlers(DefaultInferenceHandler):
    """Our contract functions as the Transformer's defaults, so no user module lookup is needed."""

    default_model_fn = staticmethod(handler.model_fn)
    default_input_fn = staticmethod(handler.input_fn)
    default_predict_fn = staticmethod(handler.predict_fn)
    default_output_fn = staticmethod(handler.output_fn)


class JSONErrorTransformer(Transformer):
    handle_error = staticmethod(handle_error)


_transformer = JSONErrorTransformer(default_inference_handler=_Handlers())
MODEL_DIR_ENV = "FISH_SM_MODEL_DIR"
logger = logging.getLogger("fish_sm.serving")


def handle(data, context):
    if data is None:
        _initialize(context)
        return None
    # When this worker took the request, on every answer it gives: the gate's metrics line takes
    # its queue wait from it, and its absence from a 503 says that the model server refused it.
    context.set_response_header(0, STARTED_HEADER, f"{time.time():.6f}")
    # The Transformer hands the handler functions the context it was initialised with, not
    # this request's; so the Accept header is checked here, before any synthesis.
    props = context.request_processor[0].get_request_properties()
    try:
        check_accept(props.get("Accept") or props.get("accept"))
    except HTTPError as exc:
        return handle_error(context, exc, "")
    return _transformer.transform(data, context)


def _initialize(context) -> None:
    """model_fn, once per worker. A failure leaves its one-line error for the launcher, which
    stops the server after a few; a bad file or setting ends the worker with that line alone
    (its traceback would bury it in the log), a bug with its traceback."""
    model_dir = os.environ.get(MODEL_DIR_ENV) or context.system_properties.get("model_dir")
    device = handler.worker_device(context)
    try:
        _transformer.validate_and_initialize(model_dir=model_dir, context=context)
    except Exception as exc:
        message, expected = start_up_failure(exc)
        mark_failed(device, message)
        if not expected:
            raise
        logger.error("model_fn failed on %s: %s", device, message)
        # SystemExit rather than the error itself, which the model server's worker would log
        # with its traceback; it sees the worker go either way, and starts another.
        raise SystemExit(1) from None
    mark_ready(device)

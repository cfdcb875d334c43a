"""HTTP errors: a status and a message, answered as the JSON object `{"error": message}`.

Plain exceptions, so the batching server needs nothing from sagemaker-inference; the model
server's side adapts them to the toolkit's error type (`fish_sm.serving.mms.errors`).
"""

from __future__ import annotations

import json
import logging
import sys

logger = logging.getLogger("fish_sm.serving")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> bytes:
        return json.dumps({"error": self.message}).encode()


class AdapterFailed(HTTPError):
    """A LoRA adapter that cannot be read or served (a download, its checksum, its tensors): this
    request fails (422), and its metrics line counts it under AdapterErrors, which an alarm watches."""

    def __init__(self, message: str):
        super().__init__(422, message)


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, message)


def unknown_voice(name: str, known) -> HTTPError:
    """A 400 for a voice the package does not have, naming those it has."""
    return bad_request(f"unknown voice {name!r}; packaged voices: {', '.join(sorted(known)) or 'none'}")


class Busy(HTTPError):
    """A 503 to retry after `retry_after_s` (a Retry-After header where the server can send one)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(503, f"{message}; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class NoAudio(HTTPError):
    """A synthesis that ended before its first frame: nothing to answer with but an error."""

    def __init__(self):
        super().__init__(422, "the model ended the utterance before any audio; try another seed, or rephrase the text")


def engine_error(exc: Exception) -> HTTPError:
    """The answer to a synthesis that failed: the request's own fault (400), an adapter that cannot
    be read or served (422: this request only), the GPU's memory (503: this request only; a retry
    or a shorter one may fit), the engine's state (503), or ours (500)."""
    from fish_sm.errors import AdapterError, FishSMError, InputError

    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InputError):
        return bad_request(str(exc))
    if isinstance(exc, AdapterError):
        return AdapterFailed(" ".join(str(exc).split()))
    if _out_of_memory(exc):
        return HTTPError(503, "the GPU ran out of memory for this request; retry, or send a shorter text or reference")
    if isinstance(exc, FishSMError):
        return HTTPError(503, str(exc))
    logger.error("request failed: %r", exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}")


def start_up_failure(exc: BaseException) -> tuple[str, bool]:
    """A server's start-up failure in one line, and whether it is one its user can act on (a
    bad file or setting, too little memory), whose traceback would only bury the message;
    anything else is a bug, whose traceback belongs in the log."""
    from fish_sm.errors import FishSMError

    if isinstance(exc, FishSMError):
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {exc}"
    expected = isinstance(exc, (FishSMError, OSError, ValueError, MemoryError)) or _out_of_memory(exc)
    return " ".join(message.split()), expected


def _out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is torch's CUDA out-of-memory error (never where torch is not loaded: the
    batching server's front end maps errors without it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)

"""A zero-shot reference's recording, ready to encode: its bytes from the request or from an
allowed S3 bucket, within the size and duration limits. No torch: the batching server's front
end does this and sends the bytes to an engine core, which encodes them with the codec."""

from __future__ import annotations

import io

import soundfile as sf

from fish_sm.contract import ReferenceAudio
from fish_sm.serving.errors import HTTPError
from fish_sm.settings import Settings


def reference_audio(ref: ReferenceAudio, settings: Settings) -> bytes:
    """The recording's bytes, fetched if it is an S3 URI (blocking: run it off an event loop);
    413 when too large or too long, 422 when libsndfile cannot read it."""
    audio = ref.audio if ref.audio is not None else _fetch_s3(ref.s3_bucket, ref.s3_key, settings)
    if len(audio) > settings.max_reference_bytes:
        raise HTTPError(413, f"reference audio is {len(audio)} bytes; the limit is {settings.max_reference_bytes}")
    try:
        info = sf.info(io.BytesIO(audio))
    except Exception:
        raise HTTPError(422, "the reference audio cannot be decoded (send WAV, FLAC or Ogg)") from None
    if info.duration > settings.max_reference_seconds:
        raise HTTPError(413, f"reference audio is {info.duration:.1f} s; the limit is {settings.max_reference_seconds:g} s")
    return audio


def _fetch_s3(bucket: str, key: str, settings: Settings) -> bytes:
    from botocore.exceptions import BotoCoreError, ClientError

    from fish_sm.serving.s3 import s3_client

    try:
        obj = s3_client().get_object(Bucket=bucket, Key=key)
        if obj.get("ContentLength", 0) > settings.max_reference_bytes:
            raise HTTPError(413, f"s3://{bucket}/{key} is over the {settings.max_reference_bytes} byte limit")
        return obj["Body"].read()
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = 403 if code in ("AccessDenied", "403") else 400
        raise HTTPError(status, f"cannot read s3://{bucket}/{key}: {code or exc}") from None
    except BotoCoreError as exc:
        raise HTTPError(400, f"cannot read s3://{bucket}/{key}: {exc}") from None

"""S3 URIs, uploads/downloads that report their progress, and ranged reads of an object's start.

A packaged S1-mini checkpoint is several GB, so uploads are multipart (boto3's transfer
manager, parts in parallel) and report bytes sent; small objects (requests, results) go
through plain put/get.
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fish_sm.aws import AWSError
from fish_sm.aws.session import AWS, error_code, is_not_found
from fish_sm.errors import InputError

MIB = 1024 * 1024
DEFAULT_PART_SIZE = 64 * MIB
MIN_PART_SIZE = 5 * MIB  # S3's floor for every part but the last
Progress = Callable[[int, int], None]  # (bytes transferred so far, bytes in all)

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str  # may be '' (the bucket) or end with '/' (a prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def join(self, name: str) -> "S3Uri":
        """The object `name` under this prefix (a trailing '/' is implied)."""
        base = self.key if self.is_prefix else self.key + "/"
        return S3Uri(self.bucket, base + name)


def parse_s3_uri(uri: str, *, what: str = "S3 URI", prefix: bool | None = None) -> S3Uri:
    """Parse s3://bucket/key with a message that says what was expected.

    prefix=True wants a folder (s3://bucket/prefix/ or s3://bucket), prefix=False an object key.
    """
    m = re.match(r"^s3://([^/]+)(?:/(.*))?$", uri or "")
    if not m:
        raise InputError(f"{what} must look like s3://bucket/key, got {uri!r}")
    bucket, key = m.group(1), m.group(2) or ""
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise InputError(f"{what} {uri!r}: {bucket!r} is not a valid bucket name")
    if "//" in key:
        raise InputError(f"{what} {uri!r} has an empty path segment ('//')")
    if prefix is False and (key == "" or key.endswith("/")):
        raise InputError(f"{what} must name an object (s3://bucket/path/file), got {uri!r}")
    if prefix is True and key and not key.endswith("/"):
        key += "/"
    return S3Uri(bucket, key)


def _byte_counter(total: int, progress: Progress | None):
    """boto3's Callback: its byte counts, from the transfer threads, summed and passed on one
    call at a time as (done, total); progress hears (0, total) first. None without progress."""
    if not progress:
        return None
    lock, done = threading.Lock(), 0

    def update(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            progress(done, total)

    progress(0, total)
    return update


def upload_file(aws: AWS, path: Path, dest: S3Uri, *, part_size: int = DEFAULT_PART_SIZE,
                progress: Progress | None = None, content_type: str | None = None) -> S3Uri:
    """Upload `path` to `dest` (a prefix gets the file's name appended); multipart above part_size."""
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig

    if part_size < MIN_PART_SIZE:
        raise InputError(f"part size must be at least {MIN_PART_SIZE // MIB} MiB (S3's minimum), "
                         f"got {part_size / MIB:g} MiB")
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such file to upload: {path}")
    target = dest.join(path.name) if dest.is_prefix else dest
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                            max_concurrency=8, use_threads=True)
    extra = {"ContentType": content_type} if content_type else None
    update = _byte_counter(path.stat().st_size, progress)
    try:
        aws.s3.upload_file(str(path), target.bucket, target.key, Config=config, Callback=update,
                           ExtraArgs=extra)
    except S3UploadFailedError as exc:  # wraps the ClientError (NoSuchBucket, AccessDenied) in its text
        raise AWSError(f"upload to {target} failed: {exc}") from None
    return target


def download_file(aws: AWS, src: S3Uri, path: Path, *, progress: Progress | None = None) -> Path:
    """Download one object to `path`; progress's total comes from HeadObject."""
    head = head_object(aws, src)
    if head is None:
        raise AWSError(f"{src} does not exist")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    aws.s3.download_file(src.bucket, src.key, str(path), Callback=_byte_counter(head["ContentLength"], progress))
    return path


def head_object(aws: AWS, uri: S3Uri) -> dict | None:
    """HeadObject, or None when the object (or bucket) does not exist."""
    try:
        return aws.s3.head_object(Bucket=uri.bucket, Key=uri.key)
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise


def check_bucket(aws: AWS, uri: S3Uri) -> None:
    """Fail in a second rather than after packaging gigabytes: the bucket must exist and be reachable."""
    try:
        aws.s3.head_bucket(Bucket=uri.bucket)
    except Exception as exc:
        code = error_code(exc)
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise AWSError(f"bucket {uri.bucket!r} of {uri} does not exist") from None
        if code in ("403", "AccessDenied", "Forbidden"):
            raise AWSError(f"no access to bucket {uri.bucket!r} of {uri} with these credentials") from None
        raise


def read_range(aws: AWS, uri: S3Uri, start: int, length: int) -> tuple[bytes, int]:
    """Up to `length` bytes of an object from `start` (a ranged GET), and the object's size."""
    try:
        obj = aws.s3.get_object(Bucket=uri.bucket, Key=uri.key, Range=f"bytes={start}-{start + length - 1}")
    except Exception as exc:
        if error_code(exc) == "InvalidRange":  # start is at or past the end
            return b"", start
        raise
    with contextlib.closing(obj["Body"]) as body:
        m = re.fullmatch(r"bytes \d+-\d+/(\d+)", obj.get("ContentRange") or "")
        if m is None:  # a server that ignores Range sends the whole object: read no further than asked
            return body.read(start + length)[start:], obj["ContentLength"]
        return body.read(length), int(m.group(1))


def put_bytes(aws: AWS, uri: S3Uri, data: bytes, content_type: str = "application/octet-stream") -> None:
    aws.s3.put_object(Bucket=uri.bucket, Key=uri.key, Body=data, ContentType=content_type)


def get_bytes(aws: AWS, uri: S3Uri) -> bytes:
    return aws.s3.get_object(Bucket=uri.bucket, Key=uri.key)["Body"].read()


def list_objects(aws: AWS, prefix: S3Uri) -> list[dict]:
    """Every object under a prefix (Key, Size, ...), following pagination."""
    out = []
    for page in aws.s3.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=prefix.key):
        out.extend(page.get("Contents", []))
    return out

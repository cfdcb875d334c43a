"""model.tar.gz on S3: its upload, and its manifest.json read from the object's first bytes.

fish_sm.package.tarball writes manifest.json as the tarball's first entry, so `deploy` can
pin it with a few ranged GETs instead of downloading the weights.
"""

from __future__ import annotations

import json
import tarfile
import zlib
from pathlib import Path

from fish_sm.aws.s3 import DEFAULT_PART_SIZE, Progress, S3Uri, read_range, upload_file
from fish_sm.aws.session import AWS
from fish_sm.errors import InputError
from fish_sm.package.tarball import MANIFEST

MANIFEST_RANGE = 64 * 1024  # bytes of model.tar.gz read first: a compressed manifest is a few KB
MANIFEST_LIMIT = 4 * 1024 * 1024  # bytes read (and manifest bytes) beyond which it is not a fish-sm manifest


def package_manifest(aws: AWS, uri: S3Uri) -> bytes:
    """manifest.json of a package made by `fish-sm package`, or an InputError saying why `uri` is not one."""
    manifest, why = read_tarball_manifest(aws, uri)
    if manifest is None:
        raise InputError(f"--model-data {uri} {why}; make it with `fish-sm package`")
    try:
        parsed = json.loads(manifest)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("files"), dict):
        raise InputError(f"--model-data {uri}: its manifest.json is not a fish-sm manifest (no \"files\" table); "
                         "make it with `fish-sm package`")
    return manifest


def read_tarball_manifest(aws: AWS, uri: S3Uri) -> tuple[bytes | None, str]:
    """The manifest.json at the start of an S3 model.tar.gz, read with ranged GETs and decompressed
    as it comes: (its bytes, ''), or (None, why not) when the object is not a tarball whose first
    entry is manifest.json."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
    tar = bytearray()
    offset, length = 0, MANIFEST_RANGE
    while offset < MANIFEST_LIMIT:
        chunk, total = read_range(aws, uri, offset, length)
        if not chunk:
            return None, "is empty" if offset == 0 else "ends before its first entry does"
        if offset == 0 and not chunk.startswith(b"\x1f\x8b"):
            return None, "is not a gzip file (model.tar.gz)"
        offset += len(chunk)
        try:  # max_length: a small, highly compressed object cannot expand past the limit in memory
            tar += inflate.decompress(chunk, MANIFEST_LIMIT + 512 + 1 - len(tar))
        except zlib.error:
            return None, "is not a valid gzip file"
        found = _first_entry(tar)
        if found is None:
            return None, "has no manifest.json as its first entry (or is not a tar archive)"
        if found is not _MORE:
            return found, ""
        if offset >= total or inflate.eof or len(tar) > MANIFEST_LIMIT + 512:
            return None, "has no complete manifest.json as its first entry"
        length *= 2
    return None, f"has no manifest.json within its first {MANIFEST_LIMIT // (1024 * 1024)} MiB"


_MORE = object()  # the first entry is not complete in the bytes so far


def _first_entry(tar: bytearray):
    """manifest.json's bytes if the tar data starts with it as a plain file; None if it starts
    with anything else; _MORE while the header or the file is incomplete."""
    if len(tar) < tarfile.BLOCKSIZE:
        return _MORE
    try:
        info = tarfile.TarInfo.frombuf(bytes(tar[: tarfile.BLOCKSIZE]), "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return None
    if info.name != MANIFEST or not info.isreg() or info.size > MANIFEST_LIMIT:
        return None
    end = tarfile.BLOCKSIZE + info.size
    return bytes(tar[tarfile.BLOCKSIZE:end]) if len(tar) >= end else _MORE


def upload(aws: AWS, tarball: Path, dest: S3Uri, *, part_size: int = DEFAULT_PART_SIZE,
           progress: Progress | None = None) -> S3Uri:
    """Upload model.tar.gz to `dest` (a prefix gets the tarball's file name appended)."""
    return upload_file(aws, tarball, dest, part_size=part_size, progress=progress,
                       content_type="application/gzip")

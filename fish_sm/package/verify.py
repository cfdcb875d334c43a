"""Whether a model directory may be trusted, decided before anything in it is read.

A package (a directory with manifest.json) is trusted only when every file in it is listed
in the manifest with the same size and sha256, every listed file is there, and nothing in
it leads outside the directory; `FISH_SM_MANIFEST_SHA256` (set by `fish-sm deploy`) pins
the manifest itself; its "adapters" table may name only listed files at
`adapters/NAME.safetensors`, so it cannot point the server at any other file. A plain checkpoint
directory (no manifest.json) cannot be verified: it may be served, but its compile_cache/ is
never used, because torch unpickles cache entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from fish_sm.errors import CheckpointError

logger = logging.getLogger("fish_sm.serving")

MANIFEST = "manifest.json"
READ_BYTES = 4 * 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# (directory, pinned sha256) -> the stat of every file when it was last verified in this process
_verified: dict[tuple[str, str], tuple] = {}


def verify_package(model_dir, manifest_sha256: str = "", token: str | None = None) -> bool:
    """True for a package whose files all match its manifest.json; False for a plain checkpoint
    directory (no manifest.json and no pinned sha256). Anything else raises CheckpointError
    naming the first bad file.

    A directory verified earlier in this process is not hashed again while every file's
    size, times and inode are unchanged, nor one whose `token` (`verified_token`, from the
    process that started this one and verified it) still matches them: the batching server's
    front end verifies a package once, and its engine cores skip the seconds of hashing it again.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    root = model_dir.resolve()
    if not os.path.lexists(model_dir / MANIFEST):
        if manifest_sha256:
            raise CheckpointError(f"{model_dir}: no {MANIFEST}, but FISH_SM_MANIFEST_SHA256 is set; "
                                  "refusing a model directory that cannot be verified")
        return False
    t0 = time.perf_counter()
    found = _files_on_disk(model_dir, root)
    snapshot = tuple((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
                     for name, st in sorted(found.items()))
    key = (str(root), manifest_sha256)
    if _verified.get(key) == snapshot:
        return True
    if token is not None and token == _token(key, snapshot):
        _verified[key] = snapshot
        logger.info("%s: files unchanged since the process that started this one verified them", model_dir)
        return True
    if MANIFEST not in found:
        raise CheckpointError(f"{model_dir / MANIFEST}: not a regular file")
    manifest_bytes = (model_dir / MANIFEST).read_bytes()
    if manifest_sha256:
        actual = hashlib.sha256(manifest_bytes).hexdigest()
        if actual != manifest_sha256:
            raise CheckpointError(f"{model_dir / MANIFEST}: sha256 {actual} is not FISH_SM_MANIFEST_SHA256 "
                                  f"{manifest_sha256} (not the package that was deployed)")
    manifest = _parse_manifest(manifest_bytes, model_dir)
    listed = _listed_files(manifest, model_dir)
    _check_adapters(manifest, listed, model_dir)
    for name in sorted((set(listed) | set(found)) - {MANIFEST}):
        if name not in found:
            raise CheckpointError(f"{model_dir / name}: listed in {MANIFEST} but missing")
        if name not in listed:
            raise CheckpointError(f"{model_dir / name}: not in {MANIFEST} (added after the package was built)")
        if found[name].st_size != listed[name][0]:
            raise CheckpointError(f"{model_dir / name}: {found[name].st_size} bytes, {MANIFEST} says {listed[name][0]}")
    # Largest first, so the two multi-GB weight files start at once and bound the wall time.
    by_size = sorted(listed, key=lambda n: -listed[n][0])
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(by_size)))) as pool:
        digests = dict(zip(by_size, pool.map(lambda n: _listed_sha256(model_dir / n), by_size)))
    for name in sorted(listed):
        if digests[name] != listed[name][1]:
            raise CheckpointError(f"{model_dir / name}: sha256 {digests[name]} differs from {MANIFEST}'s "
                                  f"{listed[name][1]} (changed after the package was built)")
    _verified[key] = snapshot
    logger.info("verified %d files (%.1f MB) against %s in %.2f s", len(listed),
                sum(size for size, _ in listed.values()) / 1e6, MANIFEST, time.perf_counter() - t0)
    return True


def verified_token(model_dir, manifest_sha256: str = "") -> str | None:
    """A digest of `model_dir`'s files (each one's size, times and inode) as this process
    verified them, for a process it starts to pass to `verify_package`; None where this process
    has not verified it. A file changed since (even rewritten with the same bytes) changes its
    times, and the other process then hashes the directory itself."""
    key = (str(Path(model_dir).resolve()), manifest_sha256)
    snapshot = _verified.get(key)
    return None if snapshot is None else _token(key, snapshot)


def _token(key: tuple[str, str], snapshot: tuple) -> str:
    return hashlib.sha256(json.dumps([list(key), snapshot]).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file in 4 MiB reads; hashlib releases the GIL, so threads hash files in parallel."""
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _listed_sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None


def _compiled_python(rel: PurePosixPath, entry: os.DirEntry) -> bool:
    """Bytecode Python writes beside code/ when the stock container imports it; never part of a package."""
    if rel.parts[0] != "code":
        return False
    if entry.name == "__pycache__":
        return entry.is_dir(follow_symlinks=False)
    return entry.name.endswith(".pyc") and entry.is_file(follow_symlinks=False)


def _files_on_disk(model_dir: Path, root: Path) -> dict[str, os.stat_result]:
    """Every file under model_dir by its posix path, refusing links that leave it and anything not a plain file."""
    files: dict[str, os.stat_result] = {}

    def walk(d: Path, rel: PurePosixPath | None) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            r = rel / entry.name if rel else PurePosixPath(entry.name)
            path = Path(entry.path)
            if _compiled_python(r, entry):
                continue
            if entry.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(root):
                    raise CheckpointError(f"{path}: a symlink to {target}, outside {model_dir}")
                if target.is_dir():
                    raise CheckpointError(f"{path}: a symlink to a directory (a package holds plain files)")
            try:
                st = path.stat()
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
            if stat.S_ISDIR(st.st_mode):
                walk(path, r)
            elif stat.S_ISREG(st.st_mode):
                files[r.as_posix()] = st
            else:
                raise CheckpointError(f"{path}: not a regular file or directory")

    walk(model_dir, None)
    return files


def _parse_manifest(manifest_bytes: bytes, model_dir: Path):
    try:
        return json.loads(manifest_bytes)
    except ValueError as exc:  # also a UnicodeDecodeError
        raise CheckpointError(f"{model_dir / MANIFEST}: not valid JSON ({exc})") from None


def _listed_files(manifest, model_dir: Path) -> dict[str, tuple[int, str]]:
    """manifest.json's files table as {posix path: (size, sha256)}, every name a path inside the package."""
    where = model_dir / MANIFEST
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{where}: no \"files\" table of sizes and sha256s")
    listed = {}
    for name, entry in files.items():
        path = PurePosixPath(name)
        if (not name or name == MANIFEST or path.is_absolute() or ".." in path.parts or "\\" in name
                or path.as_posix() != name):
            raise CheckpointError(f"{where} lists {name!r}: not a relative path inside the package")
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if type(size) is not int or size < 0 or not isinstance(digest, str) or not _SHA256.match(digest):
            raise CheckpointError(f"{where}: the entry for {name} needs a size and a sha256")
        listed[name] = (size, digest)
    return listed


def _check_adapters(manifest: dict, listed: dict[str, tuple[int, str]], model_dir: Path) -> None:
    """manifest.json's "adapters" table ({NAME: {"file", "rank", "alpha", "bytes"}}): each file is
    adapters/NAME.safetensors and listed with its size; a voice's "adapter" names one of them."""
    from fish_sm.contract import check_adapter_name

    where = model_dir / MANIFEST
    adapters = manifest.get("adapters") or {}
    if not isinstance(adapters, dict):
        raise CheckpointError(f"{where}: \"adapters\" must be a table of NAME: entry")
    for name, entry in adapters.items():
        check_adapter_name(name, lambda message: CheckpointError(f"{where}: {message}"))
        file = f"adapters/{name}.safetensors"
        if not isinstance(entry, dict) or entry.get("file") != file:
            raise CheckpointError(f"{where}: adapter {name} must be the file {file}")
        if file not in listed:
            raise CheckpointError(f"{where}: adapter {name}'s file {file} is not in its files table")
        rank, alpha = entry.get("rank"), entry.get("alpha")
        if type(rank) is not int or not 1 <= rank <= 256 or type(alpha) not in (int, float) or not alpha > 0:
            raise CheckpointError(f"{where}: adapter {name} needs a rank (1-256) and a positive alpha")
        if entry.get("bytes") != listed[file][0]:
            raise CheckpointError(f"{where}: adapter {name} says {entry.get('bytes')} bytes, its file has "
                                  f"{listed[file][0]}")
    voices = manifest.get("voices") or {}
    for voice_id, meta in (voices.items() if isinstance(voices, dict) else ()):
        implied = meta.get("adapter") if isinstance(meta, dict) else None
        if implied is not None and implied not in adapters:
            raise CheckpointError(f"{where}: voice {voice_id} names adapter {implied!r}, which it does not hold")

"""model.tar.gz: a reproducible tarball of a package directory (stdlib only).

The same directory always gives the same bytes (sorted entries, fixed mtime/uid/gid/owner
names and modes, gzip header without a name or time), so the sha256 of model.tar.gz
identifies a model build and re-packaging an unchanged model is a no-op for S3 caches and
for SageMaker's model download. (Byte identity holds for one zlib build; another zlib may
choose other, equally valid, deflate streams.) manifest.json is the first entry, so
`deploy` reads it from the object's first bytes to pin it, without downloading the weights.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fish_sm.errors import InputError

FIXED_MTIME = 0
_COPY_CHUNK = 4 * 1024 * 1024
MANIFEST = "manifest.json"
Progress = Callable[[int, int], None]  # (bytes archived so far, bytes in all)


@dataclass(frozen=True)
class Tarball:
    path: Path
    size: int
    sha256: str
    files: int


def _entries(src: Path) -> list[Path]:
    """Every directory and file under src (links inside it followed, loops refused), manifest.json
    first and the rest in byte order of path."""
    out: list[Path] = []
    root = src.resolve()
    seen = {root}

    def walk(d: Path, rel: Path | None) -> None:
        for child in d.iterdir():
            r = rel / child.name if rel else Path(child.name)
            if child.is_symlink() and not child.resolve().is_relative_to(root):
                raise InputError(f"cannot archive {child}: a symlink to {child.resolve()}, outside {src}")
            out.append(r)
            if child.is_dir():
                real = child.resolve()
                if real in seen:
                    raise InputError(f"cannot archive {child}: a link to a directory archived already")
                seen.add(real)
                walk(child, r)

    walk(src, None)
    return sorted(out, key=lambda p: (p.as_posix() != MANIFEST, p.as_posix().encode()))


def _tarinfo(rel: Path, full: Path) -> tarfile.TarInfo:
    st = full.stat()  # follows links (_entries lets through only those inside src): the archive holds contents
    info = tarfile.TarInfo(rel.as_posix())
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if stat.S_ISDIR(st.st_mode):
        info.type, info.mode, info.size = tarfile.DIRTYPE, 0o755, 0
    elif stat.S_ISREG(st.st_mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644
    else:
        raise InputError(f"cannot archive {full}: not a regular file or directory")
    return info


class _HashingWriter:
    """File wrapper that hashes and counts what gzip writes, so we never re-read the tarball."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _ProgressReader:
    def __init__(self, f, update):
        self.f, self.update = f, update

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n and n > 0 else _COPY_CHUNK)
        self.update(len(data))
        return data


def _silent(done: int, total: int) -> None:
    pass


def make_tarball(src: Path, out: Path, *, compresslevel: int = 1, progress: Progress | None = None) -> Tarball:
    """Archive the contents of `src` (entries relative to it, no leading './') into `out`.

    compresslevel 1 by default: weights are near-incompressible bf16, so higher levels cost
    minutes on a multi-GB checkpoint for a few percent. progress, when given, is called with
    (0, total) before the first file and then as the files' bytes are read.
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise InputError(f"not a directory: {src}")
    if not 0 <= compresslevel <= 9:
        raise InputError(f"compression level must be 0-9, got {compresslevel}")
    out_resolved = out.resolve()
    rels = [r for r in _entries(src) if (src / r).resolve() != out_resolved]
    infos = [(_tarinfo(r, src / r), src / r) for r in rels]
    total = sum(i.size for i, _ in infos)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    report, done = progress or _silent, 0

    def update(n: int) -> None:
        nonlocal done
        done += n
        report(done, total)

    try:
        with open(tmp, "wb") as raw:
            writer = _HashingWriter(raw)
            # filename='' and mtime=0 keep the output's own name and the clock out of the header.
            with gzip.GzipFile(filename="", mode="wb", fileobj=writer, mtime=FIXED_MTIME,
                               compresslevel=compresslevel) as gz, \
                    tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                report(0, total)
                for info, full in infos:
                    if info.isdir():
                        tar.addfile(info)
                        continue
                    with open(full, "rb") as f:
                        tar.addfile(info, _ProgressReader(f, update))
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return Tarball(out, writer.size, writer.sha.hexdigest(), sum(1 for i, _ in infos if i.isfile()))

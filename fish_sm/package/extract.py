"""Unpacking a model.tar.gz to serve it, trusting nothing in it until it is verified.

The tarball is read as a stream, each member checked before a byte of it is written: a
relative path that stays inside the package (no absolute path, no `..`), a plain file or
directory (no link, device or FIFO), each name once, and sizes within the limits and the
free space of the disk. tarfile's "data" filter checks the same on its side. The result
goes into a private (0700) temporary directory, which is then verified against the
package's manifest.json (`verify.verify_package`) before anything in it is read, and is
removed when the block ends.
"""

from __future__ import annotations

import contextlib
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Iterator

from fish_sm.errors import CheckpointError, InputError
from fish_sm.package.verify import MANIFEST, verify_package

MAX_MEMBERS = 100_000  # a package holds tens of files (hundreds with a compile cache)
MAX_TOTAL_BYTES = 64 * 1024**3  # far above a real package: S1-mini's weights are a few GB
FREE_SPACE_MARGIN = 256 * 1024**2  # left on the disk after the last file


@contextlib.contextmanager
def extracted_package(tarball: Path, manifest_sha256: str = "") -> Iterator[Path]:
    """The package in `tarball`, unpacked into a private temporary directory and verified
    against its manifest.json (and `manifest_sha256` when set); the directory is removed
    when the block ends, whatever ends it."""
    tarball = Path(tarball)
    root = Path(tempfile.mkdtemp(prefix="fish-sm-model-"))
    try:
        extract(tarball, root)
        if not (root / MANIFEST).is_file():
            raise CheckpointError(f"{tarball}: no {MANIFEST} in it; serve a package written by `fish-sm package`, "
                                  "or an unpacked checkpoint directory")
        verify_package(root, manifest_sha256)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def extract(tarball: Path, dest: Path) -> int:
    """Unpack `tarball` into the existing directory `dest` after checking every member; the
    number of files written. Anything refused raises InputError naming the member."""
    seen: set[str] = set()
    total = files = 0
    try:
        with tarfile.open(tarball, mode="r|*") as tar:
            for member in tar:
                name = _checked_name(tarball, member, seen)
                if len(seen) > MAX_MEMBERS:
                    raise InputError(f"{tarball}: more than {MAX_MEMBERS} members; not a model package")
                if name is None:
                    continue
                if member.isfile():
                    total += member.size
                    if total > MAX_TOTAL_BYTES:
                        raise InputError(f"{tarball}: over {MAX_TOTAL_BYTES / 1024**3:g} GiB unpacked; "
                                         "not a model package")
                    free = shutil.disk_usage(dest).free
                    if member.size + FREE_SPACE_MARGIN > free:
                        raise InputError(f"{tarball}: {name} ({member.size} bytes) does not fit in the "
                                         f"{free // 1024**2} MB free under {dest}")
                    files += 1
                tar.extract(member, dest, filter="data")
    except InputError:
        raise
    except tarfile.FilterError as exc:  # our checks come first; this is tarfile's second opinion
        raise InputError(f"{tarball}: refused: {exc}") from None
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise InputError(f"{tarball}: not a readable tar archive ({exc or type(exc).__name__})") from None
    except OSError as exc:
        raise InputError(f"{tarball}: cannot unpack it ({exc.strerror or exc})") from None
    return files


def _checked_name(tarball: Path, member: tarfile.TarInfo, seen: set[str]) -> str | None:
    """The member's path inside the package, or None for the top directory itself; InputError
    for anything that is not a plain file or directory at a path of its own inside it."""
    raw = member.name
    path = PurePosixPath(raw)
    if not raw or "\0" in raw or "\\" in raw or path.is_absolute() or ".." in path.parts:
        raise InputError(f"{tarball}: member {raw!r} is not a relative path inside the package; refusing the archive")
    if member.type == tarfile.GNUTYPE_SPARSE or not (member.isfile() or member.isdir()):
        raise InputError(f"{tarball}: member {raw!r} is {_kind(member)}; a package holds plain files only")
    name = path.as_posix()
    if name == ".":
        return None
    if name in seen:
        raise InputError(f"{tarball}: member {name!r} appears twice; refusing the archive")
    seen.add(name)
    return name


def _kind(member: tarfile.TarInfo) -> str:
    if member.type == tarfile.GNUTYPE_SPARSE:
        return "a sparse file"
    if member.issym():
        return "a symlink"
    if member.islnk():
        return "a hard link"
    if member.isdev():
        return "a device or FIFO"
    return f"an entry of type {member.type!r}"

"""model.tar.gz: a reproducible tarball of a package directory, and its upload.

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
import re
import stat
import sys
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import click

from fish_sm.aws.s3 import DEFAULT_PART_SIZE, S3Uri, byte_progress, read_range, upload_file
from fish_sm.aws.session import AWS
from fish_sm.errors import InputError

FIXED_MTIME = 0
_COPY_CHUNK = 4 * 1024 * 1024
_VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".opus", ".aiff", ".aif"}
MANIFEST = "manifest.json"
MANIFEST_RANGE = 64 * 1024  # bytes of model.tar.gz read first: a compressed manifest is a few KB
MANIFEST_LIMIT = 4 * 1024 * 1024  # bytes read (and manifest bytes) beyond which it is not a fish-sm manifest


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


def make_tarball(src: Path, out: Path, *, compresslevel: int = 1, progress: bool = True) -> Tarball:
    """Archive the contents of `src` (entries relative to it, no leading './') into `out`.

    compresslevel 1 by default: weights are near-incompressible bf16, so higher levels cost
    minutes on a multi-GB checkpoint for a few percent.
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
    try:
        with open(tmp, "wb") as raw:
            writer = _HashingWriter(raw)
            # filename='' and mtime=0 keep the output's own name and the clock out of the header.
            with gzip.GzipFile(filename="", mode="wb", fileobj=writer, mtime=FIXED_MTIME,
                               compresslevel=compresslevel) as gz, \
                    tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar, \
                    byte_progress(f"archiving {out.name}", total, progress) as update:
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


def read_tarball_manifest(aws: AWS, uri: S3Uri) -> bytes | None:
    """The manifest.json at the start of an S3 model.tar.gz, read with ranged GETs and decompressed
    as it comes; None when the object is not a tarball whose first entry is manifest.json."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
    tar = bytearray()
    offset, length = 0, MANIFEST_RANGE
    while offset < MANIFEST_LIMIT:
        chunk, total = read_range(aws, uri, offset, length)
        if not chunk:
            return None
        offset += len(chunk)
        try:  # max_length: a small, highly compressed object cannot expand past the limit in memory
            tar += inflate.decompress(chunk, MANIFEST_LIMIT + 512 + 1 - len(tar))
        except zlib.error:
            return None
        found = _first_entry(tar)
        if found is not _MORE:
            return found
        if offset >= total or inflate.eof or len(tar) > MANIFEST_LIMIT + 512:
            return None
        length *= 2
    return None


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


class _ProgressReader:
    def __init__(self, f, update):
        self.f, self.update = f, update

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n and n > 0 else _COPY_CHUNK)
        self.update(len(data))
        return data


class FileProgress:
    """A progress bar per large file for build_package_dir's (what, done, total) callbacks.

    Small files (the code, voices) hash in a blink, so only files of min_bytes or more get a
    bar: a line per file of a copied source tree would bury the two that take minutes.
    """

    def __init__(self, min_bytes: int = 32 * 1024 * 1024, enabled: bool = True):
        self.min_bytes, self.enabled = min_bytes, enabled
        self._bar = self._what = None
        self._done = 0

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled or total < self.min_bytes:
            return
        if what != self._what:
            self.close()
            self._bar = click.progressbar(length=total, label=what, file=sys.stderr, show_pos=False)
            self._bar.__enter__()
            self._what, self._done = what, 0
        self._bar.update(done - self._done)
        self._done = done
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        self._bar = self._what = None

    def __enter__(self) -> "FileProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def upload(aws: AWS, tarball: Path, dest: S3Uri, *, part_size: int = DEFAULT_PART_SIZE,
           progress: bool = True) -> S3Uri:
    """Upload model.tar.gz to `dest` (a prefix gets the tarball's file name appended)."""
    return upload_file(aws, tarball, dest, part_size=part_size, progress=progress,
                       content_type="application/gzip")


def parse_voice_spec(spec: str) -> tuple[str, Path, str]:
    """`ID=AUDIO[:TRANSCRIPT]` -> (id, audio path, transcript).

    TRANSCRIPT is the text itself, or @FILE to read it from a file. Without it, a sidecar
    AUDIO.txt or AUDIO.lab (upstream fish-speech's convention) next to the audio is used.
    """
    voice_id, sep, rest = spec.partition("=")
    if not sep or not voice_id or not rest:
        raise InputError(f"--voice must be ID=AUDIO[:TRANSCRIPT], got {spec!r}")
    if not _VOICE_ID.match(voice_id):
        raise InputError(f"--voice {spec!r}: voice id {voice_id!r} must be letters, digits, '_', '-', '.' "
                         "(up to 64, starting with a letter or digit)")
    audio_str, colon, transcript = rest.partition(":")
    audio = Path(audio_str).expanduser()
    if not audio.is_file():
        raise InputError(f"--voice {voice_id}: audio file not found: {audio}")
    if colon:
        if transcript.startswith("@"):
            tfile = Path(transcript[1:]).expanduser()
            if not tfile.is_file():
                raise InputError(f"--voice {voice_id}: transcript file not found: {tfile}")
            transcript = tfile.read_text(encoding="utf-8")
    else:
        sidecars = [audio.with_suffix(s) for s in (".txt", ".lab")]
        found = next((s for s in sidecars if s.is_file()), None)
        if found is None:
            raise InputError(f"--voice {voice_id}: no transcript; use ID=AUDIO:TEXT, ID=AUDIO:@FILE, "
                             f"or put it in {sidecars[0].name}")
        transcript = found.read_text(encoding="utf-8")
    transcript = transcript.strip()
    if not transcript:
        raise InputError(f"--voice {voice_id}: the transcript is empty")
    if audio.suffix.lower() not in _AUDIO_SUFFIXES:
        raise InputError(f"--voice {voice_id}: {audio.name} is not an audio file "
                         f"({', '.join(sorted(_AUDIO_SUFFIXES))})")
    return voice_id, audio, transcript


def parse_voice_specs(specs) -> dict[str, tuple[Path, str]]:
    """Several --voice options -> {id: (audio, transcript)}, each id once."""
    voices: dict[str, tuple[Path, str]] = {}
    for spec in specs:
        voice_id, audio, transcript = parse_voice_spec(spec)
        if voice_id in voices:
            raise InputError(f"--voice {voice_id} is given twice")
        voices[voice_id] = (audio, transcript)
    return voices


def is_package_dir(path: Path) -> bool:
    """A directory that is already a built package (what build_package_dir writes)."""
    return (Path(path) / "manifest.json").is_file() and (Path(path) / "code").is_dir()

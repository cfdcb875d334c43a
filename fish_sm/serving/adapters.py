"""The LoRA adapters a server knows: those in its package and those in its S3 sources.

- Packaged: manifest.json's "adapters" ({NAME: {"file": "adapters/NAME.safetensors", "rank", ...}}),
  verified with the rest of the package before anything is read. A packaged voice may imply one
  (its manifest entry's "adapter").
- S3 sources (`FISH_SM_ADAPTER_SOURCES`, the allow-list): adapter NAME is the object
  `<prefix>NAME.safetensors` of the first source that has it, with user metadata `sha256`, the
  hex digest of its bytes, checked after the download. A request names an adapter and nothing
  else: never a bucket, a key or a path. What S3 said (there, or not) is trusted for
  `FISH_SM_ADAPTER_REFRESH_S`, so an adapter removed from its source becomes unknown again, and
  lookups of names S3 has not got are rate-limited and remembered for a few seconds, so a flood
  of made-up names cannot become a flood of S3 requests.

The engine reads an adapter through `load(name)` (on its loader thread) and keeps it in GPU
memory; this module only knows where adapters are and reads them, never unpickling anything
(`fish_sm.model.lora.read_packaged` reads our safetensors form only). It imports no torch: the
batching server's front end resolves names with it (`resolve`), and only an engine core, which
has torch already, reads tensors (`load`, `rank`: `fish_sm.model.lora` is imported there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from fish_sm.contract import ADAPTER_NAME, TTSRequest
from fish_sm.errors import AdapterError, CheckpointError
from fish_sm.model.config import ModelConfig
from fish_sm.serving.errors import Busy, HTTPError, bad_request
from fish_sm.settings import Settings, check_adapter_source

if TYPE_CHECKING:
    from fish_sm.model.lora import Adapter

logger = logging.getLogger("fish_sm.serving")

SUFFIX = ".safetensors"
MAX_S3_BYTES = 1 << 30  # an adapter downloaded from a source; rank 64 on every S1-mini layer is ~200 MB in bf16
MIN_RANK = 8
NEGATIVE_TTL_S = 5.0  # how long "not in any source" is believed (at most FISH_SM_ADAPTER_REFRESH_S)
LOOKUPS_PER_S = 10.0  # S3 lookups of names not yet known, on average...
LOOKUP_BURST = 20  # ...and at once
MAX_REMEMBERED = 10_000  # names remembered as missing (the oldest are forgotten first)
LIST_KEYS = 1000  # keys of a source listed for the names an unknown adapter's error offers
NAMES_IN_MESSAGE = 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DOWNLOAD_PIECE = 1 << 20


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> "S3Source":
        return cls(*check_adapter_source(uri))

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}{SUFFIX}"

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(name) if name else self.prefix}"


@dataclass
class _Found:
    source: S3Source
    checked: float  # clock() when S3 last said it was there
    etag: str = ""  # the object's, then: another means the adapter was replaced


class AdapterRegistry:
    """Where every adapter this server may serve is, and reading one (`load`, for the engine)."""

    def __init__(self, config: ModelConfig, packaged: dict[str, Path] | None = None,
                 sources: Sequence[S3Source] = (), *, voice_adapters: dict[str, str] | None = None,
                 ranks: dict[str, int] | None = None, refresh_s: float = 60.0, s3=None,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int = MAX_S3_BYTES):
        self.config = config
        self.packaged = dict(packaged or {})
        self.sources = tuple(sources)
        self.voice_adapters = dict(voice_adapters or {})
        self.ranks = dict(ranks or {})
        self.refresh_s = refresh_s
        self.negative_ttl_s = min(NEGATIVE_TTL_S, refresh_s)
        self.max_bytes = max_bytes
        self._s3 = s3
        self._clock = clock
        self._lock = threading.Lock()
        self._found: dict[str, _Found] = {}
        self._missing: OrderedDict[str, float] = OrderedDict()  # name -> clock() when no source had it
        self._tokens, self._refilled = float(LOOKUP_BURST), clock()
        self._listed: tuple[float, list[str]] | None = None
        # Told the name of an S3 adapter found removed or replaced (the engine's `AdapterCache.forget`).
        self.on_change: Callable[[str], None] = lambda name: None

    @classmethod
    def from_package(cls, model_dir: Path, config: ModelConfig, settings: Settings, s3=None) -> "AdapterRegistry":
        """The package's adapters (from its verified manifest.json; a plain checkpoint directory has
        none) and the settings' sources. A manifest entry that is not `adapters/NAME.safetensors`
        of a valid name stops the start: nothing in a package points a read elsewhere."""
        manifest = _manifest(model_dir)
        entries = manifest.get("adapters") or {}
        if not isinstance(entries, dict):
            raise CheckpointError("manifest.json: 'adapters' must be an object of NAME: {file, rank, ...}")
        packaged, ranks = {}, {}
        for name, entry in sorted(entries.items()):
            expected = f"adapters/{name}{SUFFIX}"
            if not _valid(name) or \
                    not isinstance(entry, dict) or entry.get("file") != expected:
                raise CheckpointError(f"manifest.json: adapter {str(name)[:80]!r} must be a valid name whose "
                                      f"file is adapters/<name>{SUFFIX}")
            path = model_dir / expected
            if not path.is_file():
                raise CheckpointError(f"manifest.json: adapter {name}: {expected} is missing")
            packaged[name] = path
            rank = entry.get("rank")
            if isinstance(rank, int):
                ranks[name] = rank  # the others' are read from their files if `rank` is asked
        voice_adapters = {}
        voices = manifest.get("voices") or {}
        for voice, entry in (voices.items() if isinstance(voices, dict) else ()):
            adapter = entry.get("adapter") if isinstance(entry, dict) else None
            if adapter is None:
                continue
            if not _valid(adapter):
                raise CheckpointError(f"manifest.json: voice {voice}: adapter {str(adapter)[:80]!r} is not an "
                                      "adapter name")
            voice_adapters[voice] = adapter
        return cls(config, packaged, [S3Source.parse(uri) for uri in settings.adapter_sources],
                   voice_adapters=voice_adapters, ranks=ranks, refresh_s=settings.adapter_refresh_s, s3=s3)

    # -- what is known -------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether there is anything to serve: packaged adapters or a source to look in."""
        return bool(self.packaged or self.sources)

    def rank(self, setting: int = 0) -> int:
        """The largest rank to serve: the setting, else the largest packaged adapter's, at least 8
        (a rank the manifest does not give is read from the file's metadata)."""
        if setting:
            return setting
        from fish_sm.model.lora import read_metadata

        for name, path in self.packaged.items():
            if name not in self.ranks:
                try:
                    self.ranks[name] = int(read_metadata(path).get("rank", 0))
                except (AdapterError, ValueError):
                    self.ranks[name] = 0
        return max([MIN_RANK, *self.ranks.values()])

    def known(self, name: str) -> bool:
        """Whether `name` is an adapter here: packaged, or (as S3 said within the refresh interval)
        in a source. May ask S3; raises `Busy` while unknown names are looked up too fast."""
        if not _valid(name):
            return False
        if name in self.packaged:
            return True
        return bool(self.sources) and self._lookup(name) is not None

    def names(self) -> list[str]:
        """The packaged adapters, then those in the sources (as last listed, or found since)."""
        out = list(self.packaged)
        if self.sources:
            listed = self._listing()
            with self._lock:
                found = list(self._found)
            out += sorted((set(listed) | set(found)) - set(out))
        return out

    def resolve(self, request: TTSRequest, default_voice: str = "") -> TTSRequest:
        """`request` with the adapter it uses: its own "adapter", else the one its voice implies
        (a packaged voice's, the default voice's when it names none and gives no reference).
        An adapter this server does not know is a 400 that names it."""
        name, voice = request.adapter, None
        if name is None:
            voice = request.voice or (default_voice if request.reference is None else None)
            name = self.voice_adapters.get(voice) if voice else None
            if name is None:
                return request
        if not self.known(name):
            implied = f" (implied by voice {voice!r})" if voice else ""
            raise bad_request(f"unknown adapter {name!r}{implied}; {self.describe()}")
        return replace(request, adapter=name) if request.adapter != name else request

    def describe(self) -> str:
        """What the error for an unknown adapter lists: the known names, cut short."""
        names = self.names()
        if not names:
            return "this server has no adapters" + (" (none in its sources)" if self.sources else "")
        shown = ", ".join(names[:NAMES_IN_MESSAGE])
        more = f" and {len(names) - NAMES_IN_MESSAGE} more" if len(names) > NAMES_IN_MESSAGE else ""
        return f"known adapters: {shown}{more}"

    # -- reading one (the engine's loader thread) ------------------------------------------

    def load(self, name: str) -> Adapter:
        """Read adapter `name`: the packaged file, or a verified download from its source.
        Every failure is an `AdapterError` whose message names the adapter, not a path."""
        from fish_sm.model.lora import read_packaged

        if not _valid(name):
            raise AdapterError(f"adapter name {name[:80]!r} is not valid")
        path = self.packaged.get(name)
        if path is not None:
            try:
                return read_packaged(path, name, self.config)
            except AdapterError as exc:
                raise AdapterError(str(exc).replace(str(path), f"packaged adapter {name}")) from None
        with self._lock:
            found = self._found.get(name)
        if found is None:
            source = self._lookup_for_load(name)
            if source is None:
                raise AdapterError(f"adapter {name!r} is in none of this server's sources")
        else:
            source = found.source
        return self._download(name, source)

    def _download(self, name: str, source: S3Source) -> Adapter:
        from botocore.exceptions import BotoCoreError, ClientError

        where = source.uri(name)
        # A private (0700) directory of its own, removed with the file once read.
        directory = Path(tempfile.mkdtemp(prefix="fish-sm-adapter-"))
        path = directory / f"{name}{SUFFIX}"
        try:
            try:
                obj = self.s3.get_object(Bucket=source.bucket, Key=source.key(name))
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code in ("NoSuchKey", "404", "NotFound"):
                    with self._lock:
                        self._found.pop(name, None)
                    self.on_change(name)
                raise AdapterError(f"adapter {name!r}: cannot read {where} ({code or exc})") from None
            body = obj["Body"]
            try:
                size = int(obj.get("ContentLength") or 0)
                if size > self.max_bytes:
                    raise AdapterError(f"adapter {name!r}: {where} is {size} bytes; the limit is {self.max_bytes}")
                expected = (obj.get("Metadata") or {}).get("sha256", "").lower()
                if not _SHA256.fullmatch(expected):
                    raise AdapterError(f"adapter {name!r}: {where} has no sha256 metadata (x-amz-meta-sha256, the "
                                       "hex sha256 of its bytes; fish-sm adapters add sets it)")
                digest, written = hashlib.sha256(), 0
                with open(path, "xb") as f:
                    for piece in iter(lambda: body.read(_DOWNLOAD_PIECE), b""):
                        written += len(piece)
                        if written > self.max_bytes:
                            raise AdapterError(f"adapter {name!r}: {where} is over the {self.max_bytes} byte limit")
                        digest.update(piece)
                        f.write(piece)
            except (BotoCoreError, OSError) as exc:
                raise AdapterError(f"adapter {name!r}: the download of {where} failed ({type(exc).__name__})") from None
            finally:
                body.close()
            if digest.hexdigest() != expected:
                raise AdapterError(f"adapter {name!r}: {where} does not match its sha256 metadata "
                                   f"(got {digest.hexdigest()[:12]}..., expected {expected[:12]}...)")
            from fish_sm.model.lora import read_packaged

            try:
                return read_packaged(path, name, self.config)
            except AdapterError as exc:
                raise AdapterError(str(exc).replace(str(path), where)) from None
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # -- S3 lookups --------------------------------------------------------------------

    @property
    def s3(self):
        if self._s3 is None:
            from fish_sm.serving.s3 import s3_client

            self._s3 = s3_client()
        return self._s3

    def _lookup(self, name: str) -> S3Source | None:
        """The source holding `name`, as S3 said within the refresh interval (asked again after)."""
        now = self._clock()
        with self._lock:
            found = self._found.get(name)
            if found is not None and now - found.checked < self.refresh_s:
                return found.source
            missed = self._missing.get(name)
            if missed is not None and now - missed < self.negative_ttl_s:
                return None
            if found is None and not self._take_token(now):
                # A name nobody has found yet, while such lookups come too fast: not asked, not answered.
                raise Busy(f"too many lookups of adapters not known yet; adapter {name!r} was not looked up", 1)
        return self._head(name, now)

    def _lookup_for_load(self, name: str) -> S3Source | None:
        try:
            return self._lookup(name)
        except HTTPError as exc:
            raise AdapterError(f"adapter {name!r}: {exc.message}") from None

    def _take_token(self, now: float) -> bool:
        self._tokens = min(LOOKUP_BURST, self._tokens + (now - self._refilled) * LOOKUPS_PER_S)
        self._refilled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _head(self, name: str, now: float) -> S3Source | None:
        """Ask each source in turn for `<prefix>NAME.safetensors`; remember the answer."""
        from botocore.exceptions import BotoCoreError, ClientError

        holder, etag = None, ""
        for source in self.sources:
            try:
                etag = self.s3.head_object(Bucket=source.bucket, Key=source.key(name)).get("ETag", "")
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                # 403: S3's answer for a missing key to a role that may not list the bucket.
                if code in ("404", "NoSuchKey", "NotFound", "403", "AccessDenied", "Forbidden"):
                    continue
                raise HTTPError(503, f"cannot look up adapter {name!r} in {source.uri()} ({code or exc})") from None
            except BotoCoreError as exc:
                raise HTTPError(503, f"cannot look up adapter {name!r} in {source.uri()} "
                                     f"({type(exc).__name__})") from None
            holder = source
            break
        changed = False
        with self._lock:
            before = self._found.get(name)
            if holder is not None:
                self._found[name] = _Found(holder, now, etag)
                self._missing.pop(name, None)
                changed = before is not None and (before.source, before.etag) != (holder, etag)
            else:
                if self._found.pop(name, None) is not None:
                    logger.info("adapter %s is no longer in the sources", name)
                    changed = True
                self._missing[name] = now
                self._missing.move_to_end(name)
                while len(self._missing) > MAX_REMEMBERED:
                    self._missing.popitem(last=False)
        if changed:
            self.on_change(name)
        return holder

    def _listing(self) -> list[str]:
        """Adapter names directly under each source's prefix (its first LIST_KEYS keys), listed
        at most once per refresh interval; a source the server may not list adds none."""
        from botocore.exceptions import BotoCoreError, ClientError

        now = self._clock()
        with self._lock:
            if self._listed is not None and now - self._listed[0] < max(self.refresh_s, NEGATIVE_TTL_S):
                return self._listed[1]
            self._listed = (now, self._listed[1] if self._listed else [])  # one listing at a time
        names: list[str] = []
        for source in self.sources:
            try:
                page = self.s3.list_objects_v2(Bucket=source.bucket, Prefix=source.prefix, MaxKeys=LIST_KEYS)
            except (ClientError, BotoCoreError) as exc:
                logger.info("cannot list %s for adapter names: %s", source.uri(), exc)
                continue
            for obj in page.get("Contents", ()):
                stem = obj["Key"][len(source.prefix):]
                if stem.endswith(SUFFIX) and _valid(stem[: -len(SUFFIX)]):
                    names.append(stem[: -len(SUFFIX)])
        names = sorted(set(names))
        with self._lock:
            self._listed = (now, names)
        return names


def _valid(name) -> bool:
    return isinstance(name, str) and ADAPTER_NAME.fullmatch(name) is not None and ".." not in name


def _manifest(model_dir: Path) -> dict:
    path = model_dir / "manifest.json"
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"manifest.json cannot be read ({exc})") from None
    return doc if isinstance(doc, dict) else {}


def resolve_adapters(registry: AdapterRegistry | None, requests: list[TTSRequest],
                     default_voice: str = "") -> list[TTSRequest]:
    """The requests with the adapter each uses (named, or implied by its voice), every one known
    to `registry` (None: a server without adapters): an unknown adapter is a 400 naming it,
    before any synthesis. May ask S3 (run it off an event loop)."""
    if registry is None:
        for request in requests:
            if request.adapter is not None:
                raise bad_request(f"unknown adapter {request.adapter!r}; this server has no adapters")
        return requests
    return [registry.resolve(r, default_voice) for r in requests]


def adapter_label(requests: list[TTSRequest]) -> str | None:
    """The adapter a request's metrics line is counted under: the one its requests use (several
    adapters in one JSON Lines body: none), None without."""
    names = {r.adapter for r in requests if r.adapter is not None}
    return names.pop() if len(names) == 1 else None

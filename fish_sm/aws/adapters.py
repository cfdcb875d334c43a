"""An endpoint's LoRA adapters: those in its package (manifest.json's "adapters") and those in its
adapter sources (`FISH_SM_ADAPTER_SOURCES` in the model's environment: S3 prefixes where adapter
NAME is the object `<prefix>NAME.safetensors`, fish-sm's packaged form, with user metadata
`sha256`, which the server checks before reading it). Listed, added and removed here.

A server looks an adapter name it does not know up in its sources, so an adapter added is served
on its first request, and one removed is forgotten within the server's refresh interval
(FISH_SM_ADAPTER_REFRESH_S, a minute). A packaged adapter changes only with a new package and a
redeploy. Checking an adapter's tensors against the base model needs torch, so it is the
caller's: `base_config` gives the base's config.json for it.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.components import describe_component, is_component_endpoint, list_components, require_component
from fish_sm.aws.container import MANIFEST_ENV
from fish_sm.aws.endpoints import describe_or_none, endpoint_config, require_endpoint
from fish_sm.aws.package import package_manifest
from fish_sm.aws.s3 import S3Uri, head_object, parse_s3_uri
from fish_sm.aws.session import AWS, error_code
from fish_sm.contract import check_adapter_name
from fish_sm.errors import InputError

SOURCES_ENV = "FISH_SM_ADAPTER_SOURCES"
SUFFIX = ".safetensors"
SHA256_METADATA = "sha256"  # S3 user metadata: the hex sha256 of the object's bytes
CONFIG_LIMIT = 1 << 20  # config.json is a few KB; a larger one is not read
_DENIED = ("403", "AccessDenied", "Forbidden", "AllAccessDisabled")


@dataclass
class AdapterInfo:
    name: str
    where: str  # "package", or the object's s3:// URI
    rank: int | None = None
    alpha: float | None = None
    bytes: int | None = None

    @property
    def packaged(self) -> bool:
        return self.where == "package"


@dataclass
class EndpointModel:
    """The model an endpoint (or one of its inference components) serves: its package and environment."""

    endpoint: str
    model_name: str
    model_data: S3Uri | None
    env: dict[str, str] = field(default_factory=dict)
    component: str | None = None

    @property
    def sources(self) -> list[S3Uri]:
        return parse_sources(self.env.get(SOURCES_ENV, ""))


def parse_sources(value: str) -> list[S3Uri]:
    """FISH_SM_ADAPTER_SOURCES: comma-separated s3://bucket/prefix/ URIs ('' or 'none': none)."""
    if value.strip().lower() in ("", "none"):
        return []
    return [parse_s3_uri(part.strip(), what=SOURCES_ENV, prefix=True) for part in value.split(",") if part.strip()]


def default_source(model_data: S3Uri, endpoint: str) -> S3Uri:
    """Where `fish-sm deploy` points an endpoint's adapters: adapters/ENDPOINT/ beside its model.tar.gz,
    so a role allowed to read the package's prefix reads them too."""
    folder = model_data.key.rpartition("/")[0]
    return S3Uri(model_data.bucket, f"{folder}/adapters/{endpoint}/" if folder else f"adapters/{endpoint}/")


def source_object(source: S3Uri, name: str) -> S3Uri:
    return source.join(check_adapter_name(name, InputError) + SUFFIX)


def endpoint_model(aws: AWS, endpoint: str, component: str | None = None) -> EndpointModel:
    """The endpoint's model (of inference component `component`, or of its only one)."""
    ep = require_endpoint(aws, endpoint)
    config = endpoint_config(aws, ep)
    if is_component_endpoint(config):
        if component is None:
            names = list_components(aws, endpoint)
            if len(names) != 1:
                raise AWSError(f"endpoint {endpoint} has {len(names)} inference components"
                               + (f" ({', '.join(names)})" if names else "") + ": name one with --component")
            component = names[0]
            desc = describe_component(aws, component)
        else:
            desc = require_component(aws, endpoint, component)
        model_name = ((desc or {}).get("Specification") or {}).get("ModelName")
    elif component is not None:
        raise InputError(f"endpoint {endpoint} has no inference components: leave out --component")
    else:
        model_name = config["ProductionVariants"][0].get("ModelName")
    model = describe_or_none(aws.sagemaker.describe_model, ModelName=model_name) if model_name else None
    if model is None:
        raise AWSError(f"endpoint {endpoint}'s model {model_name!r} does not exist any more")
    container = model.get("PrimaryContainer") or (model.get("Containers") or [{}])[0]
    url = container.get("ModelDataUrl")
    return EndpointModel(endpoint, model_name, parse_s3_uri(url, what="the model's ModelDataUrl") if url else None,
                         dict(container.get("Environment") or {}), component)


def read_package_manifest(aws: AWS, model: EndpointModel) -> dict:
    """The manifest.json of the package the endpoint serves (ranged GETs of its model.tar.gz's start),
    checked against the sha256 deploy pinned: an object replaced since is not the endpoint's package."""
    if model.model_data is None:
        raise AWSError(f"endpoint {model.endpoint}'s model {model.model_name} has no model data in S3")
    raw = _s3(lambda: package_manifest(aws, model.model_data), "read", model.model_data)
    pinned = model.env.get(MANIFEST_ENV)
    if pinned and hashlib.sha256(raw).hexdigest() != pinned.lower():
        raise AWSError(f"{model.model_data} is no longer the package endpoint {model.endpoint} serves (its "
                       f"manifest.json differs from the pinned {MANIFEST_ENV}); was it overwritten?")
    return json.loads(raw)


def packaged_adapters(manifest: dict) -> list[AdapterInfo]:
    table = manifest.get("adapters") or {}
    return [AdapterInfo(name, "package", entry.get("rank"), entry.get("alpha"), entry.get("bytes"))
            for name, entry in sorted(table.items()) if isinstance(entry, dict)]


def source_adapters(aws: AWS, source: S3Uri) -> list[AdapterInfo]:
    """The adapters in one source: its NAME.safetensors objects (not those in folders under it), each
    with the rank and alpha its upload recorded (unknown for objects put there some other way)."""
    def listing():
        pages = aws.s3.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=source.key)
        return [obj for page in pages for obj in page.get("Contents", [])]

    found = []
    for obj in _s3(listing, "list", source):
        rest = obj["Key"][len(source.key):]
        name = rest[: -len(SUFFIX)] if rest.endswith(SUFFIX) else None
        if name and "/" not in name and _valid_name(name):
            found.append((name, obj))
    uris = [S3Uri(source.bucket, obj["Key"]) for _, obj in found]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(uris)))) as pool:
        heads = list(pool.map(lambda uri: _s3(lambda: head_object(aws, uri), "read", uri), uris))
    out = []
    for (name, obj), uri, head in zip(found, uris, heads):
        meta = (head or {}).get("Metadata") or {}
        out.append(AdapterInfo(name, str(uri), _number(meta.get("rank"), int), _number(meta.get("alpha"), float),
                               obj.get("Size")))
    return out


def list_adapters(aws: AWS, model: EndpointModel, log: Log = quiet) -> list[AdapterInfo]:
    """Packaged adapters first, then each source's in order (the order a server looks them up in).
    A package these credentials cannot read is left out with a note."""
    try:
        packaged = packaged_adapters(read_package_manifest(aws, model))
    except AWSError as exc:
        if not str(exc).startswith("no access"):
            raise
        log(f"note: {exc}; its packaged adapters are not listed")
        packaged = []
    return packaged + [a for source in model.sources for a in source_adapters(aws, source)]


def base_config(aws: AWS, model: EndpointModel, manifest: dict, log: Log = quiet) -> dict:
    """The base model's config.json: from the manifest (fish-sm package writes it there), else, for a
    package built before it did, read from the tarball, which is streamed only until config.json
    (after the code and the codec's weights, so this can take a while)."""
    if isinstance(manifest.get("config"), dict):
        return manifest["config"]
    log(f"note: the manifest of {model.model_data} carries no config (an older package): reading config.json "
        "from the tarball, which streams the code and codec before it")

    def stream():
        body = aws.s3.get_object(Bucket=model.model_data.bucket, Key=model.model_data.key)["Body"]
        try:
            with tarfile.open(fileobj=body, mode="r|gz") as tar:
                for member in tar:
                    if member.name in ("config.json", "./config.json"):
                        if not member.isreg() or member.size > CONFIG_LIMIT:
                            break
                        return json.loads(tar.extractfile(member).read())
        except (tarfile.TarError, OSError, ValueError) as exc:
            raise AWSError(f"{model.model_data}: cannot read config.json from it ({exc})") from None
        finally:
            body.close()
        raise AWSError(f"{model.model_data} holds no config.json (not a fish-sm package?)")

    return _s3(stream, "read", model.model_data)


def add_adapter(aws: AWS, model: EndpointModel, name: str, path: Path, *, rank: int, alpha: float,
                packaged: set[str], source: S3Uri | None = None) -> S3Uri:
    """Upload an adapter already in fish-sm's packaged form (checked by the caller) to the endpoint's
    first source (or `source`, one of them) as NAME.safetensors with its sha256 as user metadata.
    Refused: a name the package holds, or one a source holds already (remove it first)."""
    check_adapter_name(name, InputError)
    sources = _require_sources(model)
    if source is not None and source not in sources:
        raise InputError(f"--source {source} is not one of endpoint {model.endpoint}'s adapter sources "
                         f"({', '.join(map(str, sources))})")
    if name in packaged:
        raise InputError(f"adapter {name} is packaged with endpoint {model.endpoint}'s model; choose another name")
    for s in sources:
        uri = source_object(s, name)
        if _s3(lambda: head_object(aws, uri), "read", uri) is not None:
            raise InputError(f"adapter {name} exists already at {uri}; remove it first "
                             f"(`fish-sm adapters remove {model.endpoint} {name}`)")
    target = source_object(source or sources[0], name)
    digest = _sha256(Path(path))
    extra = {"ContentType": "application/octet-stream",
             "Metadata": {SHA256_METADATA: digest, "rank": str(rank), "alpha": repr(float(alpha))}}
    _s3(lambda: aws.s3.upload_file(str(path), target.bucket, target.key, ExtraArgs=extra), "write", target)
    return target


def remove_adapter(aws: AWS, model: EndpointModel, name: str, packaged: set[str]) -> list[S3Uri]:
    """Delete NAME from every source that holds it; a packaged adapter is an error that says how."""
    check_adapter_name(name, InputError)
    sources = model.sources
    held = [uri for uri in (source_object(s, name) for s in sources)
            if _s3(lambda: head_object(aws, uri), "read", uri) is not None]
    if not held:
        if name in packaged:
            raise InputError(f"adapter {name} is packaged with endpoint {model.endpoint}'s model: build a package "
                             f"without it (fish-sm package) and redeploy (fish-sm deploy {model.endpoint} ...)")
        where = ", ".join(map(str, sources)) or f"no adapter source ({SOURCES_ENV} is not set)"
        raise InputError(f"endpoint {model.endpoint} has no adapter {name} (sources: {where})")
    for uri in held:
        _s3(lambda: aws.s3.delete_object(Bucket=uri.bucket, Key=uri.key), "delete", uri)
    return held


def as_json(model: EndpointModel, adapters: list[AdapterInfo]) -> dict:
    return {"endpoint": model.endpoint, "component": model.component, "model": model.model_name,
            "model_data": str(model.model_data) if model.model_data else None,
            "sources": [str(s) for s in model.sources], "adapters": [asdict(a) for a in adapters]}


def _require_sources(model: EndpointModel) -> list[S3Uri]:
    sources = model.sources
    if not sources:
        raise AWSError(f"endpoint {model.endpoint} has no adapter source ({SOURCES_ENV} is not set on its model "
                       f"{model.model_name}): redeploy it with fish-sm deploy, which sets one, or with "
                       "--adapter-source s3://BUCKET/PREFIX/")
    return sources


def _s3(call, action: str, uri: S3Uri):
    """call(), with S3's access denied said in one line naming the object or prefix."""
    try:
        return call()
    except Exception as exc:
        code = error_code(exc) or _wrapped_code(exc)
        if code in _DENIED:
            raise AWSError(f"no access to {action} {uri} with these credentials") from None
        if code == "NoSuchBucket":
            raise AWSError(f"bucket {uri.bucket!r} of {uri} does not exist") from None
        raise


def _wrapped_code(exc: BaseException) -> str:
    """boto3's upload_file wraps the ClientError in S3UploadFailedError, keeping only its text."""
    text = str(exc)
    return next((code for code in _DENIED + ("NoSuchBucket",) if f"({code})" in text), "")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _valid_name(name: str) -> bool:
    try:
        check_adapter_name(name, InputError)
    except InputError:
        return False
    return True


def _number(value, kind):
    try:
        return kind(value) if value is not None else None
    except (TypeError, ValueError):
        return None

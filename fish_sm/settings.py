"""Server settings from `FISH_SM_*` environment variables, validated at start.

A bad value stops the worker with a message naming the variable, instead of serving
with a setting nobody asked for.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from fish_sm.errors import ConfigError

PREFIX = "FISH_SM_"


def _default_cache_dir() -> str:
    # /opt/ml/model is read-only on SageMaker, /opt/ml itself is not.
    opt_ml = Path("/opt/ml")
    if opt_ml.is_dir() and os.access(opt_ml, os.W_OK):
        return str(opt_ml / "fish-sm-cache")
    return str(Path.home() / ".cache" / "fish-sm")


@dataclass(frozen=True)
class Settings:
    quantize: str = "auto"  # auto (int8 on GPU for the mms server; none on CPU and for batching) | int8 | none
    compile: str = "auto"  # auto (on for GPU) | true | false
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32
    default_voice: str = ""  # a packaged voice id used when a request names none
    max_text_chars: int = 5000
    max_reference_seconds: float = 60.0
    max_reference_bytes: int = 20 * 1024 * 1024
    max_new_tokens: int = 2048  # per text chunk; a request may ask for less
    max_seq_len: int = 0  # 0 = the model's
    warmup: int = 2  # syntheses run by model_fn before the server reports healthy
    cache_dir: str = field(default_factory=_default_cache_dir)
    allowed_buckets: tuple[str, ...] = ()  # S3 buckets references may come from; empty = none
    log_level: str = "INFO"
    ready_dir: str = ""  # set by `fish-sm serve`: where workers mark themselves ready
    model_dir: str = ""  # the package to serve; set by `fish-sm serve` (MMS itself gets an empty directory)
    host: str = "0.0.0.0"  # the address deploy/serve listens on (all interfaces, inside a container)
    server: str = "batching"  # what deploy/serve runs: batching (aiohttp, continuous batching) | mms
    max_batch: int = 0  # batching server: most requests held per GPU; 0: as many as the GPU memory holds (8 on a CPU)
    # batching server: seconds of audio a stream may have ahead of its listener before it yields
    # its turn to others (0: every stream decodes at every step)
    stream_horizon_s: float = 2.0
    step_rows: int = 0  # batching server: most requests one decode step takes (0: every one that wants a frame)
    # batching server: codec pieces of each length on a stream's ramp (4, 4, 4, 8, ... frames)
    # before the next, twice as long: 1 needs a stream to decode at twice real time on its ramp,
    # more than a loaded GPU's steps give
    piece_repeats: int = 3
    max_queue: int = 64  # batching server: requests that may wait for a slot; more get 503 + Retry-After
    prefix_cache: int = 8  # reference-voice prompt prefills kept on the GPU
    # the streamed codec on a GPU: auto (both halves in float16; 47 dB SNR against float32 on
    # S1-mini's shapes) | float32 (the codec's own precision throughout)
    codec_precision: str = "auto"
    # batching server on a GPU: early (/ping healthy once the graphs of a few rows are captured; the
    # others while serving, when idle or when the load needs them) | all (every graph before /ping)
    capture: str = "early"
    max_lines: int = 256  # lines a JSON Lines body may hold; more is a 413
    # bidirectional sessions: seconds with no message from the client and nothing left to speak
    # before the server closes it (the platform's pings do not count), and the longest a session may last
    session_idle_s: float = 60.0
    session_max_s: float = 3600.0
    header_timeout: float = 10.0  # seconds a client may take to send a request's headers
    body_timeout: float = 60.0  # seconds a client may take to send a request's body
    manifest_sha256: str = ""  # set by deploy: the sha256 the package's manifest.json must have
    # Benchmarks only: a request is never ended by <|im_end|>, only by its
    # max_new_tokens, so random weights (which stop at random frames) still load the GPU with
    # the lengths a capacity run intends. Never set it on a service: every request runs to its cap.
    benchmark_lengths: bool = False
    # emf: one CloudWatch Embedded Metric Format line on stdout per request and every few seconds
    # of server state (SageMaker ships stdout to CloudWatch Logs, which makes them metrics) | off
    metrics: str = "emf"
    # LoRA adapters beside the packaged ones: comma-separated s3://bucket/prefix/ (the allow-list: a
    # request names an adapter, the object <prefix><NAME>.safetensors of the first source holding it)
    adapter_sources: tuple[str, ...] = ()
    adapter_memory: int = 2 << 30  # bytes of GPU (or CPU) memory for resident adapters; 2GiB, 512MiB or bytes
    adapter_rank: int = 0  # the largest rank served; 0: the largest packaged adapter's, at least 8
    # seconds a source's answer is trusted (an adapter there, or not) before S3 is asked again
    adapter_refresh_s: float = 60.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        known = {PREFIX + f.name.upper(): f for f in fields(cls)}
        values = {}
        for key, raw in env.items():
            if not key.startswith(PREFIX):
                continue
            if key not in known:
                raise ConfigError(f"unknown setting {key}; known: {', '.join(sorted(known))}")
            f = known[key]
            values[f.name] = _parse(key, raw, f.type)
        s = cls(**values)
        s.validate()
        return s

    def validate(self) -> None:
        choices = {"quantize": ("auto", "int8", "none"), "compile": ("auto", "true", "false"),
                   "dtype": ("auto", "bf16", "fp16", "fp32"), "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
                   "server": ("batching", "mms"), "codec_precision": ("auto", "float32"), "capture": ("early", "all"),
                   "metrics": ("emf", "off")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{PREFIX}{name.upper()}={getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        for name in ("max_text_chars", "max_reference_bytes", "max_new_tokens", "max_lines"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{PREFIX}{name.upper()} must be at least 1")
        for name in ("max_batch", "step_rows", "stream_horizon_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{PREFIX}{name.upper()} must not be negative")
        if not 1 <= self.piece_repeats <= 4:
            raise ConfigError(f"{PREFIX}PIECE_REPEATS must be 1 to 4")
        if self.max_reference_seconds <= 0 or self.warmup < 0 or self.max_seq_len < 0:
            raise ConfigError(f"{PREFIX}MAX_REFERENCE_SECONDS must be positive, WARMUP and MAX_SEQ_LEN not negative")
        if self.max_queue < 0 or self.prefix_cache < 0:
            raise ConfigError(f"{PREFIX}MAX_QUEUE and {PREFIX}PREFIX_CACHE must not be negative")
        if not (0 < self.session_idle_s <= 3600 and 0 < self.session_max_s <= 86400):
            raise ConfigError(f"{PREFIX}SESSION_IDLE_S must be in (0, 3600] seconds, {PREFIX}SESSION_MAX_S in (0, 86400]")
        if not (0 < self.header_timeout <= 3600 and 0 < self.body_timeout <= 3600):
            raise ConfigError(f"{PREFIX}HEADER_TIMEOUT and {PREFIX}BODY_TIMEOUT must be in (0, 3600] seconds")
        for source in self.adapter_sources:
            check_adapter_source(source)
        if self.adapter_memory < 1 or self.adapter_rank < 0 or self.adapter_refresh_s < 0:
            raise ConfigError(f"{PREFIX}ADAPTER_MEMORY must be positive, {PREFIX}ADAPTER_RANK and "
                              f"{PREFIX}ADAPTER_REFRESH_S not negative")
        if self.adapter_rank > 256:
            raise ConfigError(f"{PREFIX}ADAPTER_RANK={self.adapter_rank}: ranks up to 256 are served")
        if self.manifest_sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.manifest_sha256):
            raise ConfigError(f"{PREFIX}MANIFEST_SHA256 must be 64 lowercase hex digits")

    def use_quantize(self, device_type: str, batching: bool = False) -> bool:
        """auto: INT8 for one request at a time on a GPU; not for the batching server, where
        torchao's INT8 kernel for several rows at once is far slower than bf16 (H100: 283 us
        per call at 32 rows, two thirds of the step; see docs/benchmarks.md)."""
        return self.quantize == "int8" or (self.quantize == "auto" and device_type == "cuda" and not batching)

    def use_compile(self, device_type: str) -> bool:
        return self.compile == "true" or (self.compile == "auto" and device_type == "cuda")


# s3://bucket/prefix/: a bucket name as S3 allows it, a prefix (possibly empty) that ends with "/".
_ADAPTER_SOURCE = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/((?:[^/]+/)*)")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(|b|kib|mib|gib|tib|kb|mb|gb|tb)", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def check_adapter_source(source: str) -> tuple[str, str]:
    """(bucket, prefix) of an FISH_SM_ADAPTER_SOURCES entry, which must be s3://bucket/prefix/."""
    match = _ADAPTER_SOURCE.fullmatch(source)
    if match is None or ".." in source[5:] or "//" in source[5:]:
        raise ConfigError(f"{PREFIX}ADAPTER_SOURCES: {source[:200]!r} is not an s3://bucket/prefix/ URI "
                          "(a bucket, then a prefix ending with '/')")
    return match.group(1), match.group(2)


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5GB' or a plain integer."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(text)
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _parse(key: str, raw: str, type_name: str):
    raw = raw.strip()
    try:
        if key == PREFIX + "ADAPTER_MEMORY":
            return parse_size(raw)
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name.startswith("tuple"):
            return tuple(b.strip() for b in raw.split(",") if b.strip())
        if type_name == "bool":
            return {"true": True, "false": False}[raw.lower()]
    except (ValueError, KeyError):
        kind = "size (such as 2GiB, 512MiB or a number of bytes)" if key == PREFIX + "ADAPTER_MEMORY" else type_name
        raise ConfigError(f"{key}={raw!r} is not a valid {kind}") from None
    return raw.upper() if key.endswith("LOG_LEVEL") else raw.lower() if key.endswith(("QUANTIZE", "COMPILE", "DTYPE", "SERVER", "MANIFEST_SHA256", "METRICS")) else raw

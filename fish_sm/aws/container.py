"""The model's container: its image, its environment, and what it runs on an instance type.

Our image runs the batching server unless FISH_SM_SERVER=mms; the stock PyTorch image runs
TorchServe with code/inference.py, one worker per GPU.
"""

from __future__ import annotations

import re

from fish_sm.aws import AWSError
from fish_sm.errors import ConfigError, InputError
from fish_sm.settings import PREFIX as SETTINGS_PREFIX, Settings

# TorchServe (stock container) limits: long texts give long audio, and compiles are slow.
TS_TIMEOUT_S = 900
TS_MAX_BYTES = 100 * 1024 * 1024
# The container serves only a package whose manifest.json has this sha256 (fish_sm.package.verify).
MANIFEST_ENV = "FISH_SM_MANIFEST_SHA256"
_ENV_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

def parse_env(pairs) -> dict[str, str]:
    """--env KEY=VALUE pairs -> dict, with SageMaker's key syntax and size limits checked here."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InputError(f"--env must be KEY=VALUE, got {pair!r}")
        if not _ENV_KEY.match(key):
            raise InputError(f"--env {pair!r}: {key!r} is not a valid variable name "
                             "(letters, digits, '_', not starting with a digit)")
        if len(key) > 1024 or len(value) > 1024:
            raise InputError(f"--env {key}: keys and values are limited to 1024 characters")
        env[key] = value
    return env


def check_settings(env: dict[str, str]) -> Settings:
    """The server's settings from the --env pairs, checked as `fish-sm serve` checks them at start
    (an unknown FISH_SM_ name, a bad value), so a typo fails here rather than on the instance.
    A benchmark-only setting never reaches an endpoint."""
    try:
        settings = Settings.from_env({k: v for k, v in env.items() if k.startswith(SETTINGS_PREFIX)})
    except ConfigError as exc:
        raise InputError(f"--env: {exc}") from None
    if settings.benchmark_lengths:
        raise InputError("--env: FISH_SM_BENCHMARK_LENGTHS is for benchmarks only (every request would run to its "
                         "max_new_tokens, never ending at its text's end): an endpoint never sets it")
    return settings


def container_environment(user_env: dict[str, str], *, stock_container: bool, gpus: int) -> dict[str, str]:
    """The model's Environment: ours, then the user's (which wins), FISH_SM_* passed through as is.

    gpus: the instance type's GPUs; the stock container runs one TorchServe worker per GPU (one on a CPU).
    """
    env = {"SAGEMAKER_CONTAINER_LOG_LEVEL": "20"}
    if stock_container:
        workers = max(gpus, 1)
        env.update({
            "SAGEMAKER_PROGRAM": "inference.py",
            "SAGEMAKER_SUBMIT_DIRECTORY": "/opt/ml/model/code",
            "SAGEMAKER_TS_MIN_WORKERS": str(workers),  # one worker (one engine) per GPU
            "SAGEMAKER_TS_MAX_WORKERS": str(workers),
            "SAGEMAKER_TS_RESPONSE_TIMEOUT": str(TS_TIMEOUT_S),
            "SAGEMAKER_MODEL_SERVER_TIMEOUT": str(TS_TIMEOUT_S),
            "TS_DEFAULT_STARTUP_TIMEOUT": str(TS_TIMEOUT_S),
            "TS_MAX_RESPONSE_SIZE": str(TS_MAX_BYTES),
            "TS_MAX_REQUEST_SIZE": str(TS_MAX_BYTES),
            # A request with no Accept reaches output_fn as */*, so its `format` (or WAV) decides,
            # as in our image; the toolkit's own default would be application/json.
            "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "*/*",
        })
    env.update(user_env)
    if len(env) > 100:
        raise InputError(f"SageMaker allows 100 environment variables, this model would have {len(env)}")
    return env


def stock_image_uri(region: str, instance_type: str) -> str:
    """The AWS PyTorch 2.6 inference image for this region/instance, from the optional SDK."""
    try:
        from sagemaker.core import image_uris
    except ImportError:
        raise AWSError("--stock-container looks up the PyTorch inference image with the sagemaker SDK (v3), "
                       "which is not installed: pip install 'fish-sm[sdk]', or pass the image with --image URI") from None
    try:
        return image_uris.retrieve(framework="pytorch", region=region, version="2.6", py_version="py312",
                                   instance_type=instance_type, image_scope="inference")
    except (ValueError, KeyError) as exc:
        raise AWSError(f"no stock PyTorch 2.6 inference image for {instance_type} in {region}: {exc}") from None


def server_kind(env: dict[str, str], *, stock_container: bool) -> str:
    """What answers requests on the endpoint: 'mms' (one request per GPU worker) or 'batching'."""
    if stock_container or env.get("FISH_SM_SERVER", "").strip().lower() == "mms":
        return "mms"
    return "batching"


def max_batch(env: dict[str, str]) -> int:
    """The batching server's slots per GPU: FISH_SM_MAX_BATCH in `env`, else the server's default."""
    return check_settings(env).max_batch

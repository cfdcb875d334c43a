"""The model's container: its image, its environment, and what it runs on an instance type.

Our image runs the batching server unless FISH_SM_SERVER=mms; the stock PyTorch image runs
TorchServe with code/inference.py, one worker per GPU.
"""

from __future__ import annotations

import re

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.errors import InputError
from fish_sm.settings import Settings

# TorchServe (stock container) limits: long texts give long audio, and compiles are slow.
TS_TIMEOUT_S = 900
TS_MAX_BYTES = 100 * 1024 * 1024
# The container serves only a package whose manifest.json has this sha256 (fish_sm.package.verify).
MANIFEST_ENV = "FISH_SM_MANIFEST_SHA256"
_ENV_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# GPUs per instance type, for one TorchServe worker per GPU in the stock container.
GPUS_PER_INSTANCE = {
    **{f"ml.g4dn.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "ml.g4dn.12xlarge": 4,
    **{f"ml.{f}.{s}": 1 for f in ("g5", "g6", "g6e") for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    **{f"ml.{f}.{s}": 4 for f in ("g5", "g6", "g6e") for s in ("12xlarge", "24xlarge")},
    **{f"ml.{f}.48xlarge": 8 for f in ("g5", "g6", "g6e")},
    "ml.p4d.24xlarge": 8, "ml.p4de.24xlarge": 8,
    "ml.p5.48xlarge": 8, "ml.p5e.48xlarge": 8, "ml.p5en.48xlarge": 8,
}


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


def gpu_count(instance_type: str) -> tuple[int, bool]:
    """(GPUs on the instance type, whether the type is in our table); unknown types count as 1."""
    if instance_type in GPUS_PER_INSTANCE:
        return GPUS_PER_INSTANCE[instance_type], True
    return 1, False


def container_environment(user_env: dict[str, str], *, stock_container: bool, instance_type: str,
                          log: Log = quiet) -> dict[str, str]:
    """The model's Environment: ours, then the user's (which wins), FISH_SM_* passed through as is."""
    env = {"SAGEMAKER_CONTAINER_LOG_LEVEL": "20"}
    if stock_container:
        gpus, known = gpu_count(instance_type)
        if not known:
            log(f"note: {instance_type} is not in fish-sm's GPU table; starting 1 TorchServe worker "
                "(set SAGEMAKER_TS_MIN_WORKERS/MAX_WORKERS with --env to change)")
        env.update({
            "SAGEMAKER_PROGRAM": "inference.py",
            "SAGEMAKER_SUBMIT_DIRECTORY": "/opt/ml/model/code",
            "SAGEMAKER_TS_MIN_WORKERS": str(gpus),  # one worker (one engine) per GPU
            "SAGEMAKER_TS_MAX_WORKERS": str(gpus),
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
    raw = env.get("FISH_SM_MAX_BATCH")
    if raw is None:
        return Settings.max_batch
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"--env FISH_SM_MAX_BATCH={raw!r} must be a whole number of at least 1")
    return value

"""SageMaker endpoints: create or blue/green-update, autoscale, wait, describe, delete.

Every deploy makes a new model and endpoint config named NAME-<UTC timestamp>, so an update
can be rolled back to the previous config, and `delete` finds everything a deploy made by
that naming (plus the fish-sm/NAME/ alarm prefix and the endpoint's scalable target).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from fish_sm.aws import AWSError
from fish_sm.aws.package import read_tarball_manifest
from fish_sm.aws.s3 import S3Uri, head_object
from fish_sm.aws.session import AWS, error_code, is_not_found
from fish_sm.errors import InputError

VARIANT = "AllTraffic"  # blue/green updates require the same variant name in the new config
DIMENSION = "sagemaker:variant:DesiredInstanceCount"
TAG_KEY = "fish-sm:endpoint"
POLICY_PREFIX = "fish-sm-"
WAKE_POLICY = "fish-sm-wake-from-zero"

# Warm-up (loading 3.6 GB of weights, torch.compile) takes minutes; SageMaker's defaults
# would kill the container before its first /ping succeeds.
STARTUP_TIMEOUT_S = 1800
DOWNLOAD_TIMEOUT_S = 1800
# TorchServe (stock container) limits: long texts give long audio, and compiles are slow.
TS_TIMEOUT_S = 900
TS_MAX_BYTES = 100 * 1024 * 1024
# The container serves only a package whose manifest.json has this sha256 (fish_sm.package.verify).
MANIFEST_ENV = "FISH_SM_MANIFEST_SHA256"

_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_STAMP_LEN = 17  # YYYYmmddHHMMSS + milliseconds
MAX_NAME = 63 - 1 - _STAMP_LEN
_ENV_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_ROLE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$")
_SNS = re.compile(r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[\w-]+$")

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

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def check_name(name: str, *, for_deploy: bool = False) -> str:
    if not _NAME.match(name or ""):
        raise InputError(f"endpoint name {name!r} must be letters, digits and single or repeated '-' "
                         "between them, at most 63 characters")
    if for_deploy and len(name) > MAX_NAME:
        raise InputError(f"endpoint name {name!r} is {len(name)} characters; at most {MAX_NAME}, so that "
                         f"its model and config names (NAME-<timestamp>) fit SageMaker's 63")
    return name


def new_stamp() -> str:
    """UTC time to the millisecond: unique per deploy, and sorts by age."""
    now = time.time()
    return time.strftime("%Y%m%d%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}"


def owned(name: str, resource: str) -> bool:
    """Whether a model/config name is one a deploy of endpoint `name` made."""
    return re.fullmatch(re.escape(name) + r"-\d{%d}" % _STAMP_LEN, resource) is not None


def resource_id(name: str) -> str:
    return f"endpoint/{name}/variant/{VARIANT}"


def rollback_alarm_name(name: str) -> str:
    return f"fish-sm/{name}/invocation-5xx"


def wake_alarm_name(name: str) -> str:
    return f"fish-sm/{name}/has-backlog-without-capacity"


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
                          log: Log = _quiet) -> dict[str, str]:
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


@dataclass
class Autoscaling:
    """Target tracking on one metric between min and max instances (min 0: async scale-to-zero)."""

    min: int
    max: int
    target: float
    metric: str  # concurrency | invocations | backlog
    reason: str = ""  # why this target: --target, or how the default was worked out

    @property
    def scale_to_zero(self) -> bool:
        return self.min == 0


# Defaults for servers that answer one request at a time per GPU worker (the multi-model
# server, the stock container's TorchServe), and for the metrics that do not follow slots.
DEFAULT_TARGETS = {"concurrency": 2.0, "invocations": 60.0, "backlog": 2.0}
METRIC_UNITS = {"concurrency": "concurrent requests per instance", "invocations": "invocations per instance a minute",
                "backlog": "queued requests per instance"}
# The batching server decodes up to FISH_SM_MAX_BATCH requests together on each GPU. Scaling
# out at half of those slots keeps each stream fast and leaves room for a burst while new
# instances start (minutes), before requests queue and, past FISH_SM_MAX_QUEUE, get 503: on
# an H100 at 32 of 64 streams each stream still decodes at >= 6x real time with first audio
# p95 ~0.12 s (0.3 s through HTTP); at 64, 4x and ~0.3 s (docs/benchmarks.md, sixth pass).
BATCH_TARGET_SHARE = 0.5
DEFAULT_MAX_BATCH = 64  # FISH_SM_MAX_BATCH's default in fish_sm.settings (not imported: no torch here)


def server_kind(env: dict[str, str], *, stock_container: bool) -> str:
    """What answers requests on the endpoint: 'mms' (one request per GPU worker) or 'batching'."""
    if stock_container or env.get("FISH_SM_SERVER", "").strip().lower() == "mms":
        return "mms"
    return "batching"


def _max_batch(env: dict[str, str]) -> int:
    raw = env.get("FISH_SM_MAX_BATCH")
    if raw is None:
        return DEFAULT_MAX_BATCH
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"--env FISH_SM_MAX_BATCH={raw!r} must be a whole number of at least 1")
    return value


def default_target(metric: str, *, instance_type: str, env: dict[str, str] | None = None,
                   stock_container: bool = False) -> tuple[float, str]:
    """The target value when --target is not given, and a short reason to print.

    Concurrency on our image: half of the batch slots (FISH_SM_MAX_BATCH x GPUs). On the
    multi-model server, and for invocations a minute (which depend on how long the texts
    are, so slots say little about them) or async backlog: the fixed DEFAULT_TARGETS.
    """
    env = env or {}
    server = server_kind(env, stock_container=stock_container)
    if metric == "concurrency" and server == "batching":
        max_batch = _max_batch(env)
        gpus, known = gpu_count(instance_type)
        value = max_batch * gpus * BATCH_TARGET_SHARE
        return value, (f"{BATCH_TARGET_SHARE:.0%} of the batching server's {max_batch * gpus} slots: "
                       f"{gpus} GPU{'s' if gpus > 1 else ''} x FISH_SM_MAX_BATCH {max_batch}"
                       + ("" if known else f"; {instance_type} is not in fish-sm's GPU table, counted as 1 GPU"))
    if metric == "concurrency":
        why = ("the multi-model server (--stock-container, FISH_SM_SERVER=mms) answers one request at a time "
               "per GPU worker")
    elif metric == "invocations":
        why = ("fish-sm's default; invocations a minute depend on text length: set --target from "
               "`fish-sm bench` req/s x 60")
    else:
        why = "fish-sm's default for asynchronous endpoints"
    return DEFAULT_TARGETS[metric], why


def make_autoscaling(*, instances: int, min_instances: int | None, max_instances: int | None,
                     target: float | None, metric: str, is_async: bool, scale_to_zero: bool,
                     instance_type: str, env: dict[str, str] | None = None,
                     stock_container: bool = False) -> Autoscaling | None:
    """Check the autoscaling options together; None when none were asked for.

    instance_type, env and stock_container pick the default target (see default_target).
    """
    if max_instances is None:
        if scale_to_zero:
            max_instances = max(instances, 1)
        elif min_instances is not None or target is not None:
            raise InputError("autoscaling needs --max (with --min and --target optional)")
        else:
            return None
    if scale_to_zero and not is_async:
        raise InputError("--scale-to-zero needs --async (real-time endpoints cannot scale to zero instances)")
    if scale_to_zero and min_instances not in (None, 0):
        raise InputError("--scale-to-zero sets the minimum to 0; leave out --min")
    lo = 0 if scale_to_zero else (instances if min_instances is None else min_instances)
    if lo < 1 and not scale_to_zero:
        raise InputError("--min must be at least 1 (use --async --scale-to-zero for a minimum of 0)")
    if max_instances < max(lo, 1):
        raise InputError(f"--max ({max_instances}) must be at least --min ({lo}) and at least 1")
    if not lo <= instances <= max_instances:
        raise InputError(f"--instances ({instances}) must lie between the minimum ({lo}) and --max ({max_instances})")
    if is_async:
        metric = "backlog"
    elif metric == "backlog":
        raise InputError("the backlog metric is for --async endpoints")
    if target is None:
        value, reason = default_target(metric, instance_type=instance_type, env=env, stock_container=stock_container)
    else:
        value, reason = float(target), "given with --target"
    if value <= 0:
        raise InputError(f"--target must be positive, got {target}")
    return Autoscaling(lo, max_instances, value, metric, reason)


@dataclass
class AsyncOptions:
    output: S3Uri
    failure: S3Uri
    sns_success: str | None = None
    sns_error: str | None = None
    max_concurrent: int | None = None

    def config(self) -> dict:
        out = {"S3OutputPath": str(self.output), "S3FailurePath": str(self.failure)}
        topics = {k: v for k, v in (("SuccessTopic", self.sns_success), ("ErrorTopic", self.sns_error)) if v}
        if topics:
            out["NotificationConfig"] = topics
        config = {"OutputConfig": out}
        if self.max_concurrent:
            config["ClientConfig"] = {"MaxConcurrentInvocationsPerInstance": self.max_concurrent}
        return config


def make_async(output: S3Uri, failure: S3Uri | None, sns_success: str | None, sns_error: str | None,
               max_concurrent: int | None) -> AsyncOptions:
    for flag, arn in (("--sns-success", sns_success), ("--sns-error", sns_error)):
        if arn and not _SNS.match(arn):
            raise InputError(f"{flag} must be an SNS topic ARN (arn:aws:sns:REGION:ACCOUNT:NAME), got {arn!r}")
    if max_concurrent is not None and not 1 <= max_concurrent <= 1000:
        raise InputError(f"--max-concurrent must be 1-1000, got {max_concurrent}")
    if failure is None:  # a sibling prefix, so output listings hold only results
        failure = S3Uri(output.bucket, output.key.rstrip("/") + "-failures/" if output.key else "failures/")
    return AsyncOptions(output, failure, sns_success, sns_error, max_concurrent)


@dataclass
class DeployRequest:
    name: str
    model_data: S3Uri
    role: str
    instance_type: str
    image: str | None = None
    stock_container: bool = False
    instances: int = 1
    env: dict[str, str] = field(default_factory=dict)
    autoscaling: Autoscaling | None = None
    async_options: AsyncOptions | None = None
    startup_timeout: int = STARTUP_TIMEOUT_S
    download_timeout: int = DOWNLOAD_TIMEOUT_S
    bake_seconds: int = 300
    rollback_errors: int = 1

    def validate(self) -> None:
        check_name(self.name, for_deploy=True)
        if not _ROLE.match(self.role or ""):
            raise InputError(f"--role must be an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME), got {self.role!r}")
        if not re.match(r"^ml\.[a-z0-9]+\.[a-z0-9]+$", self.instance_type or ""):
            raise InputError(f"--instance-type must look like ml.g5.xlarge, got {self.instance_type!r}")
        if self.image is None and not self.stock_container:
            raise InputError("give the container: --image URI (fish-sm's own image) or --stock-container "
                             "(the AWS PyTorch inference image)")
        if self.instances < 1:
            raise InputError(f"--instances must be at least 1, got {self.instances}")
        for what, value in (("startup", self.startup_timeout), ("download", self.download_timeout)):
            if not 60 <= value <= 3600:
                raise InputError(f"the {what} timeout must be 60-3600 s, got {value}")
        if not 0 <= self.bake_seconds <= 3600:
            raise InputError(f"--bake must be 0-3600 s, got {self.bake_seconds}")
        if self.rollback_errors < 1:
            raise InputError(f"--rollback-errors must be at least 1, got {self.rollback_errors}")


def model_request(req: DeployRequest, model_name: str, image: str, env: dict[str, str]) -> dict:
    return dict(ModelName=model_name, ExecutionRoleArn=req.role,
                PrimaryContainer={"Image": image, "ModelDataUrl": str(req.model_data), "Environment": env},
                Tags=[{"Key": TAG_KEY, "Value": req.name}])


def endpoint_config_request(req: DeployRequest, config_name: str, model_name: str) -> dict:
    variant = {
        "VariantName": VARIANT, "ModelName": model_name,
        "InitialInstanceCount": req.instances, "InstanceType": req.instance_type,
        "ContainerStartupHealthCheckTimeoutInSeconds": req.startup_timeout,
        "ModelDataDownloadTimeoutInSeconds": req.download_timeout,
    }
    if req.async_options is None:
        # Long and short texts differ in cost by 100x: send each request to the least busy instance.
        variant["RoutingConfig"] = {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
    out = dict(EndpointConfigName=config_name, ProductionVariants=[variant], Tags=[{"Key": TAG_KEY, "Value": req.name}])
    if req.async_options is not None:
        out["AsyncInferenceConfig"] = req.async_options.config()
    return out


def rollback_alarm_request(name: str, threshold: int) -> dict:
    """A 5XX alarm on the endpoint: the blue/green update rolls back when it fires during baking."""
    return dict(
        AlarmName=rollback_alarm_name(name),
        AlarmDescription=f"fish-sm: 5XX errors from endpoint {name}; rolls back blue/green updates",
        Namespace="AWS/SageMaker", MetricName="Invocation5XXErrors",
        Dimensions=[{"Name": "EndpointName", "Value": name}, {"Name": "VariantName", "Value": VARIANT}],
        Statistic="Sum", Period=60, EvaluationPeriods=1, Threshold=float(threshold),
        ComparisonOperator="GreaterThanOrEqualToThreshold", TreatMissingData="notBreaching",
    )


def deployment_config(req: DeployRequest) -> dict:
    """Blue/green, all traffic at once, then --bake seconds watched by the 5XX alarm before the old fleet goes."""
    # Room for the green fleet's download and warm-up (twice, for a retried instance) plus the baking.
    limit = 2 * (req.startup_timeout + req.download_timeout) + req.bake_seconds
    return {
        "BlueGreenUpdatePolicy": {
            "TrafficRoutingConfiguration": {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": req.bake_seconds},
            "TerminationWaitInSeconds": 0,
            "MaximumExecutionTimeoutInSeconds": max(600, min(28800, limit)),
        },
        "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": rollback_alarm_name(req.name)}]},
    }


def describe_endpoint(aws: AWS, name: str) -> dict | None:
    try:
        return aws.sagemaker.describe_endpoint(EndpointName=name)
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise


def require_endpoint(aws: AWS, name: str) -> dict:
    """describe_endpoint, or a one-line error naming the endpoint and region."""
    check_name(name)
    found = describe_endpoint(aws, name)
    if found is None:
        raise AWSError(f"endpoint {name!r} does not exist in {aws.region_name}")
    return found


def endpoint_config(aws: AWS, endpoint: dict) -> dict:
    return aws.sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])


@dataclass
class DeployResult:
    action: str  # created | updated
    model_name: str
    config_name: str
    image: str
    endpoint: dict | None = None  # the final describe_endpoint when waited


def _check_model_data(aws: AWS, uri: S3Uri, log: Log) -> bool:
    """Fail early on a missing model.tar.gz; a permission error is left to SageMaker's role
    (False: the object cannot be read from here)."""
    try:
        if head_object(aws, uri) is None:
            raise AWSError(f"--model-data {uri} does not exist")
    except AWSError:
        raise
    except Exception as exc:
        if error_code(exc) in ("403", "AccessDenied", "Forbidden"):
            log(f"note: cannot read {uri} with your credentials; SageMaker will use the role's")
            return False
        raise
    return True


def pinned_manifest(aws: AWS, uri: S3Uri, readable: bool, log: Log) -> dict[str, str]:
    """{FISH_SM_MANIFEST_SHA256: sha256 of the tarball's manifest.json}, so the container serves
    only this package; empty (with a note) when the manifest cannot be read from here."""
    manifest = read_tarball_manifest(aws, uri) if readable else None
    if manifest is None:
        why = "it cannot be read with your credentials" if not readable else \
            "it does not start with manifest.json (not made by `fish-sm package`)"
        log(f"note: the package's manifest cannot be pinned ({MANIFEST_ENV} not set): {why}")
        return {}
    digest = hashlib.sha256(manifest).hexdigest()
    log(f"pinned the package's manifest.json: {MANIFEST_ENV}={digest}")
    return {MANIFEST_ENV: digest}


def deploy(aws: AWS, req: DeployRequest, *, wait: bool = True, poll_s: float = 15.0,
           timeout_s: float = 2 * 3600, log: Log = _quiet) -> DeployResult:
    """Create the endpoint, or update it blue/green with auto-rollback; then autoscaling when waited."""
    req.validate()
    if req.autoscaling is not None and not wait:
        raise InputError("autoscaling can only be attached once the endpoint is InService: leave out --no-wait")
    if req.autoscaling is not None:
        sc = req.autoscaling
        log(f"autoscaling target: {sc.target:g} {METRIC_UNITS[sc.metric]}" + (f" ({sc.reason})" if sc.reason else ""))
    sm = aws.sagemaker
    existing = describe_endpoint(aws, req.name)
    if existing is not None and existing["EndpointStatus"] != "InService":
        status, reason = existing["EndpointStatus"], existing.get("FailureReason")
        hint = f"run `fish-sm delete {req.name}` first" if status == "Failed" else "wait until it is InService"
        raise AWSError(f"endpoint {req.name} is {status}{f' ({reason})' if reason else ''}; {hint}")
    if req.stock_container and req.image is None:
        image = stock_image_uri(aws.region_name, req.instance_type)
    else:
        image = req.image
    readable = _check_model_data(aws, req.model_data, log)
    # The user's --env FISH_SM_MANIFEST_SHA256 wins, as every --env does.
    pinned = {} if MANIFEST_ENV in req.env else pinned_manifest(aws, req.model_data, readable, log)
    env = container_environment({**pinned, **req.env}, stock_container=req.stock_container,
                                instance_type=req.instance_type, log=log)

    stamp = new_stamp()
    model_name = config_name = f"{req.name}-{stamp}"
    made: list[tuple[str, str]] = []
    try:
        sm.create_model(**model_request(req, model_name, image, env))
        made.append(("model", model_name))
        log(f"created model {model_name} ({image})")
        sm.create_endpoint_config(**endpoint_config_request(req, config_name, model_name))
        made.append(("config", config_name))
        log(f"created endpoint config {config_name}: {req.instances} x {req.instance_type}"
            + (", asynchronous" if req.async_options else ""))
        aws.cloudwatch.put_metric_alarm(**rollback_alarm_request(req.name, req.rollback_errors))
        log(f"alarm {rollback_alarm_name(req.name)}: >= {req.rollback_errors} 5XX errors a minute")
        if existing is None:
            sm.create_endpoint(EndpointName=req.name, EndpointConfigName=config_name,
                               Tags=[{"Key": TAG_KEY, "Value": req.name}])
            action = "created"
            log(f"creating endpoint {req.name}")
        else:
            old = endpoint_config(aws, existing)["ProductionVariants"][0].get("InstanceType")
            if old != req.instance_type and scalable_target(aws, req.name) is not None:
                # SageMaker refuses to change the instance type of an autoscaled variant.
                for line in remove_autoscaling(aws, req.name):
                    log(f"{line} (the instance type changes from {old})")
            sm.update_endpoint(EndpointName=req.name, EndpointConfigName=config_name,
                               DeploymentConfig=deployment_config(req))
            action = "updated"
            log(f"updating endpoint {req.name} blue/green (baking {req.bake_seconds} s, "
                f"rolls back when {rollback_alarm_name(req.name)} fires)")
    except BaseException:
        _discard(aws, made)  # nothing uses them yet: leave no half-made deploy behind
        raise

    result = DeployResult(action, model_name, config_name, image)
    if wait:
        result.endpoint = wait_endpoint(aws, req.name, config_name=config_name, poll_s=poll_s,
                                        timeout_s=timeout_s, log=log)
        for line in apply_autoscaling(aws, req.name, req.autoscaling):
            log(line)
    return result


def _discard(aws: AWS, made: list[tuple[str, str]]) -> None:
    for kind, resource in reversed(made):
        try:
            if kind == "config":
                aws.sagemaker.delete_endpoint_config(EndpointConfigName=resource)
            else:
                aws.sagemaker.delete_model(ModelName=resource)
        except Exception:  # best effort: the original error is what the user needs to see
            pass


FAILED_STATES = ("Failed", "UpdateRollbackFailed", "OutOfService")


def wait_endpoint(aws: AWS, name: str, *, config_name: str | None = None, poll_s: float = 15.0,
                  timeout_s: float = 2 * 3600, log: Log = _quiet) -> dict:
    """Poll until InService; on failure raise with SageMaker's FailureReason.

    With config_name (an update), coming back InService on another config means the update
    was rolled back, which is a failure too.
    """
    t0 = time.monotonic()
    last, last_line = None, t0
    while True:
        desc = describe_endpoint(aws, name)
        elapsed = time.monotonic() - t0
        if desc is None:
            raise AWSError(f"endpoint {name} disappeared while waiting (deleted?)")
        status = desc["EndpointStatus"]
        if status != last or time.monotonic() - last_line >= 60:
            log(f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {name}: {status}"
                + (" (still)" if status == last else ""))
            last, last_line = status, time.monotonic()
        reason = desc.get("FailureReason")
        if status == "InService":
            if config_name and desc.get("EndpointConfigName") != config_name:
                raise AWSError(f"the update of {name} was rolled back ({reason or 'the rollback alarm fired'}); "
                               f"it still serves {desc.get('EndpointConfigName')}")
            return desc
        if status in FAILED_STATES:
            raise AWSError(f"endpoint {name} is {status}: {reason or 'SageMaker gave no reason'}")
        if elapsed > timeout_s:
            raise AWSError(f"gave up after {int(elapsed)} s: endpoint {name} is still {status} "
                           f"(see `fish-sm status {name}`)")
        time.sleep(poll_s)


# --- autoscaling -------------------------------------------------------------------------

def scalable_target(aws: AWS, name: str) -> dict | None:
    targets = aws.autoscaling.describe_scalable_targets(
        ServiceNamespace="sagemaker", ResourceIds=[resource_id(name)], ScalableDimension=DIMENSION)
    return next(iter(targets.get("ScalableTargets", [])), None)


def scaling_policies(aws: AWS, name: str) -> list[dict]:
    pages = aws.autoscaling.get_paginator("describe_scaling_policies").paginate(
        ServiceNamespace="sagemaker", ResourceId=resource_id(name), ScalableDimension=DIMENSION)
    return [p for page in pages for p in page.get("ScalingPolicies", []) if p.get("ResourceId") == resource_id(name)]


def _alarms(aws: AWS, prefix: str) -> list[dict]:
    pages = aws.cloudwatch.get_paginator("describe_alarms").paginate(AlarmNamePrefix=prefix, AlarmTypes=["MetricAlarm"])
    return [a for page in pages for a in page.get("MetricAlarms", [])]


def policy_request(name: str, scaling: Autoscaling) -> dict:
    """The target tracking policy for the chosen metric."""
    if scaling.metric == "backlog":
        spec = {"CustomizedMetricSpecification": {
            "MetricName": "ApproximateBacklogSizePerInstance", "Namespace": "AWS/SageMaker",
            "Dimensions": [{"Name": "EndpointName", "Value": name}], "Statistic": "Average"}}
        cooldowns = {"ScaleInCooldown": 600, "ScaleOutCooldown": 300}
    else:
        metric = {"concurrency": "SageMakerVariantConcurrentRequestsPerModelHighResolution",
                  "invocations": "SageMakerVariantInvocationsPerInstance"}[scaling.metric]
        spec = {"PredefinedMetricSpecification": {"PredefinedMetricType": metric}}
        cooldowns = {"ScaleInCooldown": 300, "ScaleOutCooldown": 60}
    return dict(PolicyName=POLICY_PREFIX + scaling.metric, ServiceNamespace="sagemaker", ResourceId=resource_id(name),
                ScalableDimension=DIMENSION, PolicyType="TargetTrackingScaling",
                TargetTrackingScalingPolicyConfiguration={"TargetValue": scaling.target, **spec, **cooldowns})


def wake_policy_request(name: str) -> dict:
    """Target tracking cannot leave 0 instances (no instance, no backlog per instance): a step adds one."""
    return dict(PolicyName=WAKE_POLICY, ServiceNamespace="sagemaker", ResourceId=resource_id(name),
                ScalableDimension=DIMENSION, PolicyType="StepScaling",
                StepScalingPolicyConfiguration={
                    "AdjustmentType": "ChangeInCapacity", "MetricAggregationType": "Average", "Cooldown": 300,
                    "StepAdjustments": [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}]})


def wake_alarm_request(name: str, policy_arn: str) -> dict:
    return dict(
        AlarmName=wake_alarm_name(name),
        AlarmDescription=f"fish-sm: requests queued at endpoint {name} with no instance; adds one",
        Namespace="AWS/SageMaker", MetricName="HasBacklogWithoutCapacity",
        Dimensions=[{"Name": "EndpointName", "Value": name}],
        Statistic="Average", Period=60, EvaluationPeriods=2, Threshold=1.0,
        ComparisonOperator="GreaterThanOrEqualToThreshold", TreatMissingData="missing",
        AlarmActions=[policy_arn],
    )


def apply_autoscaling(aws: AWS, name: str, scaling: Autoscaling | None) -> list[str]:
    """Make the endpoint's scaling what was asked for (None: none), removing our stale policies."""
    if scaling is None:
        return remove_autoscaling(aws, name)
    aa, done = aws.autoscaling, []
    aa.register_scalable_target(ServiceNamespace="sagemaker", ResourceId=resource_id(name),
                                ScalableDimension=DIMENSION, MinCapacity=scaling.min, MaxCapacity=scaling.max)
    done.append(f"autoscaling {name}: {scaling.min}-{scaling.max} instances")
    policy = policy_request(name, scaling)
    aa.put_scaling_policy(**policy)
    done.append(f"policy {policy['PolicyName']}: target {scaling.target:g} {METRIC_UNITS[scaling.metric]}")
    wanted = {policy["PolicyName"]}
    if scaling.scale_to_zero:
        arn = aa.put_scaling_policy(**wake_policy_request(name))["PolicyARN"]
        aws.cloudwatch.put_metric_alarm(**wake_alarm_request(name, arn))
        wanted.add(WAKE_POLICY)
        done.append(f"policy {WAKE_POLICY} + alarm {wake_alarm_name(name)}: scales up from zero on a backlog")
    for p in scaling_policies(aws, name):
        if p["PolicyName"].startswith(POLICY_PREFIX) and p["PolicyName"] not in wanted:
            aa.delete_scaling_policy(PolicyName=p["PolicyName"], ServiceNamespace="sagemaker",
                                     ResourceId=resource_id(name), ScalableDimension=DIMENSION)
            done.append(f"removed stale policy {p['PolicyName']}")
    if not scaling.scale_to_zero:
        done += _delete_alarms(aws, [a["AlarmName"] for a in _alarms(aws, wake_alarm_name(name))])
    return done


def _delete_alarms(aws: AWS, names: list[str]) -> list[str]:
    if not names:
        return []
    aws.cloudwatch.delete_alarms(AlarmNames=names)
    return [f"removed alarm {n}" for n in names]


def remove_autoscaling(aws: AWS, name: str) -> list[str]:
    """Delete every scaling policy on the endpoint's variant, its target, and our wake alarm."""
    aa, done = aws.autoscaling, []
    for p in scaling_policies(aws, name):
        aa.delete_scaling_policy(PolicyName=p["PolicyName"], ServiceNamespace="sagemaker",
                                 ResourceId=resource_id(name), ScalableDimension=DIMENSION)
        done.append(f"removed scaling policy {p['PolicyName']}")
    if scalable_target(aws, name) is not None:
        aa.deregister_scalable_target(ServiceNamespace="sagemaker", ResourceId=resource_id(name),
                                      ScalableDimension=DIMENSION)
        done.append(f"removed scalable target {resource_id(name)}")
    done += _delete_alarms(aws, [a["AlarmName"] for a in _alarms(aws, wake_alarm_name(name))])
    return done


# --- status and delete -------------------------------------------------------------------

def status(aws: AWS, name: str) -> dict:
    """What a user wants to see about an endpoint, as plain JSON-able data."""
    ep = require_endpoint(aws, name)
    cfg = endpoint_config(aws, ep)
    variant = (cfg.get("ProductionVariants") or [{}])[0]
    live = next((v for v in ep.get("ProductionVariants", []) if v.get("VariantName") == variant.get("VariantName")), {})
    out = {
        "name": name, "status": ep["EndpointStatus"], "failure_reason": ep.get("FailureReason"),
        "endpoint_config": ep.get("EndpointConfigName"), "model": variant.get("ModelName"),
        "instance_type": variant.get("InstanceType"),
        "instances": {"current": live.get("CurrentInstanceCount"), "desired": live.get("DesiredInstanceCount")},
        "created": str(ep.get("CreationTime")), "modified": str(ep.get("LastModifiedTime")),
        "async": None, "autoscaling": None, "alarms": [],
    }
    if cfg.get("AsyncInferenceConfig"):
        oc = cfg["AsyncInferenceConfig"].get("OutputConfig", {})
        out["async"] = {"output": oc.get("S3OutputPath"), "failure": oc.get("S3FailurePath"),
                        "max_concurrent": cfg["AsyncInferenceConfig"].get("ClientConfig", {})
                        .get("MaxConcurrentInvocationsPerInstance")}
    target = scalable_target(aws, name)
    if target is not None:
        policies = []
        for p in scaling_policies(aws, name):
            tt = p.get("TargetTrackingScalingPolicyConfiguration")
            metric = None
            if tt:
                metric = (tt.get("PredefinedMetricSpecification", {}).get("PredefinedMetricType")
                          or tt.get("CustomizedMetricSpecification", {}).get("MetricName"))
            policies.append({"name": p["PolicyName"], "type": p["PolicyType"], "metric": metric,
                             "target": tt.get("TargetValue") if tt else None})
        out["autoscaling"] = {"min": target["MinCapacity"], "max": target["MaxCapacity"], "policies": policies}
    out["alarms"] = [{"name": a["AlarmName"], "state": a.get("StateValue"), "metric": a.get("MetricName")}
                     for a in _alarms(aws, f"fish-sm/{name}/")]
    return out


def _owned_names(pages, list_key: str, name_key: str, name: str) -> list[str]:
    return sorted(item[name_key] for page in pages for item in page.get(list_key, []) if owned(name, item[name_key]))


def delete(aws: AWS, name: str) -> list[str]:
    """Remove the endpoint and what deploys of it made; returns what was removed ([] if nothing)."""
    check_name(name)
    sm, done = aws.sagemaker, []
    done += remove_autoscaling(aws, name)
    done += _delete_alarms(aws, [a["AlarmName"] for a in _alarms(aws, f"fish-sm/{name}/")])
    if describe_endpoint(aws, name) is not None:
        sm.delete_endpoint(EndpointName=name)
        done.append(f"removed endpoint {name}")
    configs = _owned_names(sm.get_paginator("list_endpoint_configs").paginate(NameContains=name),
                           "EndpointConfigs", "EndpointConfigName", name)
    for config in configs:
        sm.delete_endpoint_config(EndpointConfigName=config)
        done.append(f"removed endpoint config {config}")
    for model in _owned_names(sm.get_paginator("list_models").paginate(NameContains=name), "Models", "ModelName", name):
        sm.delete_model(ModelName=model)
        done.append(f"removed model {model}")
    return done

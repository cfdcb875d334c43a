"""What a deploy asks for: the checked DeployRequest, its async options, and the SageMaker API
requests made from it (model, endpoint config, blue/green deployment config)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fish_sm.aws.autoscaling import Autoscaling
from fish_sm.aws.naming import TAG_KEY, VARIANT, check_name, rollback_alarm_name
from fish_sm.aws.s3 import S3Uri
from fish_sm.errors import InputError

# Warm-up (loading 3.6 GB of weights, torch.compile) takes minutes; SageMaker's defaults
# would kill the container before its first /ping succeeds.
STARTUP_TIMEOUT_S = 1800
DOWNLOAD_TIMEOUT_S = 1800
_ROLE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$")
_SNS = re.compile(r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[\w-]+$")


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

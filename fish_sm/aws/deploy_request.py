"""What a deploy asks for: the checked DeployRequest, its async options, and the SageMaker API
requests made from it (model, endpoint config, blue/green deployment config)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fish_sm.aws.autoscaling import Autoscaling
from fish_sm.aws.naming import TAG_KEY, VARIANT, check_name, rollback_alarm_name
from fish_sm.aws.s3 import S3Uri, parse_s3_uri
from fish_sm.errors import InputError

_ROLE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$")
_SNS = re.compile(r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[\w-]+$")
_SUBNET = re.compile(r"^subnet-[0-9a-z]+$")
_SECURITY_GROUP = re.compile(r"^sg-[0-9a-z]+$")
_KMS_KEY = re.compile(r"^(arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:(key|alias)/[\w/+=,.@-]+|alias/[\w/+=,.@-]+|[0-9a-f-]{36})$")
# The host image SageMaker runs GPU containers on: its NVIDIA driver bounds the CUDA the image may use.
# Unset, SageMaker may pick one with driver 535 (CUDA 12.2) or 550 (CUDA 12.4); fish-sm's image
# needs CUDA 13.0, so driver 580.
DEFAULT_GPU_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"
_TAG_KEY = re.compile(r"^[\w.:/=+\-@ ]{1,128}$")
_TAG_VALUE = re.compile(r"^[\w.:/=+\-@ ]{0,256}$")


def inference_ami_versions() -> list[str]:
    """The InferenceAmiVersion values the installed botocore's SageMaker model accepts."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    return list(model.shape_for("ProductionVariantInferenceAmiVersion").enum)


def parse_tags(pairs) -> dict[str, str]:
    """--tags KEY=VALUE pairs -> dict, with AWS's tag syntax checked (fish-sm's own key is reserved)."""
    tags: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _TAG_KEY.match(key) or not _TAG_VALUE.match(value):
            raise InputError(f"--tags must be KEY=VALUE (key 1-128, value up to 256 letters, digits, spaces and "
                             f"_.:/=+-@), got {pair!r}")
        if key.lower().startswith("aws:") or key == TAG_KEY:
            raise InputError(f"--tags {key}: keys starting with 'aws:', and {TAG_KEY!r}, are reserved")
        tags[key] = value
    if len(tags) > 40:
        raise InputError(f"--tags: at most 40 tags, got {len(tags)}")
    return tags


def split_ids(values) -> tuple[str, ...]:
    """Repeated or comma-separated ids (--subnets a,b --subnets c) -> ('a', 'b', 'c')."""
    return tuple(part.strip() for v in values for part in v.split(",") if part.strip())


@dataclass
class DataCapture:
    destination: S3Uri
    percent: int = 100

    def config(self) -> dict:
        return {"EnableCapture": True, "InitialSamplingPercentage": self.percent,
                "DestinationS3Uri": str(self.destination),
                "CaptureOptions": [{"CaptureMode": "Input"}, {"CaptureMode": "Output"}]}


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
    # Seconds to the first healthy /ping and for the package's download; None: derived by deploy
    # from the start measured on the instance's GPU model and the package's size (aws/startup.py).
    startup_timeout: int | None = None
    download_timeout: int | None = None
    bake_seconds: int = 300
    rollback_errors: int = 1
    gpus: int | None = None  # the instance type's GPUs: --gpus, else asked of EC2 by deploy
    ami_version: str = "auto"  # auto (DEFAULT_GPU_AMI on a GPU type, unset otherwise) | none | a version
    tags: dict[str, str] = field(default_factory=dict)
    subnets: tuple[str, ...] = ()
    security_groups: tuple[str, ...] = ()
    kms_key: str | None = None
    network_isolation: bool = False
    data_capture: DataCapture | None = None
    # FISH_SM_ADAPTER_SOURCES: auto (adapters/NAME/ beside the package when it holds adapters, see
    # aws/adapters.py), default (there, always), none, or an s3:// prefix
    adapter_source: str = "auto"

    def resource_tags(self) -> list[dict]:
        """The tags every resource of this deploy gets: fish-sm's own, then --tags."""
        return [{"Key": TAG_KEY, "Value": self.name}, *({"Key": k, "Value": v} for k, v in self.tags.items())]

    def inference_ami(self, gpus: int) -> str | None:
        """The variant's InferenceAmiVersion, None to leave it to SageMaker."""
        if self.ami_version == "none":
            return None
        if self.ami_version == "auto":
            return DEFAULT_GPU_AMI if gpus > 0 else None
        return self.ami_version

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
            if value is not None and not 60 <= value <= 3600:
                raise InputError(f"the {what} timeout must be 60-3600 s, got {value}")
        if not 0 <= self.bake_seconds <= 3600:
            raise InputError(f"--bake must be 0-3600 s, got {self.bake_seconds}")
        if self.rollback_errors < 1:
            raise InputError(f"--rollback-errors must be at least 1, got {self.rollback_errors}")
        if self.gpus is not None and not 0 <= self.gpus <= 64:
            raise InputError(f"--gpus must be 0-64, got {self.gpus}")
        if self.ami_version not in ("auto", "none"):
            known = inference_ami_versions()
            if self.ami_version not in known:
                raise InputError(f"--ami-version {self.ami_version!r}: choose one of {', '.join(known)}, auto or none")
        if bool(self.subnets) != bool(self.security_groups):
            raise InputError("--subnets and --security-groups go together (the model's VPC): give both or neither")
        for flag, ids, pattern in (("--subnets", self.subnets, _SUBNET),
                                   ("--security-groups", self.security_groups, _SECURITY_GROUP)):
            bad = [i for i in ids if not pattern.match(i)]
            if bad or len(ids) > (16 if flag == "--subnets" else 5):
                raise InputError(f"{flag}: {', '.join(bad) or 'too many'} "
                                 f"({'subnet-... ids, at most 16' if flag == '--subnets' else 'sg-... ids, at most 5'})")
        if self.kms_key is not None and not _KMS_KEY.match(self.kms_key):
            raise InputError(f"--kms-key must be a KMS key id, key ARN, alias/NAME or alias ARN, got {self.kms_key!r}")
        if self.adapter_source not in ("auto", "default", "none"):
            parse_s3_uri(self.adapter_source, what="--adapter-source", prefix=True)
        if self.data_capture is not None and not 1 <= self.data_capture.percent <= 100:
            raise InputError(f"--data-capture-percent must be 1-100, got {self.data_capture.percent}")


def model_request(req: DeployRequest, model_name: str, image: str, env: dict[str, str]) -> dict:
    out = dict(ModelName=model_name, ExecutionRoleArn=req.role,
               PrimaryContainer={"Image": image, "ModelDataUrl": str(req.model_data), "Environment": env},
               Tags=req.resource_tags())
    if req.subnets:
        out["VpcConfig"] = {"Subnets": list(req.subnets), "SecurityGroupIds": list(req.security_groups)}
    if req.network_isolation:
        out["EnableNetworkIsolation"] = True
    return out


def endpoint_config_request(req: DeployRequest, config_name: str, model_name: str, gpus: int) -> dict:
    variant = {
        "VariantName": VARIANT, "ModelName": model_name,
        "InitialInstanceCount": req.instances, "InstanceType": req.instance_type,
        "ContainerStartupHealthCheckTimeoutInSeconds": req.startup_timeout,
        "ModelDataDownloadTimeoutInSeconds": req.download_timeout,
    }
    ami = req.inference_ami(gpus)
    if ami is not None:
        variant["InferenceAmiVersion"] = ami
    if req.async_options is None:
        # Long and short texts differ in cost by 100x: send each request to the least busy instance.
        variant["RoutingConfig"] = {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
    out = dict(EndpointConfigName=config_name, ProductionVariants=[variant], Tags=req.resource_tags())
    if req.async_options is not None:
        out["AsyncInferenceConfig"] = req.async_options.config()
    if req.kms_key is not None:
        out["KmsKeyId"] = req.kms_key
    if req.data_capture is not None:
        out["DataCaptureConfig"] = req.data_capture.config()
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

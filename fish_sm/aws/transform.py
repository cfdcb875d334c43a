"""Batch Transform over JSON Lines: one request per line in, one JSON result per line out.

For offline jobs (an audiobook, a catalogue of prompts) a transform job runs the same model
as the endpoint on its own instances, which exist only for the job. Each line is sent as its
own request (SplitType=Line, BatchStrategy=SingleRecord), so one bad line fails one record
rather than a whole batch, and the outputs are reassembled line by line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fish_sm.aws import AWSError
from fish_sm.aws.container import gpu_count
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config
from fish_sm.aws.naming import MAX_NAME, TAG_KEY, check_name, new_stamp
from fish_sm.aws.s3 import S3Uri, list_objects
from fish_sm.aws.session import AWS, is_not_found
from fish_sm.errors import InputError

MAX_TOTAL_PAYLOAD_MB = 100  # SageMaker's cap on MaxConcurrentTransforms * MaxPayloadInMB
INVOCATION_TIMEOUT_S = 3600  # the largest SageMaker allows: long texts take minutes per line


@dataclass
class TransformResult:
    job_name: str
    status: str
    failure_reason: str | None
    inputs: list[dict]
    outputs: list[dict] = field(default_factory=list)


def resolve_model(aws: AWS, name: str) -> tuple[str, str | None]:
    """(model name, instance type or None) for an endpoint deployed by fish-sm, or a model by name."""
    check_name(name)
    endpoint = describe_endpoint(aws, name)
    if endpoint is not None:
        variant = endpoint_config(aws, endpoint)["ProductionVariants"][0]
        return variant["ModelName"], variant.get("InstanceType")
    try:
        aws.sagemaker.describe_model(ModelName=name)
    except Exception as exc:
        if is_not_found(exc):
            raise AWSError(f"no endpoint or model named {name!r} in {aws.region_name}") from None
        raise
    return name, None


def transform_request(job_name: str, model_name: str, source: S3Uri, dest: S3Uri, *, instance_type: str,
                      instances: int, owner: str) -> dict:
    concurrent = gpu_count(instance_type)[0]  # one request per engine (one engine per GPU)
    return dict(
        TransformJobName=job_name, ModelName=model_name,
        BatchStrategy="SingleRecord", MaxConcurrentTransforms=concurrent,
        MaxPayloadInMB=MAX_TOTAL_PAYLOAD_MB // concurrent,  # room for inline reference audio
        ModelClientConfig={"InvocationsTimeoutInSeconds": INVOCATION_TIMEOUT_S, "InvocationsMaxRetries": 1},
        TransformInput={"DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": str(source)}},
                        "ContentType": "application/jsonlines", "SplitType": "Line", "CompressionType": "None"},
        TransformOutput={"S3OutputPath": str(dest), "Accept": "application/jsonlines", "AssembleWith": "Line"},
        TransformResources={"InstanceType": instance_type, "InstanceCount": instances},
        Tags=[{"Key": TAG_KEY, "Value": owner}],
    )


def run_transform(aws: AWS, name: str, source: S3Uri, dest: S3Uri, *, instances: int = 1,
                  instance_type: str | None = None, wait: bool = True, poll_s: float = 30.0,
                  timeout_s: float = 24 * 3600, log=lambda s: None) -> TransformResult:
    """Start the job on NAME's model, wait for it, and list what it wrote."""
    if instances < 1:
        raise InputError(f"--instances must be at least 1, got {instances}")
    if not dest.is_prefix:
        raise InputError(f"--output must be a prefix (ending in '/'), got {dest}")
    model_name, endpoint_type = resolve_model(aws, name)
    instance_type = instance_type or endpoint_type
    if not instance_type:
        raise InputError(f"{name} is a model without an endpoint: give --instance-type")
    inputs = list_objects(aws, source)
    if not inputs:
        raise InputError(f"no input objects under {source}")
    job_name = f"{name[:MAX_NAME].rstrip('-')}-{new_stamp()}"
    aws.sagemaker.create_transform_job(**transform_request(job_name, model_name, source, dest,
                                                           instance_type=instance_type, instances=instances,
                                                           owner=name))
    log(f"started transform job {job_name}: {len(inputs)} input object(s) on {instances} x {instance_type}")
    result = TransformResult(job_name, "InProgress", None, inputs)
    if not wait:
        return result
    t0, last = time.monotonic(), None
    while True:
        desc = aws.sagemaker.describe_transform_job(TransformJobName=job_name)
        status, elapsed = desc["TransformJobStatus"], time.monotonic() - t0
        if status != last:
            log(f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {job_name}: {status}")
            last = status
        if status in ("Completed", "Failed", "Stopped"):
            break
        if elapsed > timeout_s:
            raise AWSError(f"gave up after {int(elapsed)} s: transform job {job_name} is still {status}")
        time.sleep(poll_s)
    result.status, result.failure_reason = status, desc.get("FailureReason") or None
    # SageMaker writes <input name>.out per input object; older runs' files may share the prefix.
    expected = {o["Key"].rsplit("/", 1)[-1] + ".out" for o in inputs}
    result.outputs = [o for o in list_objects(aws, dest) if o["Key"].rsplit("/", 1)[-1] in expected]
    if status != "Completed":
        raise AWSError(f"transform job {job_name} {status}: {result.failure_reason or 'SageMaker gave no reason'}")
    return result

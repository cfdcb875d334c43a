"""Batch Transform over JSON Lines: one request per line in, one JSON result per line out.

For offline jobs (an audiobook, a catalogue of prompts) a transform job runs the same model
as the endpoint on its own instances, which exist only for the job. Each line is sent as its
own request (SplitType=Line, BatchStrategy=SingleRecord), so one bad line fails one record
rather than a whole batch, and the outputs are reassembled line by line.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from fish_sm.aws import AWSError
from fish_sm.aws.instances import instance_gpus
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config
from fish_sm.aws.naming import MAX_NAME, TAG_KEY, check_name, new_stamp
from fish_sm.aws.s3 import S3Uri, list_objects
from fish_sm.aws.session import AWS, is_not_found
from fish_sm.errors import InputError

MAX_TOTAL_PAYLOAD_MB = 100  # SageMaker's cap on MaxConcurrentTransforms * MaxPayloadInMB
INVOCATION_TIMEOUT_S = 3600  # the largest SageMaker allows: long texts take minutes per line
PROGRESS_EVERY_S = 60  # a "still InProgress" line this often while the job runs


@dataclass
class TransformResult:
    job_name: str
    status: str
    failure_reason: str | None
    inputs: list[dict]
    outputs: list[dict] = field(default_factory=list)
    missing: list[dict] = field(default_factory=list)  # inputs without a result file

    @property
    def complete(self) -> bool:
        """Completed, with a result for every input: what a pipeline may go on with."""
        return self.status == "Completed" and not self.missing

    def problem(self, limit: int = 10) -> str | None:
        """One line saying what is wrong (job state, inputs without a result), or None."""
        if self.complete:
            return None
        parts = []
        if self.status != "Completed":
            reason = self.failure_reason or "SageMaker gave no reason"
            parts.append(f"transform job {self.job_name} {self.status}: {reason}")
        else:
            parts.append(f"transform job {self.job_name} Completed but wrote no result for some inputs")
        if self.missing:
            names = [o["Key"] for o in self.missing]
            shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
            parts.append(f"no result for {len(names)} of {len(self.inputs)} input(s): {shown}")
        return "; ".join(parts)


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
                      gpus: int, instances: int, owner: str) -> dict:
    concurrent = max(1, gpus)  # one request per engine (one engine per GPU, one on a CPU)
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
    gpus = instance_gpus(aws, instance_type)
    job_name = f"{name[:MAX_NAME].rstrip('-')}-{new_stamp()}"
    aws.sagemaker.create_transform_job(**transform_request(job_name, model_name, source, dest,
                                                           instance_type=instance_type, gpus=gpus,
                                                           instances=instances, owner=name))
    log(f"started transform job {job_name}: {len(inputs)} input object(s) on {instances} x {instance_type}")
    result = TransformResult(job_name, "InProgress", None, inputs)
    if not wait:
        return result
    desc = wait_transform(aws, job_name, poll_s=poll_s, timeout_s=timeout_s, log=log)
    result.status, result.failure_reason = desc["TransformJobStatus"], desc.get("FailureReason") or None
    # SageMaker writes <input name>.out per input object; older runs' files may share the prefix.
    written = {o["Key"].rsplit("/", 1)[-1]: o for o in list_objects(aws, dest)}
    for o in inputs:
        found = written.get(o["Key"].rsplit("/", 1)[-1] + ".out")
        (result.outputs if found else result.missing).append(found or o)
    return result


def wait_transform(aws: AWS, job_name: str, *, poll_s: float = 30.0, timeout_s: float = 24 * 3600,
                   log=lambda s: None) -> dict:
    """boto3's transform_job_completed_or_stopped waiter, run a minute at a time so that a
    progress line shows each change of state and, while it runs, each minute; returns the
    job's final description (Completed, Stopped or Failed)."""
    from botocore.exceptions import WaiterError

    waiter = aws.sagemaker.get_waiter("transform_job_completed_or_stopped")
    attempts = math.ceil(PROGRESS_EVERY_S / poll_s) + 1  # the waiter sleeps between attempts, not after the last
    t0, last = time.monotonic(), None
    while True:
        try:
            waiter.wait(TransformJobName=job_name, WaiterConfig={"Delay": poll_s, "MaxAttempts": attempts})
            desc = aws.sagemaker.describe_transform_job(TransformJobName=job_name)
        except WaiterError as exc:  # a failed job, an error, or a minute gone by
            desc = exc.last_response or {}
            if "Error" in desc and "TransformJobStatus" not in desc:
                raise AWSError(f"DescribeTransformJob {job_name}: {desc['Error'].get('Code', 'error')}: "
                               f"{desc['Error'].get('Message', '')}") from None
        status, elapsed = desc["TransformJobStatus"], time.monotonic() - t0
        log(f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {job_name}: {status}"
            + (" (still)" if status == last else ""))
        last = status
        if status in ("Completed", "Failed", "Stopped"):
            return desc
        if elapsed > timeout_s:
            raise AWSError(f"gave up after {int(elapsed)} s: transform job {job_name} is still {status}")

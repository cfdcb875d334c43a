"""What an instance type is, asked of the service: SageMaker's ml.X.Y runs on EC2's X.Y, whose
DescribeInstanceTypes says how many GPUs it has and of which model (so the default autoscaling
target and the stock container's workers follow the real hardware, and a typo fails before
anything is made)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fish_sm.aws import AWSError
from fish_sm.aws.session import AWS, error_code
from fish_sm.errors import InputError

_ML_TYPE = re.compile(r"^ml\.([a-z0-9-]+\.[a-z0-9]+)$")
_DENIED = ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "403")


def ec2_type(instance_type: str) -> str:
    """ml.g5.12xlarge -> g5.12xlarge."""
    m = _ML_TYPE.match(instance_type or "")
    if not m:
        raise InputError(f"--instance-type must look like ml.g5.xlarge, got {instance_type!r}")
    return m.group(1)


@dataclass(frozen=True)
class GPUs:
    """An instance type's accelerators: how many, and their model as EC2 names it ("H100", "A10G");
    model None when unknown (--gpus given instead of asking EC2) or there are none."""

    count: int
    model: str | None = None


def instance_hardware(aws: AWS, instance_type: str) -> GPUs:
    """GPUs on a SageMaker instance type (0 for a CPU or Inferentia type) and their model, from
    EC2's DescribeInstanceTypes."""
    name = ec2_type(instance_type)
    try:
        found = aws.ec2.describe_instance_types(InstanceTypes=[name]).get("InstanceTypes", [])
    except Exception as exc:
        code = error_code(exc)
        if code == "InvalidInstanceType":
            raise InputError(f"--instance-type {instance_type}: EC2 knows no instance type {name} in "
                             f"{aws.region_name}") from None
        if code in _DENIED:
            raise AWSError(f"cannot look up {instance_type}'s GPUs: ec2:DescribeInstanceTypes is denied to these "
                           "credentials; pass --gpus N") from None
        raise
    if not found:
        raise InputError(f"--instance-type {instance_type}: EC2 knows no instance type {name} in {aws.region_name}")
    gpus = (found[0].get("GpuInfo") or {}).get("Gpus") or []
    count = sum(int(g.get("Count", 0)) for g in gpus)
    models = sorted({g["Name"] for g in gpus if g.get("Name") and int(g.get("Count", 0)) > 0})
    # Every SageMaker type carries one GPU model; should one ever mix them, no single row fits.
    return GPUs(count, models[0] if len(models) == 1 else None)


def instance_gpus(aws: AWS, instance_type: str) -> int:
    """GPUs on a SageMaker instance type (0 for a CPU or Inferentia type), from EC2's DescribeInstanceTypes."""
    return instance_hardware(aws, instance_type).count

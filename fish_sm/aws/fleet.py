"""The endpoints fish-sm deployed, seen together: list them, and set an endpoint's instance count."""

from __future__ import annotations

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.autoscaling import DIMENSION, scalable_target
from fish_sm.aws.endpoints import endpoint_config, require_endpoint
from fish_sm.aws.naming import VARIANT, owned, resource_id
from fish_sm.aws.session import AWS, is_not_found


def list_endpoints(aws: AWS) -> list[dict]:
    """Every endpoint whose config a fish-sm deploy made (named NAME-<timestamp>), sorted by name:
    name, status, instance type, instances (current, desired), config, created."""
    sm, out = aws.sagemaker, []
    for page in sm.get_paginator("list_endpoints").paginate():
        for summary in page.get("Endpoints", []):
            name = summary["EndpointName"]
            try:
                ep = sm.describe_endpoint(EndpointName=name)
                if not owned(name, ep.get("EndpointConfigName", "")):
                    continue
                variant = (endpoint_config(aws, ep).get("ProductionVariants") or [{}])[0]
            except Exception as exc:
                if is_not_found(exc):  # deleted between the listing and the describe
                    continue
                raise
            live = next((v for v in ep.get("ProductionVariants", []) if v.get("VariantName") == VARIANT), {})
            out.append({"name": name, "status": ep["EndpointStatus"], "instance_type": variant.get("InstanceType"),
                        "instances": {"current": live.get("CurrentInstanceCount"),
                                      "desired": live.get("DesiredInstanceCount")},
                        "endpoint_config": ep.get("EndpointConfigName"), "created": str(ep.get("CreationTime"))})
    return sorted(out, key=lambda e: e["name"])


def scale(aws: AWS, name: str, instances: int, *, wait: bool = True, poll_s: float = 15.0,
          max_attempts: int = 240, log: Log = quiet) -> dict:
    """Set the variant's instance count now. Autoscaling, if attached, keeps acting within its
    min/max, so a count outside them moves the bound to it (said in a line) rather than being
    undone at the next scaling decision."""
    if instances < 0:
        raise AWSError(f"--instances must be at least 0, got {instances}")
    ep = require_endpoint(aws, name)
    if ep["EndpointStatus"] != "InService":
        raise AWSError(f"endpoint {name} is {ep['EndpointStatus']}; it can be scaled once InService")
    cfg = endpoint_config(aws, ep)
    if instances == 0 and not cfg.get("AsyncInferenceConfig"):
        raise AWSError(f"endpoint {name} is real-time: it needs at least 1 instance (only async endpoints scale to 0)")
    target = scalable_target(aws, name)
    if target is not None:
        lo, hi = target["MinCapacity"], target["MaxCapacity"]
        new_lo, new_hi = min(lo, instances), max(hi, instances)
        if (new_lo, new_hi) != (lo, hi):
            aws.autoscaling.register_scalable_target(ServiceNamespace="sagemaker", ResourceId=resource_id(name),
                                                     ScalableDimension=DIMENSION, MinCapacity=new_lo,
                                                     MaxCapacity=new_hi)
            log(f"autoscaling of {name} was {lo}-{hi} instances, now {new_lo}-{new_hi} so that {instances} holds")
        else:
            log(f"note: autoscaling ({lo}-{hi} instances) stays on and may change the count again")
    aws.sagemaker.update_endpoint_weights_and_capacities(
        EndpointName=name, DesiredWeightsAndCapacities=[{"VariantName": VARIANT, "DesiredInstanceCount": instances}])
    log(f"asked for {instances} instance{'s' if instances != 1 else ''} of {name}")
    if wait:
        from botocore.exceptions import WaiterError

        try:
            aws.sagemaker.get_waiter("endpoint_in_service").wait(
                EndpointName=name, WaiterConfig={"Delay": poll_s, "MaxAttempts": max_attempts})
        except WaiterError as exc:
            reason = (exc.last_response or {}).get("FailureReason") or exc.kwargs.get("reason") or "no reason given"
            raise AWSError(f"endpoint {name} did not come back InService after scaling: {reason}") from None
    ep = require_endpoint(aws, name)
    live = next((v for v in ep.get("ProductionVariants", []) if v.get("VariantName") == VARIANT), {})
    return {"name": name, "status": ep["EndpointStatus"], "instances": {
        "current": live.get("CurrentInstanceCount"), "desired": live.get("DesiredInstanceCount")}}

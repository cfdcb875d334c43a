"""Deploying: create the endpoint, or update it blue/green with auto-rollback, then autoscale it.

The steps, in order: refuse an endpoint that is not InService, pick the image, check the
model data and pin its manifest, create the model, the endpoint config and the rollback
alarm, create or update the endpoint, and once it is InService apply the autoscaling asked
for. What was made before a failed step is removed again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.alarms import rollback_alarm_request
from fish_sm.aws.autoscaling import METRIC_UNITS, apply_autoscaling, remove_autoscaling, scalable_target
from fish_sm.aws.container import MANIFEST_ENV, container_environment, stock_image_uri
from fish_sm.aws.deploy_request import DeployRequest, deployment_config, endpoint_config_request, model_request
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config, wait_endpoint
from fish_sm.aws.naming import TAG_KEY, new_stamp, rollback_alarm_name
from fish_sm.aws.package import read_tarball_manifest
from fish_sm.aws.s3 import S3Uri, head_object
from fish_sm.aws.session import AWS, error_code
from fish_sm.errors import InputError


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
           timeout_s: float = 2 * 3600, log: Log = quiet) -> DeployResult:
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

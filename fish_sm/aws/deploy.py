"""Deploying: create the endpoint, or update it blue/green with auto-rollback, then autoscale it.

The steps, in order: refuse an endpoint that is not InService; check, before anything is
made, the server's settings in --env, the instance type (its GPUs, from EC2), the image (in
ECR) and the model data (a fish-sm package, whose manifest is pinned); create the model, the
endpoint config and the rollback alarm, create or update the endpoint, and once it is
InService apply the autoscaling asked for. What was made before a failed step is removed again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.adapters import SOURCES_ENV, default_source
from fish_sm.aws.alarms import rollback_alarm_request
from fish_sm.aws.autoscaling import (METRIC_UNITS, apply_autoscaling, remove_autoscaling, scalable_target,
                                     with_target)
from fish_sm.aws.container import MANIFEST_ENV, check_settings, container_environment, server_kind, stock_image_uri
from fish_sm.aws.deploy_request import DeployRequest, deployment_config, endpoint_config_request, model_request
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config, wait_endpoint
from fish_sm.aws.images import check_image
from fish_sm.aws.monitoring import Monitoring, apply_monitoring
from fish_sm.aws.instances import GPUs, instance_hardware
from fish_sm.aws.naming import new_stamp, rollback_alarm_name
from fish_sm.aws.package import package_manifest
from fish_sm.aws.s3 import S3Uri, head_object, parse_s3_uri
from fish_sm.aws.session import AWS, error_code
from fish_sm.aws.startup import Timeouts, deploy_timeouts
from fish_sm.cloudwatch_metrics import ENDPOINT_ENV
from fish_sm.errors import InputError


# Where a package made for the stock container without its dependencies lists them (fish_sm.package.build).
REQUIREMENTS_ENTRY = "code/requirements.txt"


@dataclass
class DeployResult:
    action: str  # created | updated
    model_name: str
    config_name: str
    image: str
    gpus: int = 0
    inference_ami: str | None = None
    manifest_sha256: str | None = None
    endpoint: dict | None = None  # the final describe_endpoint when waited
    adapter_sources: str | None = None  # FISH_SM_ADAPTER_SOURCES, where `fish-sm adapters add` puts adapters


@dataclass
class Checked:
    """What deploy learned before making anything: the image, the instance's GPUs, the pinned manifest."""

    image: str
    gpus: int
    pinned: dict[str, str]
    gpu_model: str | None = None  # EC2's name for the GPUs ("H100"); None with --gpus or none
    packaged_adapters: bool | None = None  # the package holds LoRA adapters (None: its manifest was not read)
    timeouts: Timeouts | None = None  # the start-up and download timeouts, given or derived (`resolve_timeouts`)


def check_before_creating(aws: AWS, req: DeployRequest, log: Log = quiet) -> Checked:
    """Everything that can be known wrong before money is spent: the server's settings in --env, the
    instance type and its GPUs, the image in ECR, and the model data as a fish-sm package."""
    req.validate()
    check_settings(req.env)
    hardware = GPUs(req.gpus) if req.gpus is not None else instance_hardware(aws, req.instance_type)
    gpus = hardware.count
    if req.stock_container and req.image is None:
        image = stock_image_uri(aws.region_name, req.instance_type)
    else:
        image = req.image
    check_image(aws, image, log)
    manifest, size = read_manifest(aws, req.model_data, log)
    parsed = None if manifest is None else json.loads(manifest)
    if parsed is not None and req.stock_container:
        check_offline_start(parsed, req, log)
    adapters = None if parsed is None else bool(parsed.get("adapters"))
    return Checked(image, gpus, pinned_manifest(manifest, req.model_data, req.env.get(MANIFEST_ENV), log),
                   hardware.model, adapters, resolve_timeouts(req, hardware.model, parsed, size, log))


def read_manifest(aws: AWS, uri: S3Uri, log: Log) -> tuple[bytes | None, int | None]:
    """The package's manifest.json and its size in bytes. An object that is not a fish-sm package, or
    does not exist, is an error; one these credentials cannot read is left to SageMaker's role
    (None, None), with a note."""
    try:
        head = head_object(aws, uri)
        if head is None:
            raise AWSError(f"--model-data {uri} does not exist")
        return package_manifest(aws, uri), head.get("ContentLength")
    except Exception as exc:
        if error_code(exc) not in ("403", "AccessDenied", "Forbidden"):
            raise
        log(f"note: cannot read {uri} with your credentials, so it is not checked and its manifest is not "
            f"pinned; SageMaker will use the role's")
        return None, None


def resolve_timeouts(req: DeployRequest, gpu_model: str | None, manifest: dict | None, size: int | None,
                     log: Log) -> Timeouts:
    """--startup-timeout and --download-timeout as given, else derived from the start measured on
    this GPU model and from the package's size (`aws.startup`); said either way."""
    derived = deploy_timeouts(gpu_model, manifest=manifest, package_bytes=size, stock_container=req.stock_container)
    startup = ((req.startup_timeout, "--startup-timeout") if req.startup_timeout is not None
               else (derived.startup, derived.startup_why))
    download = ((req.download_timeout, "--download-timeout") if req.download_timeout is not None
                else (derived.download, derived.download_why))
    log(f"timeouts: start-up {startup[0]} s ({startup[1]}); download {download[0]} s ({download[1]})")
    return Timeouts(startup[0], download[0], startup[1], download[1])


def serves_adapters(env: dict[str, str], checked: Checked) -> bool:
    """The container serves LoRA adapters: packaged ones, or from an adapter source."""
    return bool(checked.packaged_adapters) or bool(env.get(SOURCES_ENV))


def with_timeouts(req: DeployRequest, checked: Checked) -> DeployRequest:
    """The request with the timeouts `check_before_creating` settled on."""
    return dataclasses.replace(req, startup_timeout=checked.timeouts.startup, download_timeout=checked.timeouts.download)


def check_offline_start(manifest: dict, req: DeployRequest, log: Log) -> None:
    """The stock container pip-installs code/requirements.txt at start, which needs the internet:
    refused with --network-isolation, noted in a VPC (which reaches it only through a NAT)."""
    if REQUIREMENTS_ENTRY not in manifest.get("files", {}):
        return
    if req.network_isolation:
        raise InputError(f"--model-data {req.model_data} installs {REQUIREMENTS_ENTRY} with pip when the stock "
                         "container starts, which --network-isolation forbids; build it with `fish-sm package "
                         "--stock-container` to carry its dependencies")
    if req.subnets:
        log(f"note: the stock container installs {REQUIREMENTS_ENTRY} with pip at start: the subnets need a NAT "
            "gateway, or build the package with `fish-sm package --stock-container`")


def pinned_manifest(manifest: bytes | None, uri: S3Uri, given: str | None, log: Log) -> dict[str, str]:
    """{FISH_SM_MANIFEST_SHA256: sha256 of the package's manifest.json}, so the container serves
    only this package; nothing when the manifest could not be read or the user pinned it."""
    if manifest is None:
        return {}
    digest = hashlib.sha256(manifest).hexdigest()
    if given is not None:  # the user's pin, checked rather than replaced
        if given.lower() != digest:
            raise InputError(f"--env {MANIFEST_ENV}={given} does not match the manifest.json of {uri} ({digest}); "
                             "the container would refuse to serve it")
        return {}
    log(f"pinned the package's manifest.json: {MANIFEST_ENV}={digest}")
    return {MANIFEST_ENV: digest}


def adapter_environment(req: DeployRequest, log: Log = quiet, packaged_adapters: bool | None = None) -> dict[str, str]:
    """{FISH_SM_ADAPTER_SOURCES: the S3 prefix the servers look adapters up in}: --adapter-source
    s3://..., or adapters/NAME/ beside the package (so `fish-sm adapters add NAME` has a place to put
    them) with `default`, or with `auto` when the package holds adapters (an endpoint serving none
    carries no adapter slots: its steps run as fast as before); nothing with `none`, with the user's
    own --env FISH_SM_ADAPTER_SOURCES (which wins, as every --env does), or with --network-isolation
    (the container cannot reach S3).

    SageMaker reads it with the execution role (--role), which needs s3:GetObject on the prefix's
    objects and s3:ListBucket on its bucket (without it a missing object reads as 403, not 404)."""
    if SOURCES_ENV in req.env:
        if req.adapter_source != "auto":
            raise InputError(f"give the adapter source once: --adapter-source or --env {SOURCES_ENV}")
        return {}
    if req.adapter_source == "none":
        return {}
    if req.adapter_source == "auto" and not packaged_adapters:
        log("adapters: none packaged, so no adapter source (the servers carry no adapter slots); "
            "--adapter-source default or s3://... makes room for `fish-sm adapters add`")
        return {}
    if req.adapter_source in ("auto", "default"):
        if req.network_isolation:
            log("note: no adapter source with --network-isolation (the container cannot reach S3): only packaged "
                "adapters are served")
            return {}
        source = default_source(req.model_data, req.name)
    else:
        if req.network_isolation:
            raise InputError("--adapter-source is read from S3 by the container, which --network-isolation cuts "
                             "off; package the adapters instead (fish-sm package --adapter)")
        source = parse_s3_uri(req.adapter_source, what="--adapter-source", prefix=True)
    check_settings({SOURCES_ENV: str(source)})  # as the server will check it at start
    log(f"adapter source: {source} (`fish-sm adapters add {req.name} NAME=PATH` puts adapters there; the role "
        f"must be allowed s3:GetObject on it and s3:ListBucket on {source.bucket})")
    return {SOURCES_ENV: str(source)}


def deploy(aws: AWS, req: DeployRequest, *, wait: bool = True, poll_s: float = 15.0,
           timeout_s: float = 2 * 3600, log: Log = quiet, monitoring: Monitoring | None = None) -> DeployResult:
    """Create the endpoint, or update it blue/green with auto-rollback; then autoscaling when waited.
    With `monitoring`, the container learns the endpoint's name (its metrics' EndpointName) and the
    dashboard and health alarms are made once the endpoint is created or updated."""
    req.validate()
    if req.autoscaling is not None and not wait:
        raise InputError("autoscaling can only be attached once the endpoint is InService: leave out --no-wait")
    sm = aws.sagemaker
    existing = describe_endpoint(aws, req.name)
    if existing is not None and existing["EndpointStatus"] != "InService":
        status, reason = existing["EndpointStatus"], existing.get("FailureReason")
        hint = f"run `fish-sm delete {req.name}` first" if status == "Failed" else "wait until it is InService"
        raise AWSError(f"endpoint {req.name} is {status}{f' ({reason})' if reason else ''}; {hint}")
    checked = check_before_creating(aws, req, log)
    req = with_timeouts(req, checked)
    scaling = with_target(req.autoscaling, gpus=checked.gpus, gpu_model=checked.gpu_model, env=req.env,
                          stock_container=req.stock_container)
    if scaling is not None:
        log(f"autoscaling target: {scaling.target:g} {METRIC_UNITS[scaling.metric]}"
            + (f" ({scaling.reason})" if scaling.reason else ""))
    # The user's --env wins, as every --env does (a FISH_SM_MANIFEST_SHA256 given was checked above).
    named = {ENDPOINT_ENV: req.name} if monitoring is not None else {}
    adapters = adapter_environment(req, log, checked.packaged_adapters)
    env = container_environment({**checked.pinned, **named, **adapters, **req.env},
                                stock_container=req.stock_container, gpus=checked.gpus)
    image, ami = checked.image, req.inference_ami(checked.gpus)

    stamp = new_stamp()
    model_name = config_name = f"{req.name}-{stamp}"
    made: list[tuple[str, str]] = []
    tags = req.resource_tags()
    try:
        sm.create_model(**model_request(req, model_name, image, env))
        made.append(("model", model_name))
        log(f"created model {model_name} ({image})")
        sm.create_endpoint_config(**endpoint_config_request(req, config_name, model_name, checked.gpus))
        made.append(("config", config_name))
        log(f"created endpoint config {config_name}: {req.instances} x {req.instance_type}"
            + (f" ({checked.gpus} GPU{'s' if checked.gpus != 1 else ''}" + (f", {ami})" if ami else ")"))
            + (", asynchronous" if req.async_options else ""))
        aws.cloudwatch.put_metric_alarm(**rollback_alarm_request(req.name, req.rollback_errors), Tags=tags)
        log(f"alarm {rollback_alarm_name(req.name)}: >= {req.rollback_errors} 5XX errors a minute")
        if existing is None:
            sm.create_endpoint(EndpointName=req.name, EndpointConfigName=config_name, Tags=tags)
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
            if req.tags:  # the endpoint exists already: --tags reach it here
                sm.add_tags(ResourceArn=existing["EndpointArn"], Tags=tags[1:])
            action = "updated"
            log(f"updating endpoint {req.name} blue/green (baking {req.bake_seconds} s, "
                f"rolls back when {rollback_alarm_name(req.name)} fires)")
    except BaseException:
        discard_made(aws, made)  # nothing uses them yet: leave no half-made deploy behind
        raise
    if monitoring is not None:
        for line in apply_monitoring(aws, req.name, server_kind(req.env, stock_container=req.stock_container),
                                     monitoring, is_async=req.async_options is not None,
                                     adapters=serves_adapters(env, checked), tags=tags):
            log(line)

    result = DeployResult(action, model_name, config_name, image, checked.gpus, ami,
                          env.get(MANIFEST_ENV), adapter_sources=env.get(SOURCES_ENV))
    if wait:
        result.endpoint = wait_endpoint(aws, req.name, config_name=config_name, poll_s=poll_s,
                                        timeout_s=timeout_s, log=log)
        for line in apply_autoscaling(aws, req.name, scaling, tags=tags):
            log(line)
    return result


def discard_made(aws: AWS, made: list[tuple[str, str]]) -> None:
    """Delete the endpoint configs and models a failed deploy made (best effort, newest first)."""
    for kind, resource in reversed(made):
        try:
            if kind == "config":
                aws.sagemaker.delete_endpoint_config(EndpointConfigName=resource)
            else:
                aws.sagemaker.delete_model(ModelName=resource)
        except Exception:  # best effort: the original error is what the user needs to see
            pass

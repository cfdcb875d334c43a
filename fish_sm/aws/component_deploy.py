"""Deploying with inference components: create an endpoint as an instance pool with its first
component, add a component to it, or update one component's model with a rolling update that
rolls back on its 5XX alarm; then scale the component's copies.

The checks before anything is made are deploy's own (settings, instance type, image, package);
the model is made as deploy makes it. SageMaker places components only on an endpoint that is
InService, so a new endpoint is always waited for before its first component is created.
"""

from __future__ import annotations

from dataclasses import dataclass

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.autoscaling import with_target
from fish_sm.aws.components import (COPY_METRIC_UNITS, ComponentOptions, apply_copy_scaling,
                                    component_rollback_alarm_name, component_rollback_alarm_request,
                                    create_component_request, describe_component, is_component_endpoint,
                                    list_components, pool_config_request, update_component_request, wait_component)
from fish_sm.aws.container import MANIFEST_ENV, container_environment, server_kind
from fish_sm.aws.deploy import check_before_creating, discard_made, serves_adapters, with_timeouts
from fish_sm.aws.deploy_request import DeployRequest, model_request
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config, wait_endpoint
from fish_sm.aws.monitoring import Monitoring, apply_component_monitoring
from fish_sm.aws.naming import new_stamp
from fish_sm.aws.session import AWS
from fish_sm.cloudwatch_metrics import ENDPOINT_ENV
from fish_sm.errors import InputError


@dataclass
class ComponentDeployResult:
    action: str  # created (the endpoint and its first component) | added | updated
    component: str
    model_name: str
    config_name: str | None  # the pool's endpoint config, when this deploy made the endpoint
    image: str
    gpus: int  # on each instance of the pool
    accelerators: int | None  # per copy
    manifest_sha256: str | None = None
    component_desc: dict | None = None  # the final describe when waited


def deploy_component(aws: AWS, req: DeployRequest, opts: ComponentOptions, *, wait: bool = True,
                     poll_s: float = 15.0, timeout_s: float = 2 * 3600, log: Log = quiet,
                     monitoring: Monitoring | None = None) -> ComponentDeployResult:
    """Create endpoint req.name with its first component, add a component, or (opts.update) update one.
    With `monitoring`, the container learns the endpoint's name (its metrics' EndpointName) and the
    endpoint's dashboard and health alarms are made once the component is created or updated."""
    req.validate()
    opts.validate(req.instances)
    if req.async_options is not None:
        raise InputError("asynchronous endpoints cannot hold inference components: leave out --async")
    if req.autoscaling is not None:
        raise InputError("a component endpoint scales copies (--min-copies/--max-copies) and its instance pool "
                         "follows them between --min and --max")
    scaling = opts.scaling()
    if scaling is not None and not wait:
        raise InputError("autoscaling of copies can only be attached once the component is InService: "
                         "leave out --no-wait")
    component = opts.component_name(req.name)
    sm = aws.sagemaker
    existing = describe_endpoint(aws, req.name)
    current = None
    if existing is None:
        if opts.update:
            raise AWSError(f"endpoint {req.name} does not exist in {aws.region_name}: nothing to update")
    else:
        status = existing["EndpointStatus"]
        if status != "InService":
            reason = existing.get("FailureReason")
            hint = f"run `fish-sm delete {req.name}` first" if status == "Failed" else "wait until it is InService"
            raise AWSError(f"endpoint {req.name} is {status}{f' ({reason})' if reason else ''}; {hint}")
        pool = (endpoint_config(aws, existing).get("ProductionVariants") or [{}])[0]
        if not is_component_endpoint({"ProductionVariants": [pool]}):
            raise AWSError(f"endpoint {req.name} serves one model, not inference components: deploy components "
                           "to a new endpoint name (or `fish-sm delete` this one first)")
        if pool.get("InstanceType") and pool["InstanceType"] != req.instance_type:
            log(f"note: endpoint {req.name}'s instance pool is {pool['InstanceType']}; the component is placed "
                f"there (--instance-type {req.instance_type} applies only when the endpoint is created)")
            req = _with_instance_type(req, pool["InstanceType"])
        current = describe_component(aws, component)
        if current is not None and current.get("EndpointName") != req.name:
            raise AWSError(f"component {component} belongs to endpoint {current.get('EndpointName')} (component "
                           "names are unique in a region): choose another --component")
        if current is None and opts.update:
            raise AWSError(f"endpoint {req.name} has no component {component} to update: leave out --update to add it")
        if current is not None and not opts.update:
            raise AWSError(f"endpoint {req.name} has component {component} already: pass --update to replace its "
                           f"model (rolling, with rollback), or `fish-sm scale {req.name} --component {component} "
                           "--copies N`")

    checked = check_before_creating(aws, req, log)
    req = with_timeouts(req, checked)
    accelerators = opts.accelerators_for(checked.gpus)
    scaling = with_target(scaling, gpus=accelerators or 0, gpu_model=checked.gpu_model, env=req.env,
                          stock_container=req.stock_container)
    if scaling is not None:
        log(f"autoscaling target: {scaling.target:g} {COPY_METRIC_UNITS[scaling.metric]}"
            + (f" ({scaling.reason})" if scaling.reason else ""))
    # Each copy sees only its own accelerators, so the container is set up for those.
    named = {ENDPOINT_ENV: req.name} if monitoring is not None else {}
    env = container_environment({**checked.pinned, **named, **req.env}, stock_container=req.stock_container,
                                gpus=accelerators or 0)
    tags = req.resource_tags()
    model_name = config_name = f"{req.name}-{new_stamp()}"
    made: list[tuple[str, str]] = []
    try:
        sm.create_model(**model_request(req, model_name, checked.image, env))
        made.append(("model", model_name))
        log(f"created model {model_name} ({checked.image})")
        if existing is None:
            lo, hi = opts.pool(req.instances)
            ami = req.inference_ami(checked.gpus)
            sm.create_endpoint_config(**pool_config_request(req, opts, config_name, ami))
            made.append(("config", config_name))
            log(f"created endpoint config {config_name}: a pool of {req.instance_type} ({req.instances} at first, "
                f"{lo}-{hi} as the copies need" + (f", {ami})" if ami else ")"))
            sm.create_endpoint(EndpointName=req.name, EndpointConfigName=config_name, Tags=tags)
            made.clear()  # the endpoint uses the config now; a later failure leaves it for `fish-sm delete`
            made.append(("model", model_name))
            log(f"creating endpoint {req.name}")
    except BaseException:
        discard_made(aws, made)
        raise
    if existing is None:
        wait_endpoint(aws, req.name, config_name=config_name, poll_s=poll_s, timeout_s=timeout_s, log=log)

    per_copy = (f"{accelerators} GPU{'s' if accelerators != 1 else ''} and " if accelerators else "") + \
        f"{opts.memory_mb} MB a copy"
    try:
        if current is None:
            sm.create_inference_component(**create_component_request(req, opts, model_name, accelerators))
            action = "created" if existing is None else "added"
            log(f"creating component {component}: {opts.copies} cop{'ies' if opts.copies != 1 else 'y'}, {per_copy}")
        else:
            aws.cloudwatch.put_metric_alarm(**component_rollback_alarm_request(req.name, component,
                                                                               req.rollback_errors), Tags=tags)
            log(f"alarm {component_rollback_alarm_name(req.name, component)}: >= {req.rollback_errors} 5XX errors "
                "a minute")
            desired = (current.get("RuntimeConfig") or {}).get("DesiredCopyCount") or opts.copies
            sm.update_inference_component(**update_component_request(req, opts, model_name, accelerators, desired))
            action = "updated"
            log(f"updating component {component} to {model_name}, {opts.batch_copies} cop"
                f"{'ies' if opts.batch_copies != 1 else 'y'} at a time (baking {req.bake_seconds} s each, rolls "
                f"back when {component_rollback_alarm_name(req.name, component)} fires)")
    except BaseException:
        discard_made(aws, made)  # the component never used the model
        raise
    if monitoring is not None:
        components = sorted(set(list_components(aws, req.name)) | {component})
        for line in apply_component_monitoring(aws, req.name, component,
                                               server_kind(req.env, stock_container=req.stock_container), components,
                                               monitoring, adapters=serves_adapters(env, checked), tags=tags):
            log(line)

    result = ComponentDeployResult(action, component, model_name, config_name if existing is None else None,
                                   checked.image, checked.gpus, accelerators, env.get(MANIFEST_ENV))
    if wait:
        result.component_desc = wait_component(aws, component, model_name=model_name if current else None,
                                               poll_s=poll_s, timeout_s=timeout_s, log=log)
        if scaling is not None or current is not None:  # an update without scaling options removes it
            for line in apply_copy_scaling(aws, req.name, component, scaling, tags=tags):
                log(line)
    return result


def _with_instance_type(req: DeployRequest, instance_type: str) -> DeployRequest:
    import dataclasses

    return dataclasses.replace(req, instance_type=instance_type)

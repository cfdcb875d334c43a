"""Autoscaling an endpoint's variant: the options checked together, the default target, and the
policies, scalable target and wake alarm that make it so (or are removed)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fish_sm.aws.alarms import delete_alarms, list_alarms
from fish_sm.aws.container import max_batch, server_kind
from fish_sm.aws.naming import resource_id, wake_alarm_name
from fish_sm.aws.session import AWS
from fish_sm.errors import InputError

DIMENSION = "sagemaker:variant:DesiredInstanceCount"
POLICY_PREFIX = "fish-sm-"
WAKE_POLICY = "fish-sm-wake-from-zero"


@dataclass
class Autoscaling:
    """Target tracking on one metric between min and max instances (min 0: async scale-to-zero)."""

    min: int
    max: int
    target: float | None  # None: the default for the server and instance type, set by with_target
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
# The batching server decodes up to FISH_SM_MAX_BATCH requests together on each GPU. Where its
# GPU model has not been measured, scaling out at half of those slots keeps each stream fast and
# leaves room for a burst while new instances start (minutes), before requests queue and, past
# FISH_SM_MAX_QUEUE, get 503: on an H100 at 32 of 64 streams each stream still decodes at >= 6x
# real time with first audio p95 ~0.12 s (0.3 s through HTTP); at 64, 4x and ~0.3 s
# (docs/benchmarks.md).
BATCH_TARGET_SHARE = 0.5
# An unmeasured GPU whose slots are sized by memory: as many streams as the smallest GPUs keep fed.
UNMEASURED_PER_GPU = 32
# Where it has been measured (fish_sm.aws.capacity), the target is this share of what the GPUs
# hold in flight at their measured capacity: scaling out at 70% leaves the other 30% for the
# traffic that keeps arriving while a new instance starts, before the listeners underrun.
CAPACITY_HEADROOM = 0.7


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def batching_target(*, gpus: int, gpu_model: str | None, batch: int) -> tuple[float, str]:
    """The batching server's concurrency target per instance, and why.

    SageMaker's concurrency metric counts requests in flight at the container; the batching
    server paces each stream to its listener, so a stream is in flight for about as long as it
    plays and the requests in flight at capacity are about the measured real-time streams, and
    at most the FISH_SM_MAX_BATCH requests a GPU holds when that is set (0: slots by memory;
    more wait in the queue, which costs first audio, and past FISH_SM_MAX_QUEUE get 503, so a
    target above slots + queue would never be reached). The target is CAPACITY_HEADROOM of
    that, x GPUs. A GPU model without a measurement (or an unknown one) falls back to
    BATCH_TARGET_SHARE of FISH_SM_MAX_BATCH, or UNMEASURED_PER_GPU when slots are sized by memory.
    """
    from fish_sm.aws.capacity import measured_capacity

    engines = max(gpus, 1)
    found = measured_capacity(gpu_model) if gpus else None
    if found is not None:
        batch = batch or found.streams_per_gpu
        per_gpu = min(found.streams_per_gpu, batch)
        value = round(per_gpu * engines * CAPACITY_HEADROOM, 1)
        bound = ("the measured streams" if found.streams_per_gpu <= batch
                 else f"FISH_SM_MAX_BATCH {batch} decoding at once, fewer than the measured streams")
        return value, (f"{CAPACITY_HEADROOM:.0%} of {_plural(gpus, gpu_model)} x {per_gpu} requests in flight at the "
                       f"measured capacity: {found.streams_per_gpu} real-time streams per {gpu_model} under the SLO "
                       f"({found.device}, {found.date}, {found.source}), in flight at most {bound}; headroom for "
                       "traffic while a new instance starts")
    where = _plural(gpus, "GPU") if gpus else "1 CPU engine"
    if batch:
        value = batch * engines * BATCH_TARGET_SHARE
        why = (f"{BATCH_TARGET_SHARE:.0%} of the batching server's {batch * engines} slots: "
               f"{where} x FISH_SM_MAX_BATCH {batch}")
    else:
        value = float(UNMEASURED_PER_GPU * engines)
        why = (f"{UNMEASURED_PER_GPU} requests in flight per engine ({where}): the server sizes its slots by "
               "memory at start (FISH_SM_MAX_BATCH 0)")
    if gpus:
        unknown = (f"the {gpu_model} GPU is not measured" if gpu_model
                   else "the GPU model is unknown (--gpus N does not say it)")
        why += (f"; {unknown}: `fish-sm capacity` measures one, and --target gives the measured figure")
    return value, why


def default_target(metric: str, *, gpus: int, gpu_model: str | None = None, env: dict[str, str] | None = None,
                   stock_container: bool = False) -> tuple[float, str]:
    """The target value when --target is not given, and a short reason to print.

    Concurrency on our image: from the GPU model's measured capacity (batching_target). On the
    multi-model server, and for invocations a minute (which depend on how long the texts are,
    so slots say little about them) or async backlog: the fixed DEFAULT_TARGETS.
    """
    env = env or {}
    server = server_kind(env, stock_container=stock_container)
    if metric == "concurrency" and server == "batching":
        return batching_target(gpus=gpus, gpu_model=gpu_model, batch=max_batch(env))
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
                     target: float | None, metric: str, is_async: bool, scale_to_zero: bool) -> Autoscaling | None:
    """Check the autoscaling options together; None when none were asked for.

    Without --target the target stays None until the instance type's GPUs are known (with_target).
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
        return Autoscaling(lo, max_instances, None, metric)
    if target <= 0:
        raise InputError(f"--target must be positive, got {target}")
    return Autoscaling(lo, max_instances, float(target), metric, "given with --target")


def with_target(scaling: Autoscaling | None, *, gpus: int, gpu_model: str | None = None,
                env: dict[str, str] | None = None, stock_container: bool = False) -> Autoscaling | None:
    """`scaling` with its default target filled in (see default_target) when --target was not given."""
    if scaling is None or scaling.target is not None:
        return scaling
    value, reason = default_target(scaling.metric, gpus=gpus, gpu_model=gpu_model, env=env,
                                   stock_container=stock_container)
    return dataclasses.replace(scaling, target=value, reason=reason)


def scalable_target(aws: AWS, name: str) -> dict | None:
    targets = aws.autoscaling.describe_scalable_targets(
        ServiceNamespace="sagemaker", ResourceIds=[resource_id(name)], ScalableDimension=DIMENSION)
    return next(iter(targets.get("ScalableTargets", [])), None)


def scaling_policies(aws: AWS, name: str) -> list[dict]:
    pages = aws.autoscaling.get_paginator("describe_scaling_policies").paginate(
        ServiceNamespace="sagemaker", ResourceId=resource_id(name), ScalableDimension=DIMENSION)
    return [p for page in pages for p in page.get("ScalingPolicies", []) if p.get("ResourceId") == resource_id(name)]


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


def apply_autoscaling(aws: AWS, name: str, scaling: Autoscaling | None, tags: list[dict] | None = None) -> list[str]:
    """Make the endpoint's scaling what was asked for (None: none), removing our stale policies.
    `tags` go on the scalable target and the wake alarm (policies take none)."""
    if scaling is None:
        return remove_autoscaling(aws, name)
    aa, done = aws.autoscaling, []
    tagged = {"Tags": {t["Key"]: t["Value"] for t in tags}} if tags else {}
    aa.register_scalable_target(ServiceNamespace="sagemaker", ResourceId=resource_id(name),
                                ScalableDimension=DIMENSION, MinCapacity=scaling.min, MaxCapacity=scaling.max,
                                **tagged)
    done.append(f"autoscaling {name}: {scaling.min}-{scaling.max} instances")
    policy = policy_request(name, scaling)
    aa.put_scaling_policy(**policy)
    done.append(f"policy {policy['PolicyName']}: target {scaling.target:g} {METRIC_UNITS[scaling.metric]}")
    wanted = {policy["PolicyName"]}
    if scaling.scale_to_zero:
        arn = aa.put_scaling_policy(**wake_policy_request(name))["PolicyARN"]
        aws.cloudwatch.put_metric_alarm(**wake_alarm_request(name, arn), **({"Tags": tags} if tags else {}))
        wanted.add(WAKE_POLICY)
        done.append(f"policy {WAKE_POLICY} + alarm {wake_alarm_name(name)}: scales up from zero on a backlog")
    for p in scaling_policies(aws, name):
        if p["PolicyName"].startswith(POLICY_PREFIX) and p["PolicyName"] not in wanted:
            aa.delete_scaling_policy(PolicyName=p["PolicyName"], ServiceNamespace="sagemaker",
                                     ResourceId=resource_id(name), ScalableDimension=DIMENSION)
            done.append(f"removed stale policy {p['PolicyName']}")
    if not scaling.scale_to_zero:
        done += delete_alarms(aws, [a["AlarmName"] for a in list_alarms(aws, wake_alarm_name(name))])
    return done


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
    done += delete_alarms(aws, [a["AlarmName"] for a in list_alarms(aws, wake_alarm_name(name))])
    return done

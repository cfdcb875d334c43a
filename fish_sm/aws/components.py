"""Inference components: an endpoint whose variant is a pool of instances (managed instance
scaling, down to 0) shared by several models, each an inference component with its own copies,
accelerators and memory, scaled by copy count.

Here: the options of a component deploy checked together, the SageMaker, Application Auto
Scaling and CloudWatch requests made from them, reading components back (list, describe, wait),
setting copies, and deleting them. The deploy itself is fish_sm.aws.component_deploy.

Scale to zero follows AWS's documented pattern (endpoint-auto-scaling-zero-instances): the
component's scalable target has a minimum of 0 copies, target tracking takes it there when idle,
and since target tracking cannot leave 0 (no copy, no concurrency per copy), a step scaling
policy adds a copy when an alarm sees NoCapacityInvocationFailures, i.e. on the first call that
found no copy. That call fails (a ValidationError saying there is no capacity); `fish-sm invoke`
waits and retries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.autoscaling import POLICY_PREFIX, WAKE_POLICY, Autoscaling
from fish_sm.aws.naming import VARIANT, alarm_prefix, check_name
from fish_sm.aws.endpoints import describe_or_none
from fish_sm.aws.session import AWS
from fish_sm.errors import InputError

COPY_DIMENSION = "sagemaker:inference-component:DesiredCopyCount"
COPY_METRICS = {"concurrency": "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution",
                "invocations": "SageMakerInferenceComponentInvocationsPerCopy"}
COPY_METRIC_UNITS = {"concurrency": "concurrent requests per copy", "invocations": "invocations per copy a minute"}
# Host memory one copy reserves: the 3.6 GB checkpoint is read into host memory before it moves to
# the GPU, next to torch, the codec and the server; 8 GiB leaves room for that on ml.g5.xlarge (16 GiB).
DEFAULT_MEMORY_MB = 8192
FAILED_STATES = ("Failed",)


def component_resource_id(component: str) -> str:
    return f"inference-component/{component}"


def no_capacity_alarm_name(endpoint: str, component: str) -> str:
    """Under the endpoint's alarm prefix, so `delete NAME` removes it with the others."""
    return f"{alarm_prefix(endpoint)}{component}/no-capacity"


def component_rollback_alarm_name(endpoint: str, component: str) -> str:
    return f"{alarm_prefix(endpoint)}{component}/invocation-5xx"


@dataclass
class ComponentOptions:
    """What a component deploy asks for besides the model (which DeployRequest carries)."""

    name: str | None = None  # None: the endpoint's own name
    copies: int = 1
    min_copies: int | None = None  # None: --copies; 0: scale to zero
    max_copies: int | None = None  # given (or min 0): autoscaling of copies
    accelerators: int | None = None  # per copy; None: 1 on a GPU type, none on a CPU type
    memory_mb: int = DEFAULT_MEMORY_MB
    target: float | None = None  # per copy; None: the server's default for the copy's GPUs
    metric: str = "concurrency"
    min_instances: int | None = None  # the pool; None: 0 when scaling to zero, else --instances
    max_instances: int | None = None  # None: at least --instances
    update: bool = False  # replace the component's model with a rolling update
    batch_copies: int = 1  # copies replaced at a time in an update

    @property
    def scale_to_zero(self) -> bool:
        return self.min_copies == 0

    def component_name(self, endpoint: str) -> str:
        return self.name or endpoint

    def validate(self, instances: int) -> None:
        if self.name is not None:
            try:
                check_name(self.name)
            except InputError:
                raise InputError(f"--component {self.name!r} must be letters, digits and '-' between them, "
                                 "at most 63 characters") from None
        if self.copies < 0:
            raise InputError(f"--copies must be at least 0, got {self.copies}")
        if self.copies == 0 and not self.scale_to_zero:
            raise InputError("--copies 0 needs --min-copies 0 (scale to zero), or the component never serves")
        if self.min_copies is not None and self.max_copies is None and not self.scale_to_zero:
            raise InputError("--min-copies needs --max-copies (autoscaling of copies)")
        if self.scaling() is not None:
            lo, hi = self.scaling().min, self.scaling().max
            if not lo <= self.copies <= hi:
                raise InputError(f"--copies ({self.copies}) must lie between --min-copies ({lo}) and "
                                 f"--max-copies ({hi})")
            if hi < 1:
                raise InputError("--max-copies must be at least 1")
        if self.target is not None and self.target <= 0:
            raise InputError(f"--target must be positive, got {self.target}")
        if self.metric not in COPY_METRICS:
            raise InputError(f"--metric {self.metric}: components scale on {' or '.join(COPY_METRICS)}")
        if self.accelerators is not None and self.accelerators < 1:
            raise InputError(f"--accelerators must be at least 1, got {self.accelerators}")
        if self.memory_mb < 128:
            raise InputError(f"--memory must be at least 128 MB, got {self.memory_mb}")
        if self.batch_copies < 1:
            raise InputError(f"--batch-copies must be at least 1, got {self.batch_copies}")
        lo, hi = self.pool(instances)
        if not lo <= instances <= hi:
            raise InputError(f"--instances ({instances}) must lie between the pool's --min ({lo}) and --max ({hi})")

    def scaling(self) -> Autoscaling | None:
        """Copies between min and max by target tracking; None when no autoscaling was asked for."""
        if self.max_copies is None and not self.scale_to_zero:
            return None
        lo = self.copies if self.min_copies is None else self.min_copies
        hi = self.max_copies if self.max_copies is not None else max(self.copies, 1)
        reason = "given with --target" if self.target is not None else ""
        return Autoscaling(lo, hi, self.target, self.metric, reason)

    def pool(self, instances: int) -> tuple[int, int]:
        """The pool's managed instance scaling bounds: instances follow the copies placed on them."""
        lo = self.min_instances if self.min_instances is not None else (0 if self.scale_to_zero else instances)
        hi = self.max_instances if self.max_instances is not None else max(instances, lo, 1)
        if lo < 0 or hi < 1 or hi < lo:
            raise InputError(f"the instance pool needs 0 <= --min <= --max and --max >= 1, got {lo}-{hi}")
        return lo, hi

    def accelerators_for(self, gpus: int) -> int | None:
        """GPUs each copy reserves on an instance with `gpus` (None on a CPU type)."""
        if gpus == 0:
            if self.accelerators:
                raise InputError(f"--accelerators {self.accelerators}: the instance type has no GPU")
            return None
        wanted = self.accelerators or 1
        if wanted > gpus:
            raise InputError(f"--accelerators {wanted}: the instance type has {gpus} "
                             f"GPU{'s' if gpus != 1 else ''}")
        return wanted


# --- requests --------------------------------------------------------------------------------------------


def pool_config_request(req, opts: ComponentOptions, config_name: str, ami: str | None) -> dict:
    """The endpoint config of a component endpoint: a variant with no model, only the instance pool.
    The role, VPC and isolation sit on the config, where SageMaker takes them for components."""
    lo, hi = opts.pool(req.instances)
    variant = {
        "VariantName": VARIANT, "InstanceType": req.instance_type, "InitialInstanceCount": req.instances,
        "ManagedInstanceScaling": {"Status": "ENABLED", "MinInstanceCount": lo, "MaxInstanceCount": hi},
        # Long and short texts differ in cost by 100x: send each request to the least busy copy.
        "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
    }
    if ami is not None:
        variant["InferenceAmiVersion"] = ami
    out = dict(EndpointConfigName=config_name, ExecutionRoleArn=req.role, ProductionVariants=[variant],
               Tags=req.resource_tags())
    if req.subnets:
        out["VpcConfig"] = {"Subnets": list(req.subnets), "SecurityGroupIds": list(req.security_groups)}
    if req.network_isolation:
        out["EnableNetworkIsolation"] = True
    if req.kms_key is not None:
        out["KmsKeyId"] = req.kms_key
    if req.data_capture is not None:
        out["DataCaptureConfig"] = req.data_capture.config()
    return out


def component_specification(req, opts: ComponentOptions, model_name: str, accelerators: int | None) -> dict:
    compute: dict = {"MinMemoryRequiredInMb": opts.memory_mb}
    if accelerators:
        compute["NumberOfAcceleratorDevicesRequired"] = float(accelerators)
    return {"ModelName": model_name, "ComputeResourceRequirements": compute,
            "StartupParameters": {"ModelDataDownloadTimeoutInSeconds": req.download_timeout,
                                  "ContainerStartupHealthCheckTimeoutInSeconds": req.startup_timeout}}


def create_component_request(req, opts: ComponentOptions, model_name: str, accelerators: int | None) -> dict:
    return dict(InferenceComponentName=opts.component_name(req.name), EndpointName=req.name, VariantName=VARIANT,
                Specification=component_specification(req, opts, model_name, accelerators),
                RuntimeConfig={"CopyCount": opts.copies}, Tags=req.resource_tags())


def update_component_request(req, opts: ComponentOptions, model_name: str, accelerators: int | None,
                             copies: int) -> dict:
    """A rolling update: --batch-copies new copies at a time, each batch watched for --bake seconds by
    the component's 5XX alarm; when it fires, every copy goes back to the old model at once."""
    component = opts.component_name(req.name)
    batches = max(1, -(-max(copies, 1) // opts.batch_copies))
    # Room for each batch's download and warm-up (twice, for a retried copy) and its baking.
    limit = batches * (2 * (req.startup_timeout + req.download_timeout) + req.bake_seconds)
    return dict(
        InferenceComponentName=component,
        Specification=component_specification(req, opts, model_name, accelerators),
        DeploymentConfig={
            "RollingUpdatePolicy": {
                "MaximumBatchSize": {"Type": "COPY_COUNT", "Value": opts.batch_copies},
                "WaitIntervalInSeconds": req.bake_seconds,
                "MaximumExecutionTimeoutInSeconds": max(600, min(28800, limit)),
                "RollbackMaximumBatchSize": {"Type": "CAPACITY_PERCENT", "Value": 100},
            },
            "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": component_rollback_alarm_name(req.name, component)}]},
        })


def component_rollback_alarm_request(endpoint: str, component: str, threshold: int) -> dict:
    """5XX errors of one component (SageMaker's per-component metrics carry InferenceComponentName)."""
    return dict(
        AlarmName=component_rollback_alarm_name(endpoint, component),
        AlarmDescription=f"fish-sm: 5XX errors from component {component} of endpoint {endpoint}; "
                         "rolls back its updates",
        Namespace="AWS/SageMaker", MetricName="Invocation5XXErrors",
        Dimensions=[{"Name": "InferenceComponentName", "Value": component}],
        Statistic="Sum", Period=60, EvaluationPeriods=1, Threshold=float(threshold),
        ComparisonOperator="GreaterThanOrEqualToThreshold", TreatMissingData="notBreaching",
    )


def copy_target_request(component: str, scaling: Autoscaling) -> dict:
    return dict(ServiceNamespace="sagemaker", ResourceId=component_resource_id(component),
                ScalableDimension=COPY_DIMENSION, MinCapacity=scaling.min, MaxCapacity=scaling.max)


def copy_policy_request(component: str, scaling: Autoscaling) -> dict:
    return dict(PolicyName=POLICY_PREFIX + scaling.metric, ServiceNamespace="sagemaker",
                ResourceId=component_resource_id(component), ScalableDimension=COPY_DIMENSION,
                PolicyType="TargetTrackingScaling",
                TargetTrackingScalingPolicyConfiguration={
                    "TargetValue": scaling.target,
                    "PredefinedMetricSpecification": {"PredefinedMetricType": COPY_METRICS[scaling.metric]},
                    "ScaleInCooldown": 300, "ScaleOutCooldown": 60})


def wake_policy_request(component: str) -> dict:
    """One copy more when the no-capacity alarm fires (AWS's documented step policy)."""
    return dict(PolicyName=WAKE_POLICY, ServiceNamespace="sagemaker", ResourceId=component_resource_id(component),
                ScalableDimension=COPY_DIMENSION, PolicyType="StepScaling",
                StepScalingPolicyConfiguration={
                    "AdjustmentType": "ChangeInCapacity", "MetricAggregationType": "Maximum", "Cooldown": 60,
                    "StepAdjustments": [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}]})


def no_capacity_alarm_request(endpoint: str, component: str, policy_arn: str) -> dict:
    # AWS's example alarms when the sum is greater than 1, i.e. on the second failed call in a
    # minute; greater than or equal wakes the component on the first.
    return dict(
        AlarmName=no_capacity_alarm_name(endpoint, component),
        AlarmDescription=f"fish-sm: a call found component {component} of endpoint {endpoint} with no copy; adds one",
        Namespace="AWS/SageMaker", MetricName="NoCapacityInvocationFailures",
        Dimensions=[{"Name": "InferenceComponentName", "Value": component}],
        Statistic="Sum", Period=60, EvaluationPeriods=1, DatapointsToAlarm=1, Threshold=1.0,
        ComparisonOperator="GreaterThanOrEqualToThreshold", TreatMissingData="notBreaching",
        AlarmActions=[policy_arn],
    )


# --- reading ---------------------------------------------------------------------------------------------


def is_component_endpoint(config: dict) -> bool:
    """An endpoint config whose variant names no model serves inference components."""
    variants = config.get("ProductionVariants") or []
    return bool(variants) and "ModelName" not in variants[0] and "ServerlessConfig" not in variants[0]


def describe_component(aws: AWS, component: str) -> dict | None:
    return describe_or_none(aws.sagemaker.describe_inference_component, InferenceComponentName=component)


def list_components(aws: AWS, endpoint: str) -> list[str]:
    """The names of the endpoint's components, sorted."""
    pages = aws.sagemaker.get_paginator("list_inference_components").paginate(EndpointNameEquals=endpoint)
    return sorted(c["InferenceComponentName"] for page in pages for c in page.get("InferenceComponents", []))


def require_component(aws: AWS, endpoint: str, component: str) -> dict:
    found = describe_component(aws, component)
    if found is None or found.get("EndpointName") != endpoint:
        where = f" (it belongs to endpoint {found['EndpointName']})" if found else ""
        raise AWSError(f"endpoint {endpoint} has no component {component!r}{where}")
    return found


def copies(desc: dict) -> dict:
    runtime = desc.get("RuntimeConfig") or {}
    return {"current": runtime.get("CurrentCopyCount"), "desired": runtime.get("DesiredCopyCount")}


def wait_component(aws: AWS, component: str, *, model_name: str | None = None, poll_s: float = 15.0,
                   timeout_s: float = 2 * 3600, log: Log = quiet) -> dict:
    """Poll until the component is InService; on failure raise with SageMaker's FailureReason.

    With model_name (an update), coming back InService on another model means the update was
    rolled back, which is a failure too."""
    t0 = time.monotonic()
    last, last_line = None, t0
    while True:
        desc = describe_component(aws, component)
        elapsed = time.monotonic() - t0
        if desc is None:
            raise AWSError(f"component {component} disappeared while waiting (deleted?)")
        status = desc.get("InferenceComponentStatus")
        if status != last or time.monotonic() - last_line >= 60:
            c = copies(desc)
            log(f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] component {component}: {status}, "
                f"{c['current']}/{c['desired']} copies" + (" (still)" if status == last else ""))
            last, last_line = status, time.monotonic()
        reason = desc.get("FailureReason")
        if status == "InService":
            serving = (desc.get("Specification") or {}).get("ModelName")
            if model_name and serving != model_name:
                raise AWSError(f"the update of component {component} was rolled back "
                               f"({reason or 'its 5XX alarm fired'}); it still serves {serving}")
            return desc
        if status in FAILED_STATES:
            raise AWSError(f"component {component} is {status}: {reason or 'SageMaker gave no reason'}")
        if elapsed > timeout_s:
            raise AWSError(f"gave up after {int(elapsed)} s: component {component} is still {status}")
        time.sleep(poll_s)


def copy_target(aws: AWS, component: str) -> dict | None:
    found = aws.autoscaling.describe_scalable_targets(
        ServiceNamespace="sagemaker", ResourceIds=[component_resource_id(component)], ScalableDimension=COPY_DIMENSION)
    return next(iter(found.get("ScalableTargets", [])), None)


def copy_policies(aws: AWS, component: str) -> list[dict]:
    rid = component_resource_id(component)
    pages = aws.autoscaling.get_paginator("describe_scaling_policies").paginate(
        ServiceNamespace="sagemaker", ResourceId=rid, ScalableDimension=COPY_DIMENSION)
    return [p for page in pages for p in page.get("ScalingPolicies", []) if p.get("ResourceId") == rid]


def component_status(aws: AWS, endpoint: str, component: str) -> dict:
    """One component as `fish-sm status` shows it: state, model, copies, per-copy resources, autoscaling."""
    desc = describe_component(aws, component) or {"InferenceComponentName": component}
    spec = desc.get("Specification") or {}
    compute = spec.get("ComputeResourceRequirements") or {}
    out = {"name": component, "status": desc.get("InferenceComponentStatus"),
           "failure_reason": desc.get("FailureReason"), "model": spec.get("ModelName"), "copies": copies(desc),
           "accelerators": compute.get("NumberOfAcceleratorDevicesRequired"),
           "memory_mb": compute.get("MinMemoryRequiredInMb"), "autoscaling": None}
    target = copy_target(aws, component)
    if target is not None:
        policies = []
        for p in copy_policies(aws, component):
            tt = p.get("TargetTrackingScalingPolicyConfiguration")
            metric = tt.get("PredefinedMetricSpecification", {}).get("PredefinedMetricType") if tt else None
            policies.append({"name": p["PolicyName"], "type": p["PolicyType"], "metric": metric,
                             "target": tt.get("TargetValue") if tt else None})
        out["autoscaling"] = {"min": target["MinCapacity"], "max": target["MaxCapacity"], "policies": policies}
    return out


# --- changing --------------------------------------------------------------------------------------------


def apply_copy_scaling(aws: AWS, endpoint: str, component: str, scaling: Autoscaling | None,
                       tags: list[dict] | None = None) -> list[str]:
    """Make the component's copy scaling what was asked for (None: none): the scalable target, the
    target tracking policy, and with a minimum of 0 the wake policy and its no-capacity alarm."""
    if scaling is None:
        return remove_copy_scaling(aws, endpoint, component)
    aa, done = aws.autoscaling, []
    tagged = {"Tags": {t["Key"]: t["Value"] for t in tags}} if tags else {}
    aa.register_scalable_target(**copy_target_request(component, scaling), **tagged)
    done.append(f"autoscaling component {component}: {scaling.min}-{scaling.max} copies")
    policy = copy_policy_request(component, scaling)
    aa.put_scaling_policy(**policy)
    done.append(f"policy {policy['PolicyName']}: target {scaling.target:g} {COPY_METRIC_UNITS[scaling.metric]}")
    wanted = {policy["PolicyName"]}
    alarm = no_capacity_alarm_name(endpoint, component)
    if scaling.scale_to_zero:
        arn = aa.put_scaling_policy(**wake_policy_request(component))["PolicyARN"]
        aws.cloudwatch.put_metric_alarm(**no_capacity_alarm_request(endpoint, component, arn),
                                        **({"Tags": tags} if tags else {}))
        wanted.add(WAKE_POLICY)
        done.append(f"policy {WAKE_POLICY} + alarm {alarm}: the first call that finds no copy adds one")
    for p in copy_policies(aws, component):
        if p["PolicyName"].startswith(POLICY_PREFIX) and p["PolicyName"] not in wanted:
            aa.delete_scaling_policy(PolicyName=p["PolicyName"], ServiceNamespace="sagemaker",
                                     ResourceId=component_resource_id(component), ScalableDimension=COPY_DIMENSION)
            done.append(f"removed stale policy {p['PolicyName']} of component {component}")
    if not scaling.scale_to_zero:
        done += _delete_alarm_if_there(aws, alarm)
    return done


def remove_copy_scaling(aws: AWS, endpoint: str, component: str) -> list[str]:
    """Deregister the component's scalable target (which deletes its policies) and its wake alarm."""
    done = []
    if copy_target(aws, component) is not None:
        aws.autoscaling.deregister_scalable_target(ServiceNamespace="sagemaker",
                                                   ResourceId=component_resource_id(component),
                                                   ScalableDimension=COPY_DIMENSION)
        done.append(f"removed autoscaling of component {component}")
    return done + _delete_alarm_if_there(aws, no_capacity_alarm_name(endpoint, component))


def _delete_alarm_if_there(aws: AWS, name: str) -> list[str]:
    found = aws.cloudwatch.describe_alarms(AlarmNames=[name]).get("MetricAlarms", [])
    if not found:
        return []
    aws.cloudwatch.delete_alarms(AlarmNames=[name])
    return [f"removed alarm {name}"]


def scale_copies(aws: AWS, endpoint: str, component: str, count: int, *, wait: bool = True, poll_s: float = 15.0,
                 timeout_s: float = 3600, log: Log = quiet) -> dict:
    """Set the component's copies now (UpdateInferenceComponentRuntimeConfig). Autoscaling, if
    attached, keeps acting within its min/max, so a count outside them moves the bound to it."""
    if count < 0:
        raise AWSError(f"--copies must be at least 0, got {count}")
    desc = require_component(aws, endpoint, component)
    if desc.get("InferenceComponentStatus") != "InService":
        raise AWSError(f"component {component} is {desc.get('InferenceComponentStatus')}; "
                       "its copies can be set once InService")
    target = copy_target(aws, component)
    if target is not None:
        lo, hi = target["MinCapacity"], target["MaxCapacity"]
        new_lo, new_hi = min(lo, count), max(hi, count)
        if (new_lo, new_hi) != (lo, hi):
            aws.autoscaling.register_scalable_target(
                **copy_target_request(component, Autoscaling(new_lo, new_hi, None, "concurrency")))
            log(f"autoscaling of component {component} was {lo}-{hi} copies, now {new_lo}-{new_hi} "
                f"so that {count} holds")
        else:
            log(f"note: autoscaling ({lo}-{hi} copies) stays on and may change the count again")
    aws.sagemaker.update_inference_component_runtime_config(InferenceComponentName=component,
                                                            DesiredRuntimeConfig={"CopyCount": count})
    log(f"asked for {count} cop{'ies' if count != 1 else 'y'} of component {component}")
    if count == 0:
        log("note: with no copy, calls fail until one is added (by the wake alarm when deployed with "
            "--min-copies 0, else by `fish-sm scale`)")
    if wait:
        desc = wait_component(aws, component, poll_s=poll_s, timeout_s=timeout_s, log=log)
    else:
        desc = describe_component(aws, component) or desc
    return {"name": endpoint, "component": component, "status": desc.get("InferenceComponentStatus"),
            "copies": copies(desc)}


def delete_components(aws: AWS, endpoint: str, *, poll_s: float = 15.0, timeout_s: float = 1800) -> list[str]:
    """Delete every component of the endpoint (their copy scaling first) and wait until they are
    gone: SageMaker refuses to delete an endpoint that still holds components."""
    names = list_components(aws, endpoint)
    done = []
    for name in names:
        done += remove_copy_scaling(aws, endpoint, name)
        desc = describe_component(aws, name)
        if desc is not None and desc.get("InferenceComponentStatus") != "Deleting":
            aws.sagemaker.delete_inference_component(InferenceComponentName=name)
        done.append(f"removed component {name}")
    t0 = time.monotonic()
    left = list(names)
    while left:
        left = [n for n in left if describe_component(aws, n) is not None]
        if not left:
            break
        if time.monotonic() - t0 > timeout_s:
            raise AWSError(f"components {', '.join(left)} of endpoint {endpoint} are still being deleted after "
                           f"{int(timeout_s)} s; run `fish-sm delete {endpoint}` again later")
        time.sleep(poll_s)
    return done


"""`fish-sm status`: what a user wants to see about an endpoint, as plain data."""

from __future__ import annotations

from fish_sm.aws.alarms import list_alarms
from fish_sm.aws.autoscaling import scalable_target, scaling_policies
from fish_sm.aws.components import component_status, is_component_endpoint, list_components
from fish_sm.aws.endpoints import endpoint_config, require_endpoint
from fish_sm.aws.naming import alarm_prefix
from fish_sm.aws.session import AWS


def status(aws: AWS, name: str) -> dict:
    """What a user wants to see about an endpoint, as plain JSON-able data. An endpoint of
    inference components has no model of its own: its instance pool and components instead."""
    ep = require_endpoint(aws, name)
    cfg = endpoint_config(aws, ep)
    variant = (cfg.get("ProductionVariants") or [{}])[0]
    live = next((v for v in ep.get("ProductionVariants", []) if v.get("VariantName") == variant.get("VariantName")), {})
    out = {
        "name": name, "status": ep["EndpointStatus"], "failure_reason": ep.get("FailureReason"),
        "endpoint_config": ep.get("EndpointConfigName"), "model": variant.get("ModelName"),
        "instance_type": variant.get("InstanceType"),
        "instances": {"current": live.get("CurrentInstanceCount"), "desired": live.get("DesiredInstanceCount")},
        "created": str(ep.get("CreationTime")), "modified": str(ep.get("LastModifiedTime")),
        "async": None, "autoscaling": None, "instance_pool": None, "components": None, "alarms": [],
    }
    if cfg.get("AsyncInferenceConfig"):
        oc = cfg["AsyncInferenceConfig"].get("OutputConfig", {})
        out["async"] = {"output": oc.get("S3OutputPath"), "failure": oc.get("S3FailurePath"),
                        "max_concurrent": cfg["AsyncInferenceConfig"].get("ClientConfig", {})
                        .get("MaxConcurrentInvocationsPerInstance")}
    target = scalable_target(aws, name)
    if target is not None:
        policies = []
        for p in scaling_policies(aws, name):
            tt = p.get("TargetTrackingScalingPolicyConfiguration")
            metric = None
            if tt:
                metric = (tt.get("PredefinedMetricSpecification", {}).get("PredefinedMetricType")
                          or tt.get("CustomizedMetricSpecification", {}).get("MetricName"))
            policies.append({"name": p["PolicyName"], "type": p["PolicyType"], "metric": metric,
                             "target": tt.get("TargetValue") if tt else None})
        out["autoscaling"] = {"min": target["MinCapacity"], "max": target["MaxCapacity"], "policies": policies}
    if is_component_endpoint(cfg):
        scaling = variant.get("ManagedInstanceScaling") or {}
        out["instance_pool"] = {"min": scaling.get("MinInstanceCount"), "max": scaling.get("MaxInstanceCount")}
        out["components"] = [component_status(aws, name, c) for c in list_components(aws, name)]
    out["alarms"] = [{"name": a["AlarmName"], "state": a.get("StateValue"), "metric": a.get("MetricName")}
                     for a in list_alarms(aws, alarm_prefix(name))]
    return out

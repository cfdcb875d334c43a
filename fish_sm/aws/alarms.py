"""The CloudWatch alarms fish-sm makes, all named under fish-sm/NAME/: the rollback alarm's
request, and finding and deleting them by that prefix."""

from __future__ import annotations

from fish_sm.aws.naming import VARIANT, rollback_alarm_name
from fish_sm.aws.session import AWS


def rollback_alarm_request(name: str, threshold: int) -> dict:
    """A 5XX alarm on the endpoint: the blue/green update rolls back when it fires during baking."""
    return dict(
        AlarmName=rollback_alarm_name(name),
        AlarmDescription=f"fish-sm: 5XX errors from endpoint {name}; rolls back blue/green updates",
        Namespace="AWS/SageMaker", MetricName="Invocation5XXErrors",
        Dimensions=[{"Name": "EndpointName", "Value": name}, {"Name": "VariantName", "Value": VARIANT}],
        Statistic="Sum", Period=60, EvaluationPeriods=1, Threshold=float(threshold),
        ComparisonOperator="GreaterThanOrEqualToThreshold", TreatMissingData="notBreaching",
    )


def list_alarms(aws: AWS, prefix: str) -> list[dict]:
    pages = aws.cloudwatch.get_paginator("describe_alarms").paginate(AlarmNamePrefix=prefix, AlarmTypes=["MetricAlarm"])
    return [a for page in pages for a in page.get("MetricAlarms", [])]


def delete_alarms(aws: AWS, names: list[str]) -> list[str]:
    if not names:
        return []
    aws.cloudwatch.delete_alarms(AlarmNames=names)
    return [f"removed alarm {n}" for n in names]

"""The CloudWatch alarms fish-sm makes, all named under fish-sm/NAME/: the rollback alarm's
request, the health alarms' (first audio, 5XX rate, rejection rate, adapter errors), and finding
and deleting them by that prefix."""

from __future__ import annotations

from dataclasses import dataclass

from fish_sm.aws.naming import VARIANT, alarm_prefix, rollback_alarm_name
from fish_sm.aws.session import AWS
from fish_sm.cloudwatch_metrics import ENDPOINT_DIMENSION, NAMESPACE, SERVER_DIMENSION
from fish_sm.errors import InputError


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


@dataclass(frozen=True)
class AlarmThresholds:
    """The health alarms deploy makes (None: that one is not made)."""

    first_audio_p99_ms: float | None = 500.0  # the capacity SLO's first audio
    error_rate_percent: float | None = 1.0  # 5XX answers per invocation
    rejection_rate_percent: float | None = 1.0  # requests turned away by a full server
    adapter_errors: float | None = 1.0  # requests failed in 5 minutes because their adapter could not be read

    def check(self) -> None:
        for flag, value in (("--alarm-first-audio-ms", self.first_audio_p99_ms),
                            ("--alarm-5xx-rate", self.error_rate_percent),
                            ("--alarm-rejection-rate", self.rejection_rate_percent),
                            ("--alarm-adapter-errors", self.adapter_errors)):
            if value is not None and not value > 0:
                raise InputError(f"{flag} must be positive, got {value:g}")
        for flag, value in (("--alarm-5xx-rate", self.error_rate_percent),
                            ("--alarm-rejection-rate", self.rejection_rate_percent)):
            if value is not None and value > 100:
                raise InputError(f"{flag} is a percentage, at most 100, got {value:g}")


# Five minutes of one-minute periods, three of them bad: a burst does not page anyone, a trend does.
_WINDOW = dict(EvaluationPeriods=5, DatapointsToAlarm=3, ComparisonOperator="GreaterThanThreshold",
               TreatMissingData="notBreaching")


def _ours(name: str, server: str) -> list[dict]:
    return [{"Name": ENDPOINT_DIMENSION, "Value": name}, {"Name": SERVER_DIMENSION, "Value": server}]


def _rate(numerator: dict, denominator: dict) -> list[dict]:
    """Metric math: 100 x numerator / denominator a minute, 0 when nothing was asked."""
    def query(qid: str, metric: dict) -> dict:
        return {"Id": qid, "MetricStat": {"Metric": metric, "Period": 60, "Stat": "Sum"}, "ReturnData": False}

    return [query("bad", numerator), query("all", denominator),
            {"Id": "rate", "Expression": "IF(all > 0, 100 * bad / all, 0)", "Label": "percent", "ReturnData": True}]


def health_alarm_requests(name: str, server: str, thresholds: AlarmThresholds, *, is_async: bool = False,
                          adapters: bool = False) -> list[dict]:
    """The alarms on endpoint `name`'s health: p99 first audio (fish-sm's metric, streamed requests),
    the 5XX rate (SageMaker's) and the rejection rate (fish-sm's), each at its threshold. Only the
    batching server streams and turns requests away, and only in real time (an async endpoint's
    queue is SageMaker's): elsewhere those two would watch metrics that never come. With
    `adapters` (the endpoint serves LoRA adapters), requests failed by an adapter that could not be
    read or served (fish-sm's AdapterErrors: a bad upload, a missing permission): one is worth a look,
    since every request for that adapter fails the same way until it is fixed."""
    out = []
    batching = server == "batching"
    if thresholds.first_audio_p99_ms is not None and batching and not is_async:
        out.append(dict(AlarmName=f"{alarm_prefix(name)}first-audio-p99",
                        AlarmDescription=f"fish-sm: p99 first audio of endpoint {name} over "
                                         f"{thresholds.first_audio_p99_ms:g} ms",
                        Namespace=NAMESPACE, MetricName="FirstAudio", Dimensions=_ours(name, server),
                        ExtendedStatistic="p99", Period=60, Unit="Milliseconds",
                        Threshold=float(thresholds.first_audio_p99_ms), **_WINDOW))
    if thresholds.error_rate_percent is not None:
        sm = [{"Name": "EndpointName", "Value": name}, {"Name": "VariantName", "Value": VARIANT}]
        out.append(dict(AlarmName=f"{alarm_prefix(name)}5xx-rate",
                        AlarmDescription=f"fish-sm: 5XX answers from endpoint {name} over "
                                         f"{thresholds.error_rate_percent:g}% of invocations",
                        Metrics=_rate({"Namespace": "AWS/SageMaker", "MetricName": "Invocation5XXErrors",
                                       "Dimensions": sm},
                                      {"Namespace": "AWS/SageMaker", "MetricName": "Invocations", "Dimensions": sm}),
                        Threshold=float(thresholds.error_rate_percent), **_WINDOW))
    if thresholds.rejection_rate_percent is not None and batching:
        out.append(dict(AlarmName=f"{alarm_prefix(name)}rejection-rate",
                        AlarmDescription=f"fish-sm: requests turned away by a full server at endpoint {name} over "
                                         f"{thresholds.rejection_rate_percent:g}%: scale out sooner (--target) or "
                                         "raise --max",
                        Metrics=_rate({"Namespace": NAMESPACE, "MetricName": "Rejected", "Dimensions": _ours(name, server)},
                                      {"Namespace": NAMESPACE, "MetricName": "Requests",
                                       "Dimensions": _ours(name, server)}),
                        Threshold=float(thresholds.rejection_rate_percent), **_WINDOW))
    if thresholds.adapter_errors is not None and adapters:
        out.append(dict(AlarmName=f"{alarm_prefix(name)}adapter-errors",
                        AlarmDescription=f"fish-sm: requests to endpoint {name} failed because their LoRA adapter "
                                         f"could not be read or served, {thresholds.adapter_errors:g} or more in 5 "
                                         "minutes: see the server log and `fish-sm adapters list`",
                        Namespace=NAMESPACE, MetricName="AdapterErrors", Dimensions=_ours(name, server),
                        Statistic="Sum", Period=300, EvaluationPeriods=1,
                        Threshold=float(thresholds.adapter_errors), ComparisonOperator="GreaterThanOrEqualToThreshold",
                        TreatMissingData="notBreaching"))
    return out

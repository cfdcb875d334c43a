"""What deploy sets up to watch an endpoint: its CloudWatch dashboard and health alarms; on an
endpoint of inference components, per component where SageMaker's metric has an
InferenceComponentName dimension (invocations, 5XX), else per endpoint (fish-sm's own)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fish_sm.aws.alarms import _WINDOW, AlarmThresholds, _rate, delete_alarms, health_alarm_requests, list_alarms
from fish_sm.aws.dashboard import delete_dashboard, put_dashboard
from fish_sm.aws.naming import alarm_prefix
from fish_sm.aws.session import AWS


@dataclass(frozen=True)
class Monitoring:
    dashboard: bool = True
    alarms: AlarmThresholds | None = field(default_factory=AlarmThresholds)  # None: --no-alarms


HEALTH_ALARMS = ("first-audio-p99", "5xx-rate", "rejection-rate", "adapter-errors")


def apply_monitoring(aws: AWS, name: str, server: str, monitoring: Monitoring, *, is_async: bool = False,
                     adapters: bool = False, tags: list[dict] | None = None) -> list[str]:
    """Make the endpoint's dashboard and health alarms what `monitoring` asks (removing ours it no
    longer asks for); returns what was done. `server` (batching | mms) is the metrics' dimension;
    `adapters`: the endpoint serves LoRA adapters (their graphs and alarm)."""
    done = []
    if monitoring.dashboard:
        done.append(put_dashboard(aws, name, server, adapters=adapters))
    else:
        done += delete_dashboard(aws, name)
    wanted = (health_alarm_requests(name, server, monitoring.alarms, is_async=is_async, adapters=adapters)
              if monitoring.alarms else [])
    for request in wanted:
        aws.cloudwatch.put_metric_alarm(**request, **({"Tags": tags} if tags else {}))
        done.append(f"alarm {request['AlarmName']}: {request['AlarmDescription'].removeprefix('fish-sm: ')}")
    ours = {alarm_prefix(name) + suffix for suffix in HEALTH_ALARMS}
    stale = [a["AlarmName"] for a in list_alarms(aws, alarm_prefix(name))
             if a["AlarmName"] in ours - {r["AlarmName"] for r in wanted}]
    return done + delete_alarms(aws, stale)


def component_error_alarm_name(endpoint: str, component: str) -> str:
    """Under the endpoint's alarm prefix, so `delete NAME` removes it with the others."""
    return f"{alarm_prefix(endpoint)}{component}/5xx-rate"


def component_error_alarm_request(endpoint: str, component: str, percent: float) -> dict:
    """The 5XX rate of one component: SageMaker's invocation metrics of components carry its name."""
    dims = [{"Name": "InferenceComponentName", "Value": component}]
    return dict(AlarmName=component_error_alarm_name(endpoint, component),
                AlarmDescription=f"fish-sm: 5XX answers from component {component} of endpoint {endpoint} over "
                                 f"{percent:g}% of invocations",
                Metrics=_rate({"Namespace": "AWS/SageMaker", "MetricName": "Invocation5XXErrors", "Dimensions": dims},
                              {"Namespace": "AWS/SageMaker", "MetricName": "Invocations", "Dimensions": dims}),
                Threshold=float(percent), **_WINDOW)


def apply_component_monitoring(aws: AWS, endpoint: str, component: str, server: str, components: list[str],
                               monitoring: Monitoring, *, adapters: bool = False,
                               tags: list[dict] | None = None) -> list[str]:
    """The dashboard of the endpoint's `components` and the health alarms of `component` (its 5XX
    rate) and of the endpoint (fish-sm's first audio and rejection rate, when `server` is the
    batching server, the one that reports them). An mms component leaves the endpoint's alarms to
    the batching components beside it; --no-alarms removes the component's and the endpoint's."""
    done = ([put_dashboard(aws, endpoint, server, components, adapters=adapters)] if monitoring.dashboard
            else delete_dashboard(aws, endpoint))
    wanted = []
    if monitoring.alarms is not None:
        fish_only = dataclasses.replace(monitoring.alarms, error_rate_percent=None)  # 5XX: per component
        wanted = health_alarm_requests(endpoint, server, fish_only, adapters=adapters)
        if monitoring.alarms.error_rate_percent is not None:
            wanted.append(component_error_alarm_request(endpoint, component, monitoring.alarms.error_rate_percent))
    for request in wanted:
        aws.cloudwatch.put_metric_alarm(**request, **({"Tags": tags} if tags else {}))
        done.append(f"alarm {request['AlarmName']}: {request['AlarmDescription'].removeprefix('fish-sm: ')}")
    if monitoring.alarms is None:
        ours = {alarm_prefix(endpoint) + s for s in HEALTH_ALARMS} | {component_error_alarm_name(endpoint, component)}
        done += delete_alarms(aws, [a["AlarmName"] for a in list_alarms(aws, alarm_prefix(endpoint))
                                    if a["AlarmName"] in ours])
    return done

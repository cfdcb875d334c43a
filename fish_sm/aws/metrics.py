"""An endpoint's recent metrics from CloudWatch (GetMetricData): fish-sm's own, which its servers
write as EMF lines (fish_sm.cloudwatch_metrics), and SageMaker's, each over the last minutes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from fish_sm.aws import AWSError
from fish_sm.aws.endpoints import require_endpoint
from fish_sm.aws.naming import VARIANT
from fish_sm.aws.session import AWS
from fish_sm.cloudwatch_metrics import ENDPOINT_DIMENSION, NAMESPACE, SERVER_DIMENSION

# (label, namespace, metric, statistic, unit shown): what `fish-sm metrics` prints, in order.
FIGURES = [
    ("requests", NAMESPACE, "Requests", "Sum", ""),
    ("rejected (server full)", NAMESPACE, "Rejected", "Sum", ""),
    ("5xx errors", NAMESPACE, "Errors", "Sum", ""),
    ("first audio p50", NAMESPACE, "FirstAudio", "p50", "ms"),
    ("first audio p99", NAMESPACE, "FirstAudio", "p99", "ms"),
    ("real-time factor p50", NAMESPACE, "RealTimeFactor", "p50", ""),
    ("queue wait p99", NAMESPACE, "QueueWait", "p99", "ms"),
    ("audio produced", NAMESPACE, "AudioSeconds", "Sum", "s"),
    ("batch occupancy mean", NAMESPACE, "BatchOccupancy", "Average", "%"),
    ("batch occupancy max", NAMESPACE, "BatchOccupancy", "Maximum", "%"),
    ("queue depth max", NAMESPACE, "QueueDepth", "Maximum", ""),
    ("invocations", "AWS/SageMaker", "Invocations", "Sum", ""),
    ("5XX (SageMaker)", "AWS/SageMaker", "Invocation5XXErrors", "Sum", ""),
    ("model latency p99", "AWS/SageMaker", "ModelLatency", "p99", "us"),
]


@dataclass
class Figure:
    label: str
    namespace: str
    metric: str
    statistic: str
    unit: str
    value: float | None  # None: no data in the window
    server: str | None = None  # fish-sm's metrics: the server that wrote them


def _servers(aws: AWS, name: str) -> list[str]:
    """The Server dimension values fish-sm's metrics of endpoint `name` carry (batching, mms)."""
    pages = aws.cloudwatch.get_paginator("list_metrics").paginate(
        Namespace=NAMESPACE, Dimensions=[{"Name": ENDPOINT_DIMENSION, "Value": name}])
    return sorted({d["Value"] for page in pages for m in page.get("Metrics", []) for d in m.get("Dimensions", [])
                   if d["Name"] == SERVER_DIMENSION})


def recent_metrics(aws: AWS, name: str, minutes: int, now: datetime | None = None) -> list[Figure]:
    """Each figure over the last `minutes` (one value each). AWSError (one line) when the endpoint
    does not exist or none of its metrics has data in the window."""
    if not 1 <= minutes <= 24 * 60:
        raise AWSError(f"--minutes must be 1-1440, got {minutes}")
    require_endpoint(aws, name)
    end = (now or datetime.now(timezone.utc)).replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    wanted: list[Figure] = []
    for server in _servers(aws, name) or [None]:
        wanted += [Figure(label, ns, metric, stat, unit, None, server) for label, ns, metric, stat, unit in FIGURES
                   if ns == NAMESPACE and server is not None]
    wanted += [Figure(label, ns, metric, stat, unit, None) for label, ns, metric, stat, unit in FIGURES
               if ns != NAMESPACE]
    queries = []
    for i, fig in enumerate(wanted):
        dims = ([{"Name": ENDPOINT_DIMENSION, "Value": name}, {"Name": SERVER_DIMENSION, "Value": fig.server}]
                if fig.namespace == NAMESPACE else
                [{"Name": "EndpointName", "Value": name}, {"Name": "VariantName", "Value": VARIANT}])
        queries.append({"Id": f"m{i}", "ReturnData": True, "MetricStat": {
            "Metric": {"Namespace": fig.namespace, "MetricName": fig.metric, "Dimensions": dims},
            "Period": minutes * 60, "Stat": fig.statistic}})
    values: dict[str, list[float]] = {}
    for chunk in range(0, len(queries), 500):  # GetMetricData takes at most 500 queries a call
        token = None
        while True:
            kwargs = dict(MetricDataQueries=queries[chunk:chunk + 500], StartTime=start, EndTime=end)
            if token:
                kwargs["NextToken"] = token
            page = aws.cloudwatch.get_metric_data(**kwargs)
            for result in page.get("MetricDataResults", []):
                values.setdefault(result["Id"], []).extend(result.get("Values", []))
            token = page.get("NextToken")
            if not token:
                break
    for i, fig in enumerate(wanted):
        got = values.get(f"m{i}") or []
        if got:
            fig.value = sum(got) if fig.statistic == "Sum" else got[0]
    if all(f.value is None for f in wanted):
        raise AWSError(f"endpoint {name} has no metrics in the last {minutes} minute(s) in {aws.region_name}")
    return wanted

"""An endpoint's CloudWatch dashboard: fish-sm's own metrics (first audio, real-time factor,
queue wait, rejections and errors, batch occupancy and queue depth, from the servers' EMF
lines) beside SageMaker's (invocations, model latency, 5XX), one row of graphs each. On an
endpoint of inference components SageMaker's are per component (their InferenceComponentName
dimension), one line per component; fish-sm's stay per endpoint and server. An endpoint that
serves LoRA adapters gets a row per adapter (its requests, first audio, errors): a search over
the "Adapter" dimension, so an adapter added later appears without a redeploy."""

from __future__ import annotations

import json

from fish_sm.aws.naming import VARIANT
from fish_sm.aws.session import AWS, error_code
from fish_sm.cloudwatch_metrics import ADAPTER_DIMENSION, ENDPOINT_DIMENSION, NAMESPACE, SERVER_DIMENSION


def dashboard_name(name: str) -> str:
    return f"fish-sm-{name}"


def _graph(title: str, metrics: list[list], region: str, *, x: int, y: int, unit: str = "") -> dict:
    return {"type": "metric", "x": x, "y": y, "width": 12, "height": 6,
            "properties": {"title": title, "region": region, "view": "timeSeries", "stacked": False, "period": 60,
                           "metrics": metrics, **({"yAxis": {"left": {"label": unit, "min": 0}}} if unit else {})}}


def adapter_graphs(name: str) -> list[tuple[str, list, str]]:
    """Per-adapter graphs of endpoint `name`: one line per adapter that served a request in the
    dashboard's time range, whichever server (CloudWatch's SEARCH over the adapter dimension)."""
    schema = f"{{{NAMESPACE},{ADAPTER_DIMENSION},{ENDPOINT_DIMENSION},{SERVER_DIMENSION}}}"

    def per_adapter(metric: str, stat: str, qid: str) -> list:
        query = f"SEARCH('{schema} {ENDPOINT_DIMENSION}=\"{name}\" MetricName=\"{metric}\"', '{stat}', 60)"
        return [{"expression": query, "id": qid, "label": ""}]

    return [
        ("Requests by adapter", [per_adapter("Requests", "Sum", "requests")], "per minute"),
        ("First audio p99 by adapter (streamed requests)", [per_adapter("FirstAudio", "p99", "firstaudio")], "ms"),
        ("Adapter errors (could not be read or served) by adapter", [per_adapter("AdapterErrors", "Sum", "adaptererrors")],
         "per minute"),
        ("5xx errors by adapter", [per_adapter("Errors", "Sum", "errors")], "per minute"),
    ]


def _widgets(graphs: list[tuple[str, list, str]], region: str) -> dict:
    return {"widgets": [_graph(title, metrics, region, x=12 * (i % 2), y=6 * (i // 2), unit=unit)
                        for i, (title, metrics, unit) in enumerate(graphs)]}


def dashboard_body(name: str, server: str, region: str, adapters: bool = False) -> dict:
    ours = [ENDPOINT_DIMENSION, name, SERVER_DIMENSION, server]
    sm = ["EndpointName", name, "VariantName", VARIANT]

    def fish(metric: str, stat: str, label: str) -> list:
        return [NAMESPACE, metric, *ours, {"stat": stat, "label": label}]

    def sagemaker(metric: str, stat: str, label: str) -> list:
        return ["AWS/SageMaker", metric, *sm, {"stat": stat, "label": label}]

    graphs = [
        ("First audio (streamed requests)", [fish("FirstAudio", "p50", "p50"), fish("FirstAudio", "p99", "p99")], "ms"),
        ("Requests, rejected (server full), 5xx errors",
         [fish("Requests", "Sum", "requests"), fish("Rejected", "Sum", "rejected"), fish("Errors", "Sum", "errors")],
         "per minute"),
        ("Batch occupancy and queue", [fish("BatchOccupancy", "Average", "occupancy % (mean)"),
                                       fish("BatchOccupancy", "Maximum", "occupancy % (max)"),
                                       fish("QueueDepth", "Maximum", "queue depth (max)")], ""),
        ("Real-time factor and queue wait", [fish("RealTimeFactor", "p50", "RTF p50"),
                                             fish("RealTimeFactor", "p99", "RTF p99"),
                                             fish("QueueWait", "p99", "queue wait p99 (ms)")], ""),
        ("SageMaker: invocations and 5XX", [sagemaker("Invocations", "Sum", "invocations"),
                                            sagemaker("Invocation5XXErrors", "Sum", "5XX"),
                                            sagemaker("Invocation4XXErrors", "Sum", "4XX")], "per minute"),
        ("SageMaker: model latency", [sagemaker("ModelLatency", "p50", "p50"),
                                      sagemaker("ModelLatency", "p99", "p99")], "microseconds"),
    ]
    return _widgets(graphs + (adapter_graphs(name) if adapters else []), region)


def component_dashboard_body(name: str, components: list[str], region: str, adapters: bool = False) -> dict:
    """The dashboard of an endpoint of components: fish-sm's graphs for both servers (components
    may run either; a server's lines stay empty where none does), SageMaker's per component."""
    def fish(metric: str, stat: str, label: str) -> list:
        return [[NAMESPACE, metric, ENDPOINT_DIMENSION, name, SERVER_DIMENSION, server,
                 {"stat": stat, "label": f"{label} ({server})"}] for server in ("batching", "mms")]

    def per_component(metric: str, stat: str) -> list:
        return [["AWS/SageMaker", metric, "InferenceComponentName", c, {"stat": stat, "label": c}] for c in components]

    graphs = [
        ("First audio p99 (streamed requests)", fish("FirstAudio", "p99", "p99"), "ms"),
        ("Requests, rejected (server full), 5xx errors",
         fish("Requests", "Sum", "requests") + fish("Rejected", "Sum", "rejected") + fish("Errors", "Sum", "errors"),
         "per minute"),
        ("Batch occupancy and queue", fish("BatchOccupancy", "Average", "occupancy % (mean)")
         + fish("QueueDepth", "Maximum", "queue depth (max)"), ""),
        ("Real-time factor p99 and latency p99", fish("RealTimeFactor", "p99", "RTF p99")
         + fish("Latency", "p99", "latency p99 (ms)"), ""),
        ("SageMaker: invocations by component", per_component("Invocations", "Sum"), "per minute"),
        ("SageMaker: 5XX by component", per_component("Invocation5XXErrors", "Sum"), "per minute"),
        ("SageMaker: model latency p99 by component", per_component("ModelLatency", "p99"), "microseconds"),
        ("SageMaker: calls that found no copy", per_component("NoCapacityInvocationFailures", "Sum"), "per minute"),
    ]
    return _widgets(graphs + (adapter_graphs(name) if adapters else []), region)


def put_dashboard(aws: AWS, name: str, server: str, components: list[str] | None = None, adapters: bool = False) -> str:
    """The endpoint's dashboard; with `components`, an endpoint of inference components (`server`
    unused); `adapters`: it serves LoRA adapters (a row of graphs per adapter)."""
    body = dashboard_body(name, server, aws.region_name, adapters) if components is None else \
        component_dashboard_body(name, components, aws.region_name, adapters)
    aws.cloudwatch.put_dashboard(DashboardName=dashboard_name(name), DashboardBody=json.dumps(body))
    what = f"components {', '.join(components)} of " if components else ""
    return f"dashboard {dashboard_name(name)}: fish-sm's and SageMaker's metrics of {what}{name}"


def delete_dashboard(aws: AWS, name: str) -> list[str]:
    """Remove the endpoint's dashboard; [] when it has none."""
    try:
        aws.cloudwatch.get_dashboard(DashboardName=dashboard_name(name))
    except Exception as exc:
        if error_code(exc) in ("ResourceNotFound", "ResourceNotFoundException", "ResourceNotFoundError"):
            return []
        raise
    aws.cloudwatch.delete_dashboards(DashboardNames=[dashboard_name(name)])
    return [f"removed dashboard {dashboard_name(name)}"]

"""deploy's dashboard and health alarms, and `fish-sm metrics`, against moto's standalone server:
what deploy makes (and a redeploy with --no-dashboard --no-alarms removes), what delete removes,
and the recent values of metrics put with PutMetricData (moto does not read EMF logs)."""

import json
from datetime import datetime, timedelta, timezone

import boto3
import pytest
from click.testing import CliRunner

from fish_sm.aws.monitoring import Monitoring, apply_monitoring
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from moto_helpers import moto_server
from package_bytes import package_tarball

pytestmark = pytest.mark.integration

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-monitoring"


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key="model.tar.gz", Body=package_tarball(tmp_path_factory.mktemp("pkg"))[0])
        yield url


def client(url, service):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1")


def cli(url, *args, code=0):
    result = CliRunner().invoke(main, [*map(str, args), "--endpoint-url", url])
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    return result.output


def deploy(url, name, *extra):
    return cli(url, "deploy", name, "--model-data", f"s3://{BUCKET}/model.tar.gz", "--role", ROLE,
               "--image", "123.dkr/fish-sm:1", "--instance-type", "ml.g4dn.xlarge", "--poll", 0.01, *extra)


def test_deploy_makes_dashboard_and_alarms_and_delete_removes_them(moto_url):
    cw = client(moto_url, "cloudwatch")
    printed = deploy(moto_url, "watched", "--alarm-first-audio-ms", 800, "--alarm-5xx-rate", 2)
    assert "dashboard fish-sm-watched" in printed and "alarm fish-sm/watched/first-audio-p99" in printed
    body = json.loads(cw.get_dashboard(DashboardName="fish-sm-watched")["DashboardBody"])
    series = [m for w in body["widgets"] for m in w["properties"]["metrics"]]
    assert ["fish-sm", "FirstAudio", "EndpointName", "watched", "Server", "batching", {"stat": "p99", "label": "p99"}] \
        in series
    assert {m[1] for m in series if m[0] == "AWS/SageMaker"} >= {"Invocations", "ModelLatency", "Invocation5XXErrors"}
    assert all(w["properties"]["region"] == "us-east-1" for w in body["widgets"])
    alarms = {a["AlarmName"]: a for a in cw.describe_alarms(AlarmNamePrefix="fish-sm/watched/")["MetricAlarms"]}
    first = alarms["fish-sm/watched/first-audio-p99"]
    assert (first["Namespace"], first["MetricName"], first["ExtendedStatistic"], first["Threshold"]) == \
        ("fish-sm", "FirstAudio", "p99", 800.0)
    assert {d["Name"]: d["Value"] for d in first["Dimensions"]} == {"EndpointName": "watched", "Server": "batching"}
    rate = alarms["fish-sm/watched/5xx-rate"]
    assert rate["Threshold"] == 2.0 and [q["Id"] for q in rate["Metrics"]] == ["bad", "all", "rate"]
    assert rate["Metrics"][0]["MetricStat"]["Metric"]["MetricName"] == "Invocation5XXErrors"
    assert alarms["fish-sm/watched/rejection-rate"]["Threshold"] == 1.0
    # What a redeploy with --no-dashboard --no-alarms asks (moto cannot update an endpoint): ours go,
    # the rollback alarm stays.
    aws = AWS(region="us-east-1", endpoint_url=moto_url)
    done = apply_monitoring(aws, "watched", "batching", Monitoring(dashboard=False, alarms=None))
    assert "removed dashboard fish-sm-watched" in done and "removed alarm fish-sm/watched/5xx-rate" in done
    assert [a["AlarmName"] for a in cw.describe_alarms(AlarmNamePrefix="fish-sm/watched/")["MetricAlarms"]] == \
        ["fish-sm/watched/invocation-5xx"]
    apply_monitoring(aws, "watched", "batching", Monitoring())
    printed = cli(moto_url, "delete", "watched")
    assert "removed dashboard fish-sm-watched" in printed and "removed alarm fish-sm/watched/rejection-rate" in printed
    assert cw.list_dashboards()["DashboardEntries"] == [] and cw.describe_alarms()["MetricAlarms"] == []
    out = CliRunner().invoke(main, ["deploy", "x", "--model-data", f"s3://{BUCKET}/model.tar.gz", "--role", ROLE,
                                    "--image", "i", "--alarm-5xx-rate", "150", "--endpoint-url", moto_url])
    assert out.exit_code == 1 and out.output.strip().splitlines()[-1] == \
        "Error: --alarm-5xx-rate is a percentage, at most 100, got 150"


def test_an_endpoint_with_adapters_gets_their_graphs_and_an_adapter_error_alarm(moto_url):
    """With an adapter source (or packaged adapters): a row of per-adapter graphs (a search over
    the Adapter dimension, so adapters added later show) and an alarm on AdapterErrors; a redeploy
    without adapters removes that alarm."""
    cw = client(moto_url, "cloudwatch")
    printed = deploy(moto_url, "tuned", "--adapter-source", "default", "--alarm-adapter-errors", 3)
    assert "alarm fish-sm/tuned/adapter-errors: requests to endpoint tuned failed because their LoRA adapter" in printed
    alarm, = cw.describe_alarms(AlarmNames=["fish-sm/tuned/adapter-errors"])["MetricAlarms"]
    assert (alarm["Namespace"], alarm["MetricName"], alarm["Statistic"], alarm["Period"], alarm["Threshold"],
            alarm["ComparisonOperator"]) == ("fish-sm", "AdapterErrors", "Sum", 300, 3.0,
                                             "GreaterThanOrEqualToThreshold")
    assert {d["Name"]: d["Value"] for d in alarm["Dimensions"]} == {"EndpointName": "tuned", "Server": "batching"}
    body = json.loads(cw.get_dashboard(DashboardName="fish-sm-tuned")["DashboardBody"])
    searches = {w["properties"]["title"]: m[0]["expression"] for w in body["widgets"]
                for m in w["properties"]["metrics"] if isinstance(m[0], dict)}
    assert searches["Adapter errors (could not be read or served) by adapter"] == (
        "SEARCH('{fish-sm,Adapter,EndpointName,Server} EndpointName=\"tuned\" MetricName=\"AdapterErrors\"', 'Sum', 60)")
    assert len(searches) == 4
    aws = AWS(region="us-east-1", endpoint_url=moto_url)
    done = apply_monitoring(aws, "tuned", "batching", Monitoring())  # what a redeploy without adapters asks
    assert "removed alarm fish-sm/tuned/adapter-errors" in done
    plain = json.loads(cw.get_dashboard(DashboardName="fish-sm-tuned")["DashboardBody"])
    assert not any(isinstance(m[0], dict) for w in plain["widgets"] for m in w["properties"]["metrics"])
    cli(moto_url, "delete", "tuned")


def test_metrics_prints_recent_values_and_fails_on_nothing(moto_url):
    deploy(moto_url, "speaking", "--no-dashboard", "--no-alarms")
    printed = cli(moto_url, "metrics", "speaking", code=1)
    assert printed.strip().splitlines()[-1] == \
        "Error: endpoint speaking has no metrics in the last 15 minute(s) in us-east-1"
    printed = cli(moto_url, "metrics", "nowhere", code=1)
    assert printed.strip().splitlines()[-1] == "Error: endpoint 'nowhere' does not exist in us-east-1"
    cw, now = client(moto_url, "cloudwatch"), datetime.now(timezone.utc)
    ours = [{"Name": "EndpointName", "Value": "speaking"}, {"Name": "Server", "Value": "batching"}]
    sm = [{"Name": "EndpointName", "Value": "speaking"}, {"Name": "VariantName", "Value": "AllTraffic"}]
    cw.put_metric_data(Namespace="fish-sm", MetricData=[
        *({"MetricName": "Requests", "Dimensions": ours, "Value": 1, "Unit": "Count", "Timestamp": now} for _ in range(4)),
        {"MetricName": "Rejected", "Dimensions": ours, "Value": 1, "Unit": "Count", "Timestamp": now},
        {"MetricName": "BatchOccupancy", "Dimensions": ours, "Value": 50, "Unit": "Percent", "Timestamp": now},
        {"MetricName": "BatchOccupancy", "Dimensions": ours, "Value": 100, "Unit": "Percent",
         "Timestamp": now - timedelta(minutes=2)},
        {"MetricName": "Requests", "Dimensions": ours, "Value": 1, "Unit": "Count",  # outside a 5-minute window
         "Timestamp": now - timedelta(minutes=30)}])
    cw.put_metric_data(Namespace="AWS/SageMaker", MetricData=[
        {"MetricName": "Invocations", "Dimensions": sm, "Value": 3, "Unit": "Count", "Timestamp": now}])
    doc = json.loads(cli(moto_url, "metrics", "speaking", "--minutes", 5, "--output", "json"))
    got = {(m["metric"], m["statistic"]): m["value"] for m in doc["metrics"]}
    assert got[("Requests", "Sum")] == 4 and got[("Rejected", "Sum")] == 1 and got[("Invocations", "Sum")] == 3
    assert got[("BatchOccupancy", "Average")] == 75 and got[("BatchOccupancy", "Maximum")] == 100
    assert got[("Errors", "Sum")] is None and {m["server"] for m in doc["metrics"] if m["namespace"] == "fish-sm"} == \
        {"batching"}
    printed = cli(moto_url, "metrics", "speaking", "--minutes", 5)
    lines = printed.splitlines()
    assert lines[0] == "endpoint speaking, last 5 minute(s):"
    row, = [ln for ln in lines if ln.startswith("requests ")]
    assert row.split()[1] == "4" and "fish-sm Requests Sum (batching)" in row
    assert any(ln.startswith("batch occupancy mean") and "75.00 %" in ln for ln in lines)
    cli(moto_url, "delete", "speaking")

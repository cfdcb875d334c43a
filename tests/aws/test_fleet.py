"""The fleet commands against moto's standalone server: list, logs (events put into moto's
CloudWatch Logs first), scale (with autoscaling limits), and the config file of option defaults
with its precedence: file < FISHSM_* environment < flag."""

import json
import time

import boto3
import pytest
from botocore.config import Config
from click.testing import CliRunner

from fish_sm.aws.delete import delete
from fish_sm.aws.logs import endpoint_logs
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from moto_helpers import moto_server
from package_bytes import package_tarball

pytestmark = pytest.mark.integration

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-fleet"
MODEL = f"s3://{BUCKET}/model.tar.gz"


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        s3 = client(url, "s3")
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key="model.tar.gz", Body=package_tarball(tmp_path_factory.mktemp("pkg"))[0])
        yield url


def client(url, service):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def cli(url, *args, ok=True, env=None):
    result = CliRunner().invoke(main, [*map(str, args), "--endpoint-url", url], env=env)
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception, SystemExit))
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1, result.output
        line, = result.output.strip().splitlines()
        assert line.startswith("Error: "), result.output
    return result.output


@pytest.fixture(scope="module")
def fleet(moto_url):
    """Two fish-sm endpoints (one autoscaled 1-3) and one endpoint fish-sm did not make."""
    common = ["--model-data", MODEL, "--role", ROLE, "--image", "img", "--poll", "0.01"]
    cli(moto_url, "deploy", "fleet-a", *common, "--instance-type", "ml.g4dn.xlarge", "--max", 3)
    cli(moto_url, "deploy", "fleet-b", *common, "--instance-type", "ml.m5.xlarge", "--instances", 2)
    sm = client(moto_url, "sagemaker")
    sm.create_model(ModelName="other-model", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "img"})
    sm.create_endpoint_config(EndpointConfigName="other-config", ProductionVariants=[
        {"VariantName": "AllTraffic", "ModelName": "other-model", "InitialInstanceCount": 1,
         "InstanceType": "ml.m5.large"}])
    sm.create_endpoint(EndpointName="other", EndpointConfigName="other-config")
    yield moto_url
    # moto keeps one state per process, which the next module's server shares: leave none behind.
    aws = AWS(region="us-east-1", endpoint_url=moto_url)
    for name in ("fleet-a", "fleet-b"):
        delete(aws, name)
    sm.delete_endpoint(EndpointName="other")
    sm.delete_endpoint_config(EndpointConfigName="other-config")
    sm.delete_model(ModelName="other-model")
    logs = client(moto_url, "logs")
    for group in logs.describe_log_groups(logGroupNamePrefix="/aws/sagemaker/Endpoints/")["logGroups"]:
        logs.delete_log_group(logGroupName=group["logGroupName"])


def test_list_shows_only_fish_sm_endpoints(fleet):
    """(moto's state is one per process: other modules' endpoints may be listed too.)"""
    lines = cli(fleet, "list").splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "INSTANCE", "TYPE", "INSTANCES"]
    assert len({line.index("STATUS") if i == 0 else line.index("InService") for i, line in enumerate(lines)}) == 1
    rows = [line.split() for line in lines[1:] if line.startswith(("fleet-", "other"))]
    assert rows == [["fleet-a", "InService", "ml.g4dn.xlarge", "1/1"], ["fleet-b", "InService", "ml.m5.xlarge", "2/2"]]
    listed = json.loads(cli(fleet, "list", "--output", "json"))
    assert listed["region"] == "us-east-1"
    assert [(e["name"], e["instance_type"], e["instances"]) for e in listed["endpoints"]
            if e["name"].startswith(("fleet-", "other"))] == [
        ("fleet-a", "ml.g4dn.xlarge", {"current": 1, "desired": 1}),
        ("fleet-b", "ml.m5.xlarge", {"current": 2, "desired": 2})]


def test_scale_moves_autoscaling_limits_that_exclude_the_count(fleet):
    aa, sm = client(fleet, "application-autoscaling"), client(fleet, "sagemaker")
    printed = cli(fleet, "scale", "fleet-a", "--instances", 5, "--poll", 0)
    assert "autoscaling of fleet-a was 1-3 instances, now 1-5 so that 5 holds" in printed
    assert printed.strip().splitlines()[-1] == "fleet-a: InService, 5 running, 5 desired"
    target, = aa.describe_scalable_targets(ServiceNamespace="sagemaker",
                                           ResourceIds=["endpoint/fleet-a/variant/AllTraffic"])["ScalableTargets"]
    assert (target["MinCapacity"], target["MaxCapacity"]) == (1, 5)
    assert sm.describe_endpoint(EndpointName="fleet-a")["ProductionVariants"][0]["DesiredInstanceCount"] == 5
    printed = cli(fleet, "scale", "fleet-a", "--instances", 2, "--poll", 0)
    assert "note: autoscaling (1-5 instances) stays on" in printed
    printed = cli(fleet, "scale", "fleet-b", "--instances", 3, "--no-wait")
    assert "autoscaling" not in printed and "asked for 3 instances of fleet-b" in printed
    assert sm.describe_endpoint(EndpointName="fleet-b")["ProductionVariants"][0]["DesiredInstanceCount"] == 3
    assert cli(fleet, "scale", "fleet-b", "--instances", 0, ok=False).strip() == \
        "Error: endpoint fleet-b is real-time: it needs at least 1 instance (only async endpoints scale to 0)"
    assert cli(fleet, "scale", "nope", "--instances", 1, ok=False).strip() == \
        "Error: endpoint 'nope' does not exist in us-east-1"


def put_events(url, name, stream, events):
    logs = client(url, "logs")
    group = f"/aws/sagemaker/Endpoints/{name}"
    try:
        logs.create_log_group(logGroupName=group)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    try:
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    logs.put_log_events(logGroupName=group, logStreamName=stream,
                        logEvents=[{"timestamp": t, "message": m} for t, m in events])


def test_logs_interleave_streams_by_time(fleet):
    now = int(time.time() * 1000)
    put_events(fleet, "fleet-a", "AllTraffic/i-one", [(now - 3_600_000, "an hour ago"), (now - 3000, "one: loading"),
                                                        (now - 1000, "one: ready")])
    put_events(fleet, "fleet-a", "AllTraffic/i-two", [(now - 2000, "two: loading")])
    printed = cli(fleet, "logs", "fleet-a", "--since", "10m")
    assert [line.split(" ", 1)[1] for line in printed.splitlines()] == [
        "AllTraffic/i-one one: loading", "AllTraffic/i-two two: loading", "AllTraffic/i-one one: ready"]
    assert printed.splitlines()[0].startswith(time.strftime("%Y-%m-%dT", time.gmtime((now - 3000) / 1000)))
    assert len(cli(fleet, "logs", "fleet-a", "--since", "2h").splitlines()) == 4
    assert cli(fleet, "logs", "fleet-a", "--since", "10m", "--tail", 1).strip().endswith("one: ready")
    assert cli(fleet, "logs", "fleet-b", ok=False).strip() == (
        "Error: no logs for endpoint fleet-b: log group /aws/sagemaker/Endpoints/fleet-b does not exist in us-east-1 "
        "(not deployed, or no instance has started yet)")
    assert cli(fleet, "logs", "fleet-a", "--since", "ten", ok=False).strip() == \
        "Error: --since must be a number and a unit (s, m, h, d), e.g. 10m; got 'ten'"


def test_follow_prints_new_events_once(fleet):
    now = int(time.time() * 1000)
    put_events(fleet, "follow", "AllTraffic/i-1", [(now - 500, "first")])
    polls = []

    def sleep(_):  # between polls: the instance writes more, then the user presses Ctrl-C
        polls.append(1)
        if len(polls) == 1:
            put_events(fleet, "follow", "AllTraffic/i-2", [(now + 10, "second")])
        else:
            raise KeyboardInterrupt

    seen = []
    with pytest.raises(KeyboardInterrupt):
        for e in endpoint_logs(AWS(region="us-east-1", endpoint_url=fleet), "follow", follow=True, sleep=sleep):
            seen.append(e["message"])
    assert seen == ["first", "second"]


def test_config_file_then_environment_then_flag(fleet, tmp_path):
    """[default] and [deploy] from the file; FISHSM_DEPLOY_INSTANCE_TYPE beats the file; the flag beats both."""
    config = tmp_path / "config.toml"
    config.write_text(f'[default]\nregion = "us-east-1"\n\n[deploy]\nrole = "{ROLE}"\ninstance-type = "ml.m5.xlarge"\n'
                      'poll = 0.01\nimage = "img"\n\n[list]\noutput = "json"\n')
    sm = client(fleet, "sagemaker")

    def instance_type(name):
        config_name = sm.describe_endpoint(EndpointName=name)["EndpointConfigName"]
        return sm.describe_endpoint_config(EndpointConfigName=config_name)["ProductionVariants"][0]["InstanceType"]

    env = {"FISHSM_CONFIG": str(config), "AWS_DEFAULT_REGION": "eu-west-1"}
    cli(fleet, "deploy", "from-file", "--model-data", MODEL, env=env)  # role, type, image, region from the file
    assert instance_type("from-file") == "ml.m5.xlarge"
    env["FISHSM_DEPLOY_INSTANCE_TYPE"] = "ml.c5.xlarge"
    cli(fleet, "deploy", "from-env", "--model-data", MODEL, env=env)
    assert instance_type("from-env") == "ml.c5.xlarge"
    cli(fleet, "deploy", "from-flag", "--model-data", MODEL, "--instance-type", "ml.m5.large", env=env)
    assert instance_type("from-flag") == "ml.m5.large"
    assert "from-file" in [e["name"] for e in json.loads(cli(fleet, "list", env=env))["endpoints"]]
    assert cli(fleet, "list", env={**env, "FISHSM_LIST_OUTPUT": "text"}).startswith("NAME")
    for name in ("from-file", "from-env", "from-flag"):
        assert f"removed endpoint {name}" in cli(fleet, "delete", name, "--wait", "--poll", 0, env=env)
    assert not [e for e in sm.list_endpoints()["Endpoints"] if e["EndpointName"].startswith("from-")]


@pytest.mark.parametrize("text, message", [
    ("[deploy\nrole = 1", "config file {path}: Expected ']' at the end of a table declaration (at line 1, column 8)"),
    ("[deploy]\nrole = \"x\"\nsize = 3\n", "config file {path}: [deploy] size: no such option of `fish-sm deploy`"),
    ("[deploi]\nrole = \"x\"\n", "config file {path}: [deploi] is no fish-sm command; sections are [default] and "
                                  "command names"),
    ("region = \"us-east-1\"\n", "config file {path}: 'region' must be a [section] of option = value"),
    ("[default]\ncolour = \"blue\"\n", "config file {path}: [default] colour: no such option"),
])
def test_a_bad_config_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "config.toml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["list"], env={"FISHSM_CONFIG": str(path)})
    assert result.exit_code == 1 and result.output.strip() == "Error: " + message.format(path=path), result.output


def test_a_named_config_file_must_exist(tmp_path):
    result = CliRunner().invoke(main, ["status", "x"], env={"FISHSM_CONFIG": str(tmp_path / "none.toml")})
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: config file {tmp_path / 'none.toml'} (from FISHSM_CONFIG) does not exist"

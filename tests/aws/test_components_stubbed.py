"""Inference components, which moto does not have, checked call by call against the real sagemaker,
application-autoscaling and cloudwatch service models with botocore's Stubber: create an endpoint
as an instance pool with a component that scales to zero (with its dashboard and health alarms),
add a second component, set copies, a rolling update with rollback (and one rolled back), status,
and delete in the right order (alarms and dashboard too)."""

import datetime
import hashlib
import io
import json

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber
from click.testing import CliRunner

from fish_sm.aws import AWSError
from fish_sm.aws import component_deploy as cd
from fish_sm.aws.components import ComponentOptions, COPY_DIMENSION
from fish_sm.aws.deploy_request import DeployRequest
from fish_sm.aws.s3 import parse_s3_uri
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from fish_sm.errors import InputError
from package_bytes import package_tarball

NAME = "tts"
SECOND = "tts-int8"
STAMP = "20250102030405678"
NEW = f"{NAME}-{STAMP}"
OLD = f"{NAME}-20240101000000000"
ROLE = "arn:aws:iam::123456789012:role/fish-sm"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/fish-sm:0.1"
GPU_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"
NOW = datetime.datetime(2025, 1, 2, tzinfo=datetime.timezone.utc)
ARN = "arn:aws:sagemaker:us-east-1:123456789012"
TAGS = [{"Key": "fish-sm:endpoint", "Value": NAME}]
NO_CAPACITY = ("Inference Component has no capacity to process this request. ApplicationAutoScaling may be "
               "in-progress (if configured) or try to increase the capacity by invoking "
               "UpdateInferenceComponentRuntimeConfig API.")


def policy_arn(component, policy):
    return (f"arn:aws:autoscaling:us-east-1:123456789012:scalingPolicy:11111111-2222-3333-4444-555555555555:"
            f"resource/sagemaker/inference-component/{component}:policyName/{policy}")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return package_tarball(tmp_path_factory.mktemp("package"))


@pytest.fixture
def stubbed(monkeypatch):
    """An AWS whose clients are real botocore clients (real service models) answered by Stubbers,
    which check every request's parameters against the model and the expected values."""
    monkeypatch.setattr(cd, "new_stamp", lambda: STAMP)
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    aws = AWS(region="us-east-1")
    aws._session = session
    stubs = {}
    for service in ("sagemaker", "s3", "application-autoscaling", "cloudwatch", "ec2", "ecr"):
        client = session.client(service)
        aws._clients[service] = client
        stubs[service] = Stubber(client)
        stubs[service].activate()
    yield aws, stubs
    for s in stubs.values():
        s.assert_no_pending_responses()
        s.deactivate()


def cli(monkeypatch, aws, *args):
    """The CLI with its AWS clients being the stubbed ones; returns (exit code, output)."""
    import fish_sm.cli.deploy
    import fish_sm.cli.fleet

    for module in (fish_sm.cli.deploy, fish_sm.cli.fleet):
        monkeypatch.setattr(module, "make_aws", lambda *a, **k: aws)
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False,
                                env={"FISHSM_CONFIG": None, "XDG_CONFIG_HOME": "/nonexistent/fish-sm-test"})
    return result.exit_code, result.output


def endpoint(status, config=NEW):
    return {"EndpointName": NAME, "EndpointArn": f"{ARN}:endpoint/{NAME}", "EndpointConfigName": config,
            "EndpointStatus": status, "CreationTime": NOW, "LastModifiedTime": NOW,
            "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": 1,
                                    "DesiredInstanceCount": 1}]}


def pool_config(lo=0, hi=2):
    return {"EndpointConfigName": NEW, "EndpointConfigArn": f"{ARN}:endpoint-config/{NEW}", "CreationTime": NOW,
            "ExecutionRoleArn": ROLE,
            "ProductionVariants": [{"VariantName": "AllTraffic", "InstanceType": "ml.g6e.2xlarge",
                                    "InitialInstanceCount": 1, "ManagedInstanceScaling": {
                                        "Status": "ENABLED", "MinInstanceCount": lo, "MaxInstanceCount": hi}}]}


def component(name, status, model, current=1, desired=1, memory=8192, reason=None):
    out = {"InferenceComponentName": name, "InferenceComponentArn": f"{ARN}:inference-component/{name}",
           "EndpointName": NAME, "EndpointArn": f"{ARN}:endpoint/{NAME}", "VariantName": "AllTraffic",
           "Specification": {"ModelName": model, "ComputeResourceRequirements": {
               "NumberOfAcceleratorDevicesRequired": 1.0, "MinMemoryRequiredInMb": memory}},
           "RuntimeConfig": {"CurrentCopyCount": current, "DesiredCopyCount": desired},
           "InferenceComponentStatus": status, "CreationTime": NOW, "LastModifiedTime": NOW}
    if reason:
        out["FailureReason"] = reason
    return out


def not_found(stub, operation, what):
    stub.add_client_error(operation, "ValidationException", f"Could not find {what}.", 400)


def expect_checks(stubs, package):
    """What deploy reads before it makes anything: the instance type, the ECR image, the package."""
    stubs["ec2"].add_response("describe_instance_types", {"InstanceTypes": [{"InstanceType": "g6e.2xlarge", "GpuInfo": {
        "Gpus": [{"Name": "L40S", "Manufacturer": "NVIDIA", "Count": 1, "MemoryInfo": {"SizeInMiB": 45776}}]}}]},
        {"InstanceTypes": ["g6e.2xlarge"]})
    stubs["ecr"].add_response("describe_images", {"imageDetails": [
        {"registryId": "123456789012", "repositoryName": "fish-sm", "imageDigest": "sha256:" + "c" * 64,
         "imageTags": ["0.1"]}]},
        {"registryId": "123456789012", "repositoryName": "fish-sm", "imageIds": [{"imageTag": "0.1"}]})
    tarball = package[0]
    stubs["s3"].add_response("head_object", {"ContentLength": len(tarball)},
                             {"Bucket": "models", "Key": "tts/model.tar.gz"})
    stubs["s3"].add_response("get_object", {"Body": StreamingBody(io.BytesIO(tarball), len(tarball)),
                                            "ContentLength": len(tarball),
                                            "ContentRange": f"bytes 0-{len(tarball) - 1}/{len(tarball)}"},
                             {"Bucket": "models", "Key": "tts/model.tar.gz", "Range": "bytes=0-65535"})


def expect_model(stubs, package, env=None):
    stubs["sagemaker"].add_response("create_model", {"ModelArn": f"{ARN}:model/{NEW}"}, {
        "ModelName": NEW, "ExecutionRoleArn": ROLE, "Tags": TAGS,
        "PrimaryContainer": {"Image": IMAGE, "ModelDataUrl": "s3://models/tts/model.tar.gz",
                             "Environment": {"SAGEMAKER_CONTAINER_LOG_LEVEL": "20",
                                             "FISH_SM_MANIFEST_SHA256": hashlib.sha256(package[1]).hexdigest(),
                                             **(env or {})}}})


def listed(*names):
    return {"InferenceComponents": [
        {"InferenceComponentName": n, "InferenceComponentArn": f"{ARN}:inference-component/{n}",
         "EndpointName": NAME, "EndpointArn": f"{ARN}:endpoint/{NAME}", "VariantName": "AllTraffic",
         "InferenceComponentStatus": "InService", "CreationTime": NOW, "LastModifiedTime": NOW} for n in names]}


def dashboards_put(aws):
    """The dashboards the client is asked to put, as parsed JSON (the Stubber checks the rest)."""
    bodies = []
    aws.cloudwatch.meta.events.register(
        "provide-client-params.cloudwatch.PutDashboard",
        lambda params, **_: bodies.append(json.loads(params["DashboardBody"])))
    return bodies


def expect_health_alarms(cw, component, fish=True):
    """The endpoint's alarms on fish-sm's metrics (batching only) and the component's 5XX rate."""
    ours = [{"Name": "EndpointName", "Value": NAME}, {"Name": "Server", "Value": "batching"}]
    window = {"EvaluationPeriods": 5, "DatapointsToAlarm": 3, "ComparisonOperator": "GreaterThanThreshold",
              "TreatMissingData": "notBreaching", "Tags": TAGS}

    def rate(namespace, bad, dims):
        return [{"Id": "bad", "MetricStat": {"Metric": {"Namespace": namespace, "MetricName": bad, "Dimensions": dims},
                                             "Period": 60, "Stat": "Sum"}, "ReturnData": False},
                {"Id": "all", "MetricStat": {"Metric": {"Namespace": namespace, "MetricName": (
                    "Requests" if namespace == "fish-sm" else "Invocations"), "Dimensions": dims},
                    "Period": 60, "Stat": "Sum"}, "ReturnData": False},
                {"Id": "rate", "Expression": "IF(all > 0, 100 * bad / all, 0)", "Label": "percent", "ReturnData": True}]
    if fish:
        cw.add_response("put_metric_alarm", {}, {
            "AlarmName": f"fish-sm/{NAME}/first-audio-p99", "AlarmDescription": ANY, "Namespace": "fish-sm",
            "MetricName": "FirstAudio", "Dimensions": ours, "ExtendedStatistic": "p99", "Period": 60,
            "Unit": "Milliseconds", "Threshold": 500.0, **window})
        cw.add_response("put_metric_alarm", {}, {
            "AlarmName": f"fish-sm/{NAME}/rejection-rate", "AlarmDescription": ANY,
            "Metrics": rate("fish-sm", "Rejected", ours), "Threshold": 1.0, **window})
    cw.add_response("put_metric_alarm", {}, {
        "AlarmName": f"fish-sm/{NAME}/{component}/5xx-rate", "AlarmDescription": ANY,
        "Metrics": rate("AWS/SageMaker", "Invocation5XXErrors",
                        [{"Name": "InferenceComponentName", "Value": component}]), "Threshold": 1.0, **window})


def spec(model, memory=8192):
    return {"ModelName": model, "ComputeResourceRequirements": {"MinMemoryRequiredInMb": memory,
                                                                "NumberOfAcceleratorDevicesRequired": 1.0},
            # An L40S has no measured start; a package of a few MB downloads in 2 minutes and some.
            "StartupParameters": {"ModelDataDownloadTimeoutInSeconds": 130,
                                  "ContainerStartupHealthCheckTimeoutInSeconds": 1800}}


def query(name):
    return {"ServiceNamespace": "sagemaker", "ResourceId": f"inference-component/{name}",
            "ScalableDimension": COPY_DIMENSION}


def scalable_target(name, lo, hi):
    return {**query(name), "MinCapacity": lo, "MaxCapacity": hi, "CreationTime": NOW,
            "RoleARN": "arn:aws:iam::123456789012:role/aas"}


def policy(name, policy_name, kind):
    return {"PolicyARN": policy_arn(name, policy_name), "PolicyName": policy_name, **query(name), "PolicyType": kind,
            "CreationTime": NOW}


def request(**overrides):
    fields = dict(name=NAME, model_data=parse_s3_uri("s3://models/tts/model.tar.gz"), role=ROLE,
                  instance_type="ml.g6e.2xlarge", image=IMAGE, bake_seconds=600, rollback_errors=2)
    fields.update(overrides)
    return DeployRequest(**fields)


def test_create_a_pool_with_a_component_that_scales_to_zero(stubbed, package, monkeypatch):
    aws, stubs = stubbed
    sm, aa, cw = stubs["sagemaker"], stubs["application-autoscaling"], stubs["cloudwatch"]
    not_found(sm, "describe_endpoint", f'endpoint "{NAME}"')
    expect_checks(stubs, package)
    expect_model(stubs, package, env={"SAGEMAKER_ENDPOINT_NAME": NAME})  # the metrics' EndpointName
    sm.add_response("create_endpoint_config", {"EndpointConfigArn": f"{ARN}:endpoint-config/{NEW}"}, {
        "EndpointConfigName": NEW, "ExecutionRoleArn": ROLE, "Tags": TAGS,
        "ProductionVariants": [{"VariantName": "AllTraffic", "InstanceType": "ml.g6e.2xlarge",
                                "InitialInstanceCount": 1, "InferenceAmiVersion": GPU_AMI,
                                "ManagedInstanceScaling": {"Status": "ENABLED", "MinInstanceCount": 0,
                                                           "MaxInstanceCount": 3},
                                "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]})
    sm.add_response("create_endpoint", {"EndpointArn": f"{ARN}:endpoint/{NAME}"},
                    {"EndpointName": NAME, "EndpointConfigName": NEW, "Tags": TAGS})
    sm.add_response("describe_endpoint", endpoint("Creating"), {"EndpointName": NAME})
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    # The component comes only once the endpoint is InService, as SageMaker requires.
    sm.add_response("create_inference_component", {"InferenceComponentArn": f"{ARN}:inference-component/{NAME}"}, {
        "InferenceComponentName": NAME, "EndpointName": NAME, "VariantName": "AllTraffic", "Specification": spec(NEW),
        "RuntimeConfig": {"CopyCount": 1}, "Tags": TAGS})
    # The dashboard and health alarms, as a deploy of one model makes them: per component where
    # SageMaker's metric has its name, per endpoint for fish-sm's own.
    sm.add_response("list_inference_components", listed(NAME), {"EndpointNameEquals": NAME})
    cw.add_response("put_dashboard", {}, {"DashboardName": f"fish-sm-{NAME}", "DashboardBody": ANY})
    expect_health_alarms(cw, NAME)
    bodies = dashboards_put(aws)
    sm.add_response("describe_inference_component", component(NAME, "Creating", NEW, current=0),
                    {"InferenceComponentName": NAME})
    sm.add_response("describe_inference_component", component(NAME, "InService", NEW),
                    {"InferenceComponentName": NAME})
    aa.add_response("register_scalable_target", {}, {**query(NAME), "MinCapacity": 0, "MaxCapacity": 4,
                                                     "Tags": {"fish-sm:endpoint": NAME}})
    aa.add_response("put_scaling_policy", {"PolicyARN": policy_arn(NAME, "fish-sm-concurrency")}, {
        "PolicyName": "fish-sm-concurrency", **query(NAME), "PolicyType": "TargetTrackingScaling",
        "TargetTrackingScalingPolicyConfiguration": {
            "TargetValue": 24.0, "ScaleInCooldown": 300, "ScaleOutCooldown": 60,
            "PredefinedMetricSpecification": {
                "PredefinedMetricType": "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution"}}})
    wake = policy_arn(NAME, "fish-sm-wake-from-zero")
    aa.add_response("put_scaling_policy", {"PolicyARN": wake}, {
        "PolicyName": "fish-sm-wake-from-zero", **query(NAME), "PolicyType": "StepScaling",
        "StepScalingPolicyConfiguration": {
            "AdjustmentType": "ChangeInCapacity", "MetricAggregationType": "Maximum", "Cooldown": 60,
            "StepAdjustments": [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}]}})
    cw.add_response("put_metric_alarm", {}, {
        "AlarmName": f"fish-sm/{NAME}/{NAME}/no-capacity", "AlarmDescription": ANY, "AlarmActions": [wake],
        "Namespace": "AWS/SageMaker", "MetricName": "NoCapacityInvocationFailures",
        "Dimensions": [{"Name": "InferenceComponentName", "Value": NAME}], "Statistic": "Sum", "Period": 60,
        "EvaluationPeriods": 1, "DatapointsToAlarm": 1, "Threshold": 1.0,
        "ComparisonOperator": "GreaterThanOrEqualToThreshold", "TreatMissingData": "notBreaching", "Tags": TAGS})
    aa.add_response("describe_scaling_policies", {"ScalingPolicies": [
        policy(NAME, "fish-sm-concurrency", "TargetTrackingScaling"),
        policy(NAME, "fish-sm-wake-from-zero", "StepScaling")]}, query(NAME))

    code, out = cli(monkeypatch, aws, "deploy", NAME, "--model-data", "s3://models/tts/model.tar.gz", "--role", ROLE,
                    "--image", IMAGE, "--instance-type", "ml.g6e.2xlarge", "--components", "--scale-to-zero",
                    "--max-copies", 4, "--max", 3, "--target", 24, "--poll", 0)
    assert code == 0, out
    lines = out.splitlines()
    assert "creating component tts: 1 copy, 1 GPU and 8192 MB a copy" in lines
    assert "autoscaling component tts: 0-4 copies" in lines
    assert ("policy fish-sm-wake-from-zero + alarm fish-sm/tts/tts/no-capacity: the first call that finds no "
            "copy adds one") in lines
    assert lines[-1] == ("component tts of endpoint tts created and InService on tts-20250102030405678, 1/1 copies; "
                         "invoke it with `fish-sm invoke tts --component tts ...`")
    assert "dashboard fish-sm-tts: fish-sm's and SageMaker's metrics of components tts of tts" in lines
    assert "alarm fish-sm/tts/tts/5xx-rate: 5XX answers from component tts of endpoint tts over 1% of invocations" \
        in lines
    (body,) = bodies
    series = [m for w in body["widgets"] for m in w["properties"]["metrics"]]
    assert ["AWS/SageMaker", "Invocation5XXErrors", "InferenceComponentName", NAME,
            {"stat": "Sum", "label": NAME}] in series
    assert ["fish-sm", "FirstAudio", "EndpointName", NAME, "Server", "batching",
            {"stat": "p99", "label": "p99 (batching)"}] in series
    assert not [m for m in series if m[0] == "AWS/SageMaker" and "VariantName" in m]  # no variant metrics here


def test_an_mms_component_added_without_alarms_removes_its_own(stubbed, package):
    """--no-alarms on a component of the mms server: the dashboard lists both components; the
    endpoint's and this component's health alarms go, the other component's stays."""
    from fish_sm.aws.monitoring import Monitoring

    aws, stubs = stubbed
    sm, cw = stubs["sagemaker"], stubs["cloudwatch"]
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    sm.add_response("describe_endpoint_config", pool_config(), {"EndpointConfigName": NEW})
    not_found(sm, "describe_inference_component", f"inference component {SECOND}")
    expect_checks(stubs, package)
    expect_model(stubs, package, env={"SAGEMAKER_ENDPOINT_NAME": NAME, "FISH_SM_SERVER": "mms"})
    sm.add_response("create_inference_component", {"InferenceComponentArn": f"{ARN}:inference-component/{SECOND}"}, {
        "InferenceComponentName": SECOND, "EndpointName": NAME, "VariantName": "AllTraffic", "Specification": spec(NEW),
        "RuntimeConfig": {"CopyCount": 1}, "Tags": TAGS})
    sm.add_response("list_inference_components", listed(NAME, SECOND), {"EndpointNameEquals": NAME})
    cw.add_response("put_dashboard", {}, {"DashboardName": f"fish-sm-{NAME}", "DashboardBody": ANY})
    bodies = dashboards_put(aws)
    kept = f"fish-sm/{NAME}/{NAME}/5xx-rate"
    gone = [f"fish-sm/{NAME}/first-audio-p99", f"fish-sm/{NAME}/rejection-rate", f"fish-sm/{NAME}/{SECOND}/5xx-rate"]
    cw.add_response("describe_alarms", {"MetricAlarms": [{"AlarmName": n} for n in [kept, *gone]]},
                    {"AlarmNamePrefix": f"fish-sm/{NAME}/", "AlarmTypes": ["MetricAlarm"]})
    cw.add_response("delete_alarms", {}, {"AlarmNames": gone})
    lines = []
    result = cd.deploy_component(aws, request(env={"FISH_SM_SERVER": "mms"}), ComponentOptions(name=SECOND),
                                 wait=False, poll_s=0, log=lines.append, monitoring=Monitoring(alarms=None))
    assert result.action == "added"
    assert [f"removed alarm {n}" for n in gone] == lines[-3:]
    (body,) = bodies
    labels = {m[-1]["label"] for w in body["widgets"] for m in w["properties"]["metrics"] if m[0] == "AWS/SageMaker"}
    assert labels == {NAME, SECOND}


def test_add_a_second_component_with_its_own_copies(stubbed, package):
    aws, stubs = stubbed
    sm, aa, cw = stubs["sagemaker"], stubs["application-autoscaling"], stubs["cloudwatch"]
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    sm.add_response("describe_endpoint_config", pool_config(), {"EndpointConfigName": NEW})
    not_found(sm, "describe_inference_component", f"inference component {SECOND}")
    expect_checks(stubs, package)
    expect_model(stubs, package)
    sm.add_response("create_inference_component", {"InferenceComponentArn": f"{ARN}:inference-component/{SECOND}"}, {
        "InferenceComponentName": SECOND, "EndpointName": NAME, "VariantName": "AllTraffic",
        "Specification": spec(NEW, memory=6144), "RuntimeConfig": {"CopyCount": 2}, "Tags": TAGS})
    sm.add_response("describe_inference_component", component(SECOND, "InService", NEW, 2, 2, memory=6144),
                    {"InferenceComponentName": SECOND})
    aa.add_response("register_scalable_target", {}, {**query(SECOND), "MinCapacity": 1, "MaxCapacity": 6,
                                                     "Tags": {"fish-sm:endpoint": NAME}})
    aa.add_response("put_scaling_policy", {"PolicyARN": policy_arn(SECOND, "fish-sm-invocations")}, {
        "PolicyName": "fish-sm-invocations", **query(SECOND), "PolicyType": "TargetTrackingScaling",
        "TargetTrackingScalingPolicyConfiguration": {
            "TargetValue": 120.0, "ScaleInCooldown": 300, "ScaleOutCooldown": 60,
            "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerInferenceComponentInvocationsPerCopy"}}})
    # A policy of another metric from an earlier deploy goes; the wake alarm is looked for and not there.
    aa.add_response("describe_scaling_policies", {"ScalingPolicies": [
        policy(SECOND, "fish-sm-invocations", "TargetTrackingScaling"),
        policy(SECOND, "fish-sm-concurrency", "TargetTrackingScaling")]}, query(SECOND))
    aa.add_response("delete_scaling_policy", {}, {"PolicyName": "fish-sm-concurrency", **query(SECOND)})
    cw.add_response("describe_alarms", {"MetricAlarms": []}, {"AlarmNames": [f"fish-sm/{NAME}/{SECOND}/no-capacity"]})
    lines = []
    opts = ComponentOptions(name=SECOND, copies=2, min_copies=1, max_copies=6, memory_mb=6144, target=120,
                            metric="invocations")
    result = cd.deploy_component(aws, request(), opts, poll_s=0, log=lines.append)
    assert (result.action, result.component, result.config_name, result.accelerators) == ("added", SECOND, None, 1)
    assert "removed stale policy fish-sm-concurrency of component tts-int8" in lines


def expect_update(stubs, package, refuse=False):
    sm, cw = stubs["sagemaker"], stubs["cloudwatch"]
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    sm.add_response("describe_endpoint_config", pool_config(), {"EndpointConfigName": NEW})
    sm.add_response("describe_inference_component", component(SECOND, "InService", OLD, 3, 3),
                    {"InferenceComponentName": SECOND})
    expect_checks(stubs, package)
    expect_model(stubs, package)
    cw.add_response("put_metric_alarm", {}, {
        "AlarmName": f"fish-sm/{NAME}/{SECOND}/invocation-5xx", "AlarmDescription": ANY,
        "Namespace": "AWS/SageMaker", "MetricName": "Invocation5XXErrors",
        "Dimensions": [{"Name": "InferenceComponentName", "Value": SECOND}], "Statistic": "Sum", "Period": 60,
        "EvaluationPeriods": 1, "Threshold": 2.0, "ComparisonOperator": "GreaterThanOrEqualToThreshold",
        "TreatMissingData": "notBreaching", "Tags": TAGS})
    if refuse:
        sm.add_client_error("update_inference_component", "ValidationException", "Cannot update in-progress component")
        return
    sm.add_response("update_inference_component", {"InferenceComponentArn": f"{ARN}:inference-component/{SECOND}"}, {
        "InferenceComponentName": SECOND, "Specification": spec(NEW),
        "DeploymentConfig": {
            "RollingUpdatePolicy": {
                "MaximumBatchSize": {"Type": "COPY_COUNT", "Value": 2}, "WaitIntervalInSeconds": 600,
                # Two batches of 3 copies, each with room for download and warm-up twice, and its baking.
                "MaximumExecutionTimeoutInSeconds": 2 * (2 * (1800 + 130) + 600),
                "RollbackMaximumBatchSize": {"Type": "CAPACITY_PERCENT", "Value": 100}},
            "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": f"fish-sm/{NAME}/{SECOND}/invocation-5xx"}]}}})
    sm.add_response("describe_inference_component", component(SECOND, "Updating", OLD, 3, 3),
                    {"InferenceComponentName": SECOND})


def test_update_rolls_copies_over_with_rollback_on_the_alarm(stubbed, package):
    aws, stubs = stubbed
    sm, aa, cw = stubs["sagemaker"], stubs["application-autoscaling"], stubs["cloudwatch"]
    expect_update(stubs, package)
    sm.add_response("describe_inference_component", component(SECOND, "InService", NEW, 3, 3),
                    {"InferenceComponentName": SECOND})
    # No copy scaling asked for: any there was is removed, as deploy's options give the wanted state.
    aa.add_response("describe_scalable_targets", {"ScalableTargets": []},
                    {"ServiceNamespace": "sagemaker", "ResourceIds": [f"inference-component/{SECOND}"],
                     "ScalableDimension": COPY_DIMENSION})
    cw.add_response("describe_alarms", {"MetricAlarms": []}, {"AlarmNames": [f"fish-sm/{NAME}/{SECOND}/no-capacity"]})
    lines = []
    opts = ComponentOptions(name=SECOND, update=True, batch_copies=2)
    result = cd.deploy_component(aws, request(), opts, poll_s=0, log=lines.append)
    assert result.action == "updated" and result.component_desc["Specification"]["ModelName"] == NEW
    assert any("2 copies at a time" in line and "fish-sm/tts/tts-int8/invocation-5xx" in line for line in lines)


def test_rolled_back_update_is_a_failure(stubbed, package):
    aws, stubs = stubbed
    expect_update(stubs, package)
    stubs["sagemaker"].add_response("describe_inference_component", component(
        SECOND, "InService", OLD, 3, 3, reason="Alarm fish-sm/tts/tts-int8/invocation-5xx fired"),
        {"InferenceComponentName": SECOND})
    with pytest.raises(AWSError, match=rf"update of component tts-int8 was rolled back \(Alarm fish-sm/tts/tts-int8/"
                                       rf"invocation-5xx fired\); it still serves {OLD}"):
        cd.deploy_component(aws, request(), ComponentOptions(name=SECOND, update=True, batch_copies=2), poll_s=0)


def test_refused_update_removes_the_new_model(stubbed, package):
    aws, stubs = stubbed
    expect_update(stubs, package, refuse=True)
    stubs["sagemaker"].add_response("delete_model", {}, {"ModelName": NEW})
    with pytest.raises(Exception, match="Cannot update in-progress component"):
        cd.deploy_component(aws, request(), ComponentOptions(name=SECOND, update=True), poll_s=0)


def test_adding_an_existing_component_or_to_a_plain_endpoint_is_refused(stubbed):
    aws, stubs = stubbed
    sm = stubs["sagemaker"]
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    sm.add_response("describe_endpoint_config", pool_config(), {"EndpointConfigName": NEW})
    sm.add_response("describe_inference_component", component(SECOND, "InService", OLD),
                    {"InferenceComponentName": SECOND})
    with pytest.raises(AWSError, match="has component tts-int8 already: pass --update"):
        cd.deploy_component(aws, request(), ComponentOptions(name=SECOND), poll_s=0)
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    plain = pool_config()
    plain["ProductionVariants"][0]["ModelName"] = OLD
    sm.add_response("describe_endpoint_config", plain, {"EndpointConfigName": NEW})
    with pytest.raises(AWSError, match="serves one model, not inference components"):
        cd.deploy_component(aws, request(), ComponentOptions(name=SECOND), poll_s=0)


def test_options_checked_before_any_call():
    with pytest.raises(InputError, match="--copies 0 needs --min-copies 0"):
        ComponentOptions(copies=0).validate(1)
    with pytest.raises(InputError, match=r"--copies \(5\) must lie between --min-copies \(1\) and --max-copies \(4\)"):
        ComponentOptions(copies=5, min_copies=1, max_copies=4).validate(1)
    with pytest.raises(InputError, match="--min-copies needs --max-copies"):
        ComponentOptions(min_copies=2).validate(1)
    with pytest.raises(InputError, match=r"--instances \(3\) must lie between the pool's --min \(0\) and --max \(2\)"):
        ComponentOptions(min_copies=0, max_instances=2).validate(3)
    with pytest.raises(InputError, match="--accelerators 2: the instance type has 1 GPU"):
        ComponentOptions(accelerators=2).accelerators_for(1)
    scaling = ComponentOptions(min_copies=0).scaling()
    assert (scaling.min, scaling.max, scaling.scale_to_zero) == (0, 1, True)
    assert ComponentOptions(min_copies=0).pool(1) == (0, 1) and ComponentOptions().pool(2) == (2, 2)


def test_cli_refuses_component_options_without_components():
    result = CliRunner().invoke(main, ["deploy", NAME, "--model-data", "s3://m/model.tar.gz", "--role", ROLE,
                                       "--image", IMAGE, "--max-copies", "3"])
    assert result.exit_code == 2 and "--max-copies only apply with --components or --component" in result.output
    result = CliRunner().invoke(main, ["deploy", NAME, "--model-data", "s3://m/model.tar.gz", "--role", ROLE,
                                       "--image", IMAGE, "--components", "--async", "--async-output", "s3://b/o/"])
    assert result.exit_code == 2 and "asynchronous endpoints cannot hold inference components" in result.output


def test_scale_copies_widens_autoscaling_and_waits(stubbed, monkeypatch):
    aws, stubs = stubbed
    sm, aa = stubs["sagemaker"], stubs["application-autoscaling"]
    sm.add_response("describe_inference_component", component(SECOND, "InService", NEW, 2, 2),
                    {"InferenceComponentName": SECOND})
    aa.add_response("describe_scalable_targets", {"ScalableTargets": [scalable_target(SECOND, 1, 2)]},
                    {"ServiceNamespace": "sagemaker", "ResourceIds": [f"inference-component/{SECOND}"],
                     "ScalableDimension": COPY_DIMENSION})
    aa.add_response("register_scalable_target", {}, {**query(SECOND), "MinCapacity": 1, "MaxCapacity": 3})
    sm.add_response("update_inference_component_runtime_config",
                    {"InferenceComponentArn": f"{ARN}:inference-component/{SECOND}"},
                    {"InferenceComponentName": SECOND, "DesiredRuntimeConfig": {"CopyCount": 3}})
    sm.add_response("describe_inference_component", component(SECOND, "Updating", NEW, 2, 3),
                    {"InferenceComponentName": SECOND})
    sm.add_response("describe_inference_component", component(SECOND, "InService", NEW, 3, 3),
                    {"InferenceComponentName": SECOND})
    code, out = cli(monkeypatch, aws, "scale", NAME, "--component", SECOND, "--copies", 3, "--poll", 0)
    assert code == 0, out
    lines = out.splitlines()
    assert "autoscaling of component tts-int8 was 1-2 copies, now 1-3 so that 3 holds" in lines
    assert lines[-1] == "tts component tts-int8: InService, 3 running, 3 desired"
    result = CliRunner().invoke(main, ["scale", NAME, "--copies", "3"])
    assert result.exit_code == 2 and "give --component C with --copies N" in result.output


def expect_component_status(stubs, name, target=None, policies=()):
    sm, aa = stubs["sagemaker"], stubs["application-autoscaling"]
    sm.add_response("describe_inference_component", component(name, "InService", NEW, 0 if target else 2,
                                                               0 if target else 2), {"InferenceComponentName": name})
    aa.add_response("describe_scalable_targets", {"ScalableTargets": [target] if target else []},
                    {"ServiceNamespace": "sagemaker", "ResourceIds": [f"inference-component/{name}"],
                     "ScalableDimension": COPY_DIMENSION})
    if target:
        aa.add_response("describe_scaling_policies", {"ScalingPolicies": list(policies)}, query(name))


def test_status_lists_components_with_copies_and_state(stubbed, monkeypatch):
    aws, stubs = stubbed
    sm, aa, cw = stubs["sagemaker"], stubs["application-autoscaling"], stubs["cloudwatch"]
    for output in ("json", "text"):
        sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
        sm.add_response("describe_endpoint_config", pool_config(), {"EndpointConfigName": NEW})
        aa.add_response("describe_scalable_targets", {"ScalableTargets": []},
                        {"ServiceNamespace": "sagemaker", "ResourceIds": [f"endpoint/{NAME}/variant/AllTraffic"],
                         "ScalableDimension": "sagemaker:variant:DesiredInstanceCount"})
        sm.add_response("list_inference_components", {"InferenceComponents": [
            {"InferenceComponentName": n, "InferenceComponentArn": f"{ARN}:inference-component/{n}",
             "EndpointName": NAME, "EndpointArn": f"{ARN}:endpoint/{NAME}", "VariantName": "AllTraffic",
             "InferenceComponentStatus": "InService", "CreationTime": NOW, "LastModifiedTime": NOW}
            for n in (SECOND, NAME)]}, {"EndpointNameEquals": NAME})
        tt = policy(NAME, "fish-sm-concurrency", "TargetTrackingScaling")
        tt["TargetTrackingScalingPolicyConfiguration"] = {"TargetValue": 24.0, "PredefinedMetricSpecification": {
            "PredefinedMetricType": "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution"}}
        expect_component_status(stubs, NAME, scalable_target(NAME, 0, 4),
                                [tt, policy(NAME, "fish-sm-wake-from-zero", "StepScaling")])
        expect_component_status(stubs, SECOND)
        cw.add_response("describe_alarms", {"MetricAlarms": [{"AlarmName": f"fish-sm/{NAME}/{NAME}/no-capacity",
                                                              "StateValue": "OK",
                                                              "MetricName": "NoCapacityInvocationFailures"}]},
                        {"AlarmNamePrefix": f"fish-sm/{NAME}/", "AlarmTypes": ["MetricAlarm"]})
        code, out = cli(monkeypatch, aws, "status", NAME, "--output", output)
        assert code == 0, out
        if output == "json":
            s = json.loads(out)
            assert s["model"] is None and s["instance_pool"] == {"min": 0, "max": 2}
            assert [(c["name"], c["status"], c["copies"]) for c in s["components"]] == [
                (NAME, "InService", {"current": 0, "desired": 0}), (SECOND, "InService", {"current": 2, "desired": 2})]
            assert s["components"][0]["autoscaling"]["min"] == 0
    assert "  component tts: InService, 0/0 copies (current/desired), model tts-20250102030405678, 1 GPU, " \
           "8192 MB a copy" in out.splitlines()
    assert ("    autoscaling 0-4 copies; fish-sm-concurrency (TargetTrackingScaling, "
            "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution target 24); "
            "fish-sm-wake-from-zero (StepScaling)") in out.splitlines()


def test_delete_removes_components_and_waits_before_the_endpoint(stubbed, monkeypatch):
    aws, stubs = stubbed
    sm, aa, cw = stubs["sagemaker"], stubs["application-autoscaling"], stubs["cloudwatch"]
    variant = {"ServiceNamespace": "sagemaker", "ResourceId": f"endpoint/{NAME}/variant/AllTraffic",
               "ScalableDimension": "sagemaker:variant:DesiredInstanceCount"}
    aa.add_response("describe_scaling_policies", {"ScalingPolicies": []}, variant)
    aa.add_response("describe_scalable_targets", {"ScalableTargets": []}, {
        "ServiceNamespace": "sagemaker", "ResourceIds": [variant["ResourceId"]],
        "ScalableDimension": variant["ScalableDimension"]})
    cw.add_response("describe_alarms", {"MetricAlarms": []},
                    {"AlarmNamePrefix": f"fish-sm/{NAME}/has-backlog-without-capacity", "AlarmTypes": ["MetricAlarm"]})
    # The wake alarm, the health alarms deploy made (per component and per endpoint), the dashboard.
    alarms = [f"fish-sm/{NAME}/{NAME}/no-capacity", f"fish-sm/{NAME}/{NAME}/5xx-rate",
              f"fish-sm/{NAME}/{SECOND}/5xx-rate", f"fish-sm/{NAME}/first-audio-p99"]
    cw.add_response("describe_alarms", {"MetricAlarms": [{"AlarmName": a} for a in alarms]},
                    {"AlarmNamePrefix": f"fish-sm/{NAME}/", "AlarmTypes": ["MetricAlarm"]})
    cw.add_response("delete_alarms", {}, {"AlarmNames": alarms})
    cw.add_response("get_dashboard", {"DashboardName": f"fish-sm-{NAME}", "DashboardBody": "{}"},
                    {"DashboardName": f"fish-sm-{NAME}"})
    cw.add_response("delete_dashboards", {}, {"DashboardNames": [f"fish-sm-{NAME}"]})
    sm.add_response("describe_endpoint", endpoint("InService"), {"EndpointName": NAME})
    sm.add_response("describe_endpoint_config", pool_config(), {"EndpointConfigName": NEW})
    sm.add_response("list_inference_components", {"InferenceComponents": [
        {"InferenceComponentName": n, "InferenceComponentArn": f"{ARN}:inference-component/{n}",
         "EndpointName": NAME, "EndpointArn": f"{ARN}:endpoint/{NAME}", "VariantName": "AllTraffic",
         "InferenceComponentStatus": "InService", "CreationTime": NOW, "LastModifiedTime": NOW}
        for n in (NAME, SECOND)]}, {"EndpointNameEquals": NAME})
    for name, target in ((NAME, scalable_target(NAME, 0, 4)), (SECOND, None)):
        aa.add_response("describe_scalable_targets", {"ScalableTargets": [target] if target else []},
                        {"ServiceNamespace": "sagemaker", "ResourceIds": [f"inference-component/{name}"],
                         "ScalableDimension": COPY_DIMENSION})
        if target:
            aa.add_response("deregister_scalable_target", {}, query(name))
        cw.add_response("describe_alarms", {"MetricAlarms": []}, {"AlarmNames": [f"fish-sm/{NAME}/{name}/no-capacity"]})
        sm.add_response("describe_inference_component", component(name, "InService", NEW),
                        {"InferenceComponentName": name})
        sm.add_response("delete_inference_component", {}, {"InferenceComponentName": name})
    # Deleting takes a while: the endpoint is deleted only once both components are gone.
    sm.add_response("describe_inference_component", component(NAME, "Deleting", NEW), {"InferenceComponentName": NAME})
    not_found(sm, "describe_inference_component", f"inference component {SECOND}")
    not_found(sm, "describe_inference_component", f"inference component {NAME}")
    sm.add_response("delete_endpoint", {}, {"EndpointName": NAME})
    sm.add_response("list_endpoint_configs", {"EndpointConfigs": [
        {"EndpointConfigName": NEW, "EndpointConfigArn": f"{ARN}:endpoint-config/{NEW}", "CreationTime": NOW}]},
        {"NameContains": NAME})
    sm.add_response("delete_endpoint_config", {}, {"EndpointConfigName": NEW})
    sm.add_response("list_models", {"Models": [
        {"ModelName": m, "ModelArn": f"{ARN}:model/{m}", "CreationTime": NOW} for m in (OLD, NEW)]},
        {"NameContains": NAME})
    sm.add_response("delete_model", {}, {"ModelName": OLD})
    sm.add_response("delete_model", {}, {"ModelName": NEW})
    code, out = cli(monkeypatch, aws, "delete", NAME, "--poll", 0)
    assert code == 0, out
    assert out.splitlines() == [
        *[f"removed alarm {a}" for a in alarms], f"removed dashboard fish-sm-{NAME}",
        "removed autoscaling of component tts", "removed component tts",
        "removed component tts-int8", "removed endpoint tts", f"removed endpoint config {NEW}",
        f"removed model {OLD}", f"removed model {NEW}"]

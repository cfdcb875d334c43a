"""What moto cannot run, checked request by request against the real service models with botocore's Stubber:
the blue/green update with auto-rollback, a rolled-back update, and the stock container's image lookup."""

import datetime
import hashlib
import io
import sys
import types

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from fish_sm.aws import AWSError
from fish_sm.aws import deploy as d
from fish_sm.aws.autoscaling import (DEFAULT_TARGETS, DIMENSION, default_target, make_autoscaling, policy_request,
                                     wake_alarm_request, wake_policy_request, with_target)
from fish_sm.aws.container import container_environment, stock_image_uri
from fish_sm.aws.deploy_request import DeployRequest
from fish_sm.aws.endpoints import wait_endpoint
from fish_sm.aws.s3 import parse_s3_uri
from fish_sm.aws.session import AWS
from fish_sm.errors import InputError
from package_bytes import package_tarball

NAME = "tts"
STAMP = "20250102030405678"
NEW = f"{NAME}-{STAMP}"
OLD = f"{NAME}-20240101000000000"
RID = f"endpoint/{NAME}/variant/AllTraffic"
ROLE = "arn:aws:iam::123456789012:role/fish-sm"
NOW = datetime.datetime(2025, 1, 2, tzinfo=datetime.timezone.utc)
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/fish-sm:0.1"
GPU_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"
POLICY_ARN = ("arn:aws:autoscaling:us-east-1:123456789012:scalingPolicy:11111111-2222-3333-4444-555555555555:"
              f"resource/sagemaker/{RID}:policyName/fish-sm-concurrency")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """(model.tar.gz bytes, manifest.json bytes) of a small fish-sm package."""
    return package_tarball(tmp_path_factory.mktemp("package"))


@pytest.fixture
def stubbed(monkeypatch):
    """An AWS whose clients are real botocore clients (real service models) answered by Stubbers."""
    monkeypatch.setattr(d, "new_stamp", lambda: STAMP)
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    aws = AWS(region="us-east-1")
    aws._session = session
    stubs = {}
    for service in ("sagemaker", "s3", "application-autoscaling", "cloudwatch", "ec2", "ecr"):
        c = session.client(service)
        aws._clients[service] = c
        stubs[service] = Stubber(c)
        stubs[service].activate()
    yield aws, stubs
    for s in stubs.values():
        s.deactivate()


def endpoint(status, config, reason=None):
    out = {"EndpointName": NAME, "EndpointArn": f"arn:aws:sagemaker:us-east-1:123456789012:endpoint/{NAME}",
           "EndpointConfigName": config, "EndpointStatus": status, "CreationTime": NOW, "LastModifiedTime": NOW,
           "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": 1, "DesiredInstanceCount": 1}]}
    if reason:
        out["FailureReason"] = reason
    return out


def request(**overrides):
    scaling = make_autoscaling(instances=1, min_instances=None, max_instances=4, target=None, metric="concurrency",
                               is_async=False, scale_to_zero=False)
    fields = dict(name=NAME, model_data=parse_s3_uri("s3://models/tts/model.tar.gz"), role=ROLE,
                  instance_type="ml.g6e.2xlarge", image=IMAGE,
                  env={"FISH_SM_QUANTIZE": "int8"}, autoscaling=scaling, bake_seconds=600, rollback_errors=3)
    fields.update(overrides)
    return DeployRequest(**fields)


def expect_checks(stubs, package, *, ec2_type="g6e.2xlarge", gpus=1):
    """The reads deploy makes before creating anything: the instance type, the ECR image, the package."""
    stubs["ec2"].add_response("describe_instance_types", {"InstanceTypes": [
        {"InstanceType": ec2_type, **({"GpuInfo": {"Gpus": [{"Name": "L40S", "Manufacturer": "NVIDIA", "Count": gpus,
                                                             "MemoryInfo": {"SizeInMiB": 45776}}]}} if gpus else {})}]},
        {"InstanceTypes": [ec2_type]})
    stubs["ecr"].add_response("describe_images", {"imageDetails": [
        {"registryId": "123456789012", "repositoryName": "fish-sm", "imageDigest": "sha256:" + "c" * 64,
         "imageTags": ["0.1"]}]},
        {"registryId": "123456789012", "repositoryName": "fish-sm", "imageIds": [{"imageTag": "0.1"}]})
    tarball = package[0]
    stubs["s3"].add_response("head_object", {"ContentLength": len(tarball)}, {"Bucket": "models", "Key": "tts/model.tar.gz"})
    stubs["s3"].add_response("get_object", {"Body": StreamingBody(io.BytesIO(tarball), len(tarball)),
                                            "ContentLength": len(tarball),
                                            "ContentRange": f"bytes 0-{len(tarball) - 1}/{len(tarball)}"},
                             {"Bucket": "models", "Key": "tts/model.tar.gz", "Range": "bytes=0-65535"})


def expect_update_start(stubs, package, old_instance_type, refuse_update=False):
    sm, aa, cw = (stubs[k] for k in ("sagemaker", "application-autoscaling", "cloudwatch"))
    sm.add_response("describe_endpoint", endpoint("InService", OLD), {"EndpointName": NAME})
    expect_checks(stubs, package)
    sm.add_response("create_model", {"ModelArn": f"arn:aws:sagemaker:us-east-1:123456789012:model/{NEW}"}, {
        "ModelName": NEW, "ExecutionRoleArn": ROLE,
        "PrimaryContainer": {"Image": IMAGE, "ModelDataUrl": "s3://models/tts/model.tar.gz",
                             "Environment": {"SAGEMAKER_CONTAINER_LOG_LEVEL": "20", "FISH_SM_QUANTIZE": "int8",
                                             "FISH_SM_MANIFEST_SHA256": hashlib.sha256(package[1]).hexdigest()}},
        "Tags": [{"Key": "fish-sm:endpoint", "Value": NAME}]})
    sm.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint-config/x"}, {
        "EndpointConfigName": NEW, "Tags": [{"Key": "fish-sm:endpoint", "Value": NAME}],
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": NEW, "InitialInstanceCount": 1,
                                "InstanceType": "ml.g6e.2xlarge", "ContainerStartupHealthCheckTimeoutInSeconds": 1800,
                                "ModelDataDownloadTimeoutInSeconds": 130, "InferenceAmiVersion": GPU_AMI,
                                "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]})
    cw.add_response("put_metric_alarm", {}, {
        "AlarmName": "fish-sm/tts/invocation-5xx", "AlarmDescription": ANY, "Namespace": "AWS/SageMaker",
        "MetricName": "Invocation5XXErrors", "Statistic": "Sum", "Period": 60, "EvaluationPeriods": 1,
        "Threshold": 3.0, "ComparisonOperator": "GreaterThanOrEqualToThreshold", "TreatMissingData": "notBreaching",
        "Dimensions": [{"Name": "EndpointName", "Value": NAME}, {"Name": "VariantName", "Value": "AllTraffic"}],
        "Tags": [{"Key": "fish-sm:endpoint", "Value": NAME}]})
    sm.add_response("describe_endpoint_config", {
        "EndpointConfigName": OLD, "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint-config/old",
        "CreationTime": NOW, "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": OLD,
                                                     "InitialInstanceCount": 1, "InstanceType": old_instance_type}]},
        {"EndpointConfigName": OLD})
    target = {"ServiceNamespace": "sagemaker", "ResourceId": RID, "ScalableDimension": DIMENSION, "MinCapacity": 1,
              "MaxCapacity": 2, "RoleARN": "arn:aws:iam::123456789012:role/aas", "CreationTime": NOW}
    targets_query = {"ServiceNamespace": "sagemaker", "ResourceIds": [RID], "ScalableDimension": DIMENSION}
    policies_query = {"ServiceNamespace": "sagemaker", "ResourceId": RID, "ScalableDimension": DIMENSION}
    policy = {"PolicyARN": POLICY_ARN, "PolicyName": "fish-sm-concurrency", "ServiceNamespace": "sagemaker",
              "ResourceId": RID, "ScalableDimension": DIMENSION, "PolicyType": "TargetTrackingScaling",
              "CreationTime": NOW}
    if old_instance_type != "ml.g6e.2xlarge":
        # The instance type changes: autoscaling is detached first, as SageMaker requires.
        aa.add_response("describe_scalable_targets", {"ScalableTargets": [target]}, targets_query)
        aa.add_response("describe_scaling_policies", {"ScalingPolicies": [policy]}, policies_query)
        aa.add_response("delete_scaling_policy", {}, {"PolicyName": "fish-sm-concurrency", **policies_query})
        aa.add_response("describe_scalable_targets", {"ScalableTargets": [target]}, targets_query)
        aa.add_response("deregister_scalable_target", {}, policies_query)
        cw.add_response("describe_alarms", {"MetricAlarms": []},
                        {"AlarmNamePrefix": "fish-sm/tts/has-backlog-without-capacity", "AlarmTypes": ["MetricAlarm"]})
    if refuse_update:
        sm.add_client_error("update_endpoint", "ValidationException", "Cannot update in-progress endpoint")
        return policy, policies_query
    sm.add_response("update_endpoint", {"EndpointArn": endpoint("Updating", NEW)["EndpointArn"]}, {
        "EndpointName": NAME, "EndpointConfigName": NEW,
        "DeploymentConfig": {
            "BlueGreenUpdatePolicy": {
                "TrafficRoutingConfiguration": {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 600},
                "TerminationWaitInSeconds": 0, "MaximumExecutionTimeoutInSeconds": 2 * (1800 + 130) + 600},
            "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": "fish-sm/tts/invocation-5xx"}]}}})
    return policy, policies_query


def test_update_is_blue_green_with_rollback_alarm_and_reattaches_autoscaling(stubbed, package):
    aws, stubs = stubbed
    sm, aa, cw = stubs["sagemaker"], stubs["application-autoscaling"], stubs["cloudwatch"]
    policy, policies_query = expect_update_start(stubs, package, old_instance_type="ml.g5.2xlarge")
    sm.add_response("describe_endpoint", endpoint("Updating", OLD), {"EndpointName": NAME})
    sm.add_response("describe_endpoint", endpoint("InService", NEW), {"EndpointName": NAME})
    aa.add_response("register_scalable_target", {}, {**policies_query, "MinCapacity": 1, "MaxCapacity": 4,
                                                     "Tags": {"fish-sm:endpoint": NAME}})
    aa.add_response("put_scaling_policy", {"PolicyARN": POLICY_ARN, "Alarms": []}, {
        "PolicyName": "fish-sm-concurrency", **policies_query, "PolicyType": "TargetTrackingScaling",
        "TargetTrackingScalingPolicyConfiguration": {
            "TargetValue": 32.0, "ScaleInCooldown": 300, "ScaleOutCooldown": 60,  # half of 1 GPU x 64 slots
            "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantConcurrentRequestsPerModelHighResolution"}}})
    aa.add_response("describe_scaling_policies", {"ScalingPolicies": [policy]}, policies_query)
    cw.add_response("describe_alarms", {"MetricAlarms": []},
                    {"AlarmNamePrefix": "fish-sm/tts/has-backlog-without-capacity", "AlarmTypes": ["MetricAlarm"]})
    lines = []
    result = d.deploy(aws, request(), poll_s=0, log=lines.append)
    assert result.action == "updated" and result.config_name == NEW and result.endpoint["EndpointConfigName"] == NEW
    assert any("blue/green" in line and "invocation-5xx" in line for line in lines)
    assert any("removed scalable target" in line and "instance type changes from ml.g5.2xlarge" in line for line in lines)
    assert [line for line in lines if "] tts:" in line] == ["[00:00] tts: Updating", "[00:00] tts: InService"]
    assert ("autoscaling target: 32 concurrent requests per instance (32 requests in flight per engine (1 GPU): the "
            "server sizes its slots by memory at start (FISH_SM_MAX_BATCH 0); the L40S GPU is not measured: "
            "`fish-sm capacity` measures one, and --target gives the measured figure)") in lines
    for s in stubs.values():
        s.assert_no_pending_responses()


def test_rolled_back_update_is_a_failure(stubbed, package):
    aws, stubs = stubbed
    expect_update_start(stubs, package, old_instance_type="ml.g6e.2xlarge")
    sm = stubs["sagemaker"]
    sm.add_response("describe_endpoint", endpoint("RollingBack", OLD), {"EndpointName": NAME})
    sm.add_response("describe_endpoint", endpoint("InService", OLD, reason="Alarm fish-sm/tts/invocation-5xx fired"),
                    {"EndpointName": NAME})
    with pytest.raises(AWSError, match=r"update of tts was rolled back \(Alarm fish-sm/tts/invocation-5xx fired\); "
                                       rf"it still serves {OLD}"):
        d.deploy(aws, request(), poll_s=0)
    for s in stubs.values():
        s.assert_no_pending_responses()


def test_failed_update_api_call_removes_the_new_model_and_config(stubbed, package):
    aws, stubs = stubbed
    sm = stubs["sagemaker"]
    expect_update_start(stubs, package, old_instance_type="ml.g6e.2xlarge", refuse_update=True)
    sm.add_response("delete_endpoint_config", {}, {"EndpointConfigName": NEW})
    sm.add_response("delete_model", {}, {"ModelName": NEW})
    with pytest.raises(Exception, match="Cannot update in-progress endpoint"):
        d.deploy(aws, request(), poll_s=0)
    sm.assert_no_pending_responses()


def test_wait_reports_failure_reason(stubbed):
    aws, stubs = stubbed
    sm = stubs["sagemaker"]
    sm.add_response("describe_endpoint", endpoint("Creating", NEW), {"EndpointName": NAME})
    sm.add_response("describe_endpoint", endpoint("Failed", NEW, reason="CUDA out of memory during warm-up"),
                    {"EndpointName": NAME})
    with pytest.raises(AWSError, match="endpoint tts is Failed: CUDA out of memory during warm-up"):
        wait_endpoint(aws, NAME, poll_s=0)


def test_stock_container_image_from_the_sdk(monkeypatch):
    calls = []

    def retrieve(**kwargs):
        calls.append(kwargs)
        return "763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-inference:2.6.0-gpu-py312"

    sagemaker = types.ModuleType("sagemaker")
    core = types.ModuleType("sagemaker.core")
    image_uris = types.ModuleType("sagemaker.core.image_uris")
    image_uris.retrieve = retrieve
    core.image_uris = image_uris
    sagemaker.core = core
    for name, module in (("sagemaker", sagemaker), ("sagemaker.core", core), ("sagemaker.core.image_uris", image_uris)):
        monkeypatch.setitem(sys.modules, name, module)
    uri = stock_image_uri("eu-west-1", "ml.g5.xlarge")
    assert uri.endswith("pytorch-inference:2.6.0-gpu-py312")
    assert calls == [dict(framework="pytorch", region="eu-west-1", version="2.6", py_version="py312",
                          instance_type="ml.g5.xlarge", image_scope="inference")]


def test_stock_container_without_the_sdk_asks_for_image(monkeypatch):
    monkeypatch.setitem(sys.modules, "sagemaker.core", None)  # import fails as if not installed
    with pytest.raises(AWSError, match=r"pip install 'fish-sm\[sdk\]', or pass the image with --image"):
        stock_image_uri("us-east-1", "ml.g5.xlarge")


def test_stock_container_environment():
    env = container_environment({"SAGEMAKER_TS_MAX_WORKERS": "2", "FISH_SM_WARMUP": "0"}, stock_container=True, gpus=8)
    assert env["SAGEMAKER_TS_MIN_WORKERS"] == "8" and env["SAGEMAKER_TS_MAX_WORKERS"] == "2"  # the user's value wins
    assert env["FISH_SM_WARMUP"] == "0" and env["SAGEMAKER_PROGRAM"] == "inference.py"
    env = container_environment({}, stock_container=True, gpus=0)  # a CPU type: one worker
    assert env["SAGEMAKER_TS_MIN_WORKERS"] == env["SAGEMAKER_TS_MAX_WORKERS"] == "1"
    assert container_environment({}, stock_container=False, gpus=1) == {"SAGEMAKER_CONTAINER_LOG_LEVEL": "20"}


def test_async_scale_to_zero_requests_match_the_service_models():
    """The async policies and alarms, validated against the real application-autoscaling and cloudwatch models."""
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    aa, cw = session.client("application-autoscaling"), session.client("cloudwatch")
    scaling = with_target(make_autoscaling(instances=1, min_instances=None, max_instances=5, target=None,
                                           metric="concurrency", is_async=True, scale_to_zero=True), gpus=1)
    assert (scaling.min, scaling.max, scaling.metric, scaling.target) == (0, 5, "backlog", 2.0)
    with Stubber(aa) as sa, Stubber(cw) as sc:
        sa.add_response("put_scaling_policy", {"PolicyARN": POLICY_ARN}, policy_request(NAME, scaling))
        sa.add_response("put_scaling_policy", {"PolicyARN": POLICY_ARN}, wake_policy_request(NAME))
        sc.add_response("put_metric_alarm", {}, wake_alarm_request(NAME, POLICY_ARN))
        aa.put_scaling_policy(**policy_request(NAME, scaling))
        aa.put_scaling_policy(**wake_policy_request(NAME))
        cw.put_metric_alarm(**wake_alarm_request(NAME, POLICY_ARN))


def test_default_targets_by_server_and_gpus():
    def target(gpus, **kwargs):
        scaling = make_autoscaling(instances=1, min_instances=None, max_instances=2, target=kwargs.pop("target", None),
                                   metric=kwargs.pop("metric", "concurrency"), is_async=kwargs.pop("is_async", False),
                                   scale_to_zero=False)
        return with_target(scaling, gpus=gpus, **kwargs).target

    assert target(4) == 4 * 32 == 128  # slots by memory: 32 a GPU
    assert target(1) == 32 and target(8) == 8 * 32
    assert target(4, env={"FISH_SM_MAX_BATCH": "16"}) == 32  # half of the slots set
    assert target(4, stock_container=True) == DEFAULT_TARGETS["concurrency"] == 2.0
    assert target(4, env={"FISH_SM_SERVER": "MMS"}) == 2.0
    assert target(4, target=7) == 7.0
    assert target(4, metric="invocations") == 60.0  # depends on text length, not slots
    assert target(4, is_async=True) == 2.0  # async: backlog per instance
    value, why = default_target("concurrency", gpus=0)  # a CPU type runs one engine
    assert value == 32 and "per engine (1 CPU engine)" in why
    with pytest.raises(InputError, match="--env: FISH_SM_MAX_BATCH must not be negative"):
        target(1, env={"FISH_SM_MAX_BATCH": "-1"})

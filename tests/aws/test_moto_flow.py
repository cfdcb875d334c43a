"""The AWS commands end to end against moto's standalone server, reached over HTTP with --endpoint-url.

package -> multipart upload -> deploy real-time with autoscaling -> deploy async with scale
to zero -> status, invoke, transform -> delete (twice). Each step is checked with AWS's own
describe calls, not only with what the command printed.
"""

import hashlib
import json
import urllib.request

import boto3
import pytest
from botocore.config import Config
from click.testing import CliRunner

from fish_sm.cli import main
from moto_helpers import moto_server
from package_bytes import make_package_dir, package_tarball

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-test"
DLC = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-inference:2.6-gpu-py312"
GPU_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"
SNS_OK = "arn:aws:sns:us-east-1:123456789012:tts-done"
SNS_ERR = "arn:aws:sns:us-east-1:123456789012:tts-failed"


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    """A moto server on a free port, with dummy credentials and nothing from ~/.aws; the stock
    PyTorch image in AWS's ECR account, as deploy looks it up."""
    with moto_server(tmp_path_factory) as url:
        push_image(url, DLC)
        yield url
        # moto keeps one state per process, which the next module's server shares: leave none behind.
        boto3.client("ecr", endpoint_url=url, region_name="us-east-1").delete_repository(
            registryId="763104351884", repositoryName="pytorch-inference", force=True)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """(model.tar.gz bytes, manifest.json bytes) of a small fish-sm package."""
    return package_tarball(tmp_path_factory.mktemp("package"))


def push_image(url, uri):
    """An image at `uri` (ACCOUNT.dkr.ecr.REGION.amazonaws.com/REPO:TAG) in moto's ECR."""
    registry, _, rest = uri.partition("/")
    repo, _, tag = rest.partition(":")
    account, region = registry.split(".")[0], registry.split(".")[3]
    ecr = boto3.client("ecr", endpoint_url=url, region_name=region)
    try:
        ecr.create_repository(registryId=account, repositoryName=repo)
    except ecr.exceptions.RepositoryAlreadyExistsException:
        pass
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 2,
                           "digest": "sha256:" + hashlib.sha256(uri.encode()).hexdigest()}, "layers": []}
    ecr.put_image(registryId=account, repositoryName=repo, imageManifest=json.dumps(manifest), imageTag=tag)


def client(url, service):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def cli(url, *args, ok=True):
    result = CliRunner().invoke(main, [*map(str, args), "--endpoint-url", url])
    assert "Traceback" not in result.output
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert lines[-1].startswith("Error: "), result.output
    return result.output


def test_package_and_multipart_upload(moto_url, tmp_path):
    """The tiny checkpoint, packaged for real, goes up in 5 MiB parts."""
    client(moto_url, "s3").create_bucket(Bucket=BUCKET)
    ckpt = tmp_path / "ckpt"
    assert CliRunner().invoke(main, ["make-checkpoint", str(ckpt), "--preset", "tiny"]).exit_code == 0
    out = tmp_path / "model.tar.gz"
    printed = cli(moto_url, "package", ckpt, "-o", out, "--upload", f"s3://{BUCKET}/models/v1/", "--part-size", 5)
    uri = f"s3://{BUCKET}/models/v1/model.tar.gz"
    assert printed.strip().splitlines()[-1] == uri
    s3 = client(moto_url, "s3")
    head = s3.head_object(Bucket=BUCKET, Key="models/v1/model.tar.gz")
    parts = -(-out.stat().st_size // (5 * 1024 * 1024))
    assert parts > 1 and head["ETag"].strip('"').endswith(f"-{parts}")  # a multipart upload
    assert head["ContentLength"] == out.stat().st_size and head["ContentType"] == "application/gzip"
    body = s3.get_object(Bucket=BUCKET, Key="models/v1/model.tar.gz")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(out.read_bytes()).hexdigest()

    # An exact key instead of a prefix keeps the given name; a small file goes up in one part.
    src = make_package_dir(tmp_path / "pkg", 1024)
    cli(moto_url, "package", src, "-o", out, "--upload", f"s3://{BUCKET}/exact/name.tar.gz")
    head = s3.head_object(Bucket=BUCKET, Key="exact/name.tar.gz")
    assert head["ContentLength"] == out.stat().st_size and "-" not in head["ETag"]


def _variant(sm, config_name):
    return sm.describe_endpoint_config(EndpointConfigName=config_name)["ProductionVariants"][0]


def test_deploy_status_invoke_transform_delete(moto_url, package, tmp_path):
    s3, sm = client(moto_url, "s3"), client(moto_url, "sagemaker")
    aa, cw = client(moto_url, "application-autoscaling"), client(moto_url, "cloudwatch")
    s3.create_bucket(Bucket="fish-sm-flow")
    s3.put_object(Bucket="fish-sm-flow", Key="m/model.tar.gz", Body=package[0])
    model_data = "s3://fish-sm-flow/m/model.tar.gz"

    # Real-time, our own image, autoscaling on concurrency.
    printed = cli(moto_url, "deploy", "tts-rt", "--model-data", model_data, "--role", ROLE, "--image", "123.dkr/fish-sm:1",
                  "--instance-type", "ml.g4dn.xlarge", "--instances", 2, "--max", 4, "--target", 3,
                  "--env", "FISH_SM_COMPILE=true", "--env", "FISH_SM_DEFAULT_VOICE=alice", "--poll", 0.01)
    assert "InService" in printed and "endpoint tts-rt created" in printed
    ep = sm.describe_endpoint(EndpointName="tts-rt")
    assert ep["EndpointStatus"] == "InService" and ep["EndpointConfigName"].startswith("tts-rt-")
    variant = _variant(sm, ep["EndpointConfigName"])
    assert variant["InstanceType"] == "ml.g4dn.xlarge" and variant["InitialInstanceCount"] == 2
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1800  # no start measured on a T4
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 130  # a package of a few MB
    assert variant["RoutingConfig"] == {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
    assert variant["InferenceAmiVersion"] == GPU_AMI  # a GPU type: the driver-580 host image by default
    container = sm.describe_model(ModelName=variant["ModelName"])["PrimaryContainer"]
    assert container["Image"] == "123.dkr/fish-sm:1" and container["ModelDataUrl"] == model_data
    assert container["Environment"] == {"SAGEMAKER_CONTAINER_LOG_LEVEL": "20", "FISH_SM_COMPILE": "true",
                                        "FISH_SM_DEFAULT_VOICE": "alice", "SAGEMAKER_ENDPOINT_NAME": "tts-rt",
                                        "FISH_SM_MANIFEST_SHA256": hashlib.sha256(package[1]).hexdigest()}
    rid = "endpoint/tts-rt/variant/AllTraffic"
    target, = aa.describe_scalable_targets(ServiceNamespace="sagemaker", ResourceIds=[rid])["ScalableTargets"]
    assert (target["MinCapacity"], target["MaxCapacity"]) == (2, 4)
    policy, = aa.describe_scaling_policies(ServiceNamespace="sagemaker", ResourceId=rid)["ScalingPolicies"]
    tt = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tt["TargetValue"] == 3.0
    assert tt["PredefinedMetricSpecification"]["PredefinedMetricType"] == \
        "SageMakerVariantConcurrentRequestsPerModelHighResolution"
    alarms = {a["AlarmName"]: a for a in cw.describe_alarms(AlarmNamePrefix="fish-sm/tts-rt/")["MetricAlarms"]}
    assert sorted(alarms) == ["fish-sm/tts-rt/5xx-rate", "fish-sm/tts-rt/first-audio-p99",
                              "fish-sm/tts-rt/invocation-5xx", "fish-sm/tts-rt/rejection-rate"]
    alarm = alarms["fish-sm/tts-rt/invocation-5xx"]
    assert alarm["MetricName"] == "Invocation5XXErrors"
    assert {d["Name"]: d["Value"] for d in alarm["Dimensions"]} == {"EndpointName": "tts-rt", "VariantName": "AllTraffic"}
    assert cw.get_dashboard(DashboardName="fish-sm-tts-rt")["DashboardName"] == "fish-sm-tts-rt"

    # Async on the stock container, scale to zero, SNS topics.
    printed = cli(moto_url, "deploy", "tts-async", "--model-data", model_data, "--role", ROLE, "--stock-container",
                  "--image", DLC,
                  "--instance-type", "ml.g4dn.12xlarge", "--async", "--async-output", "s3://fish-sm-flow/async/out/",
                  "--sns-success", SNS_OK, "--sns-error", SNS_ERR, "--max-concurrent", 2, "--scale-to-zero",
                  "--max", 3, "--poll", 0.01)
    assert "has-backlog-without-capacity" in printed
    config = sm.describe_endpoint_config(EndpointConfigName=sm.describe_endpoint(EndpointName="tts-async")["EndpointConfigName"])
    assert config["AsyncInferenceConfig"] == {
        "OutputConfig": {"S3OutputPath": "s3://fish-sm-flow/async/out/", "S3FailurePath": "s3://fish-sm-flow/async/out-failures/",
                         "NotificationConfig": {"SuccessTopic": SNS_OK, "ErrorTopic": SNS_ERR}},
        "ClientConfig": {"MaxConcurrentInvocationsPerInstance": 2}}
    assert "RoutingConfig" not in config["ProductionVariants"][0]
    env = sm.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])["PrimaryContainer"]["Environment"]
    assert env["SAGEMAKER_PROGRAM"] == "inference.py" and env["SAGEMAKER_SUBMIT_DIRECTORY"] == "/opt/ml/model/code"
    assert env["SAGEMAKER_TS_MIN_WORKERS"] == env["SAGEMAKER_TS_MAX_WORKERS"] == "4"  # 4 GPUs on a g4dn.12xlarge
    assert env["TS_MAX_RESPONSE_SIZE"] == env["TS_MAX_REQUEST_SIZE"] == "104857600"
    assert env["SAGEMAKER_MODEL_SERVER_TIMEOUT"] == env["TS_DEFAULT_STARTUP_TIMEOUT"] == "900"
    rid = "endpoint/tts-async/variant/AllTraffic"
    target, = aa.describe_scalable_targets(ServiceNamespace="sagemaker", ResourceIds=[rid])["ScalableTargets"]
    assert (target["MinCapacity"], target["MaxCapacity"]) == (0, 3)
    policies = {p["PolicyName"]: p for p in aa.describe_scaling_policies(ServiceNamespace="sagemaker", ResourceId=rid)["ScalingPolicies"]}
    assert set(policies) == {"fish-sm-backlog", "fish-sm-wake-from-zero"}
    metric = policies["fish-sm-backlog"]["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
    assert metric["MetricName"] == "ApproximateBacklogSizePerInstance"
    assert metric["Dimensions"] == [{"Name": "EndpointName", "Value": "tts-async"}]
    step = policies["fish-sm-wake-from-zero"]["StepScalingPolicyConfiguration"]
    assert step["StepAdjustments"] == [{"MetricIntervalLowerBound": 0.0, "ScalingAdjustment": 1}]
    wake, = cw.describe_alarms(AlarmNames=["fish-sm/tts-async/has-backlog-without-capacity"])["MetricAlarms"]
    assert wake["MetricName"] == "HasBacklogWithoutCapacity"
    assert wake["AlarmActions"] == [policies["fish-sm-wake-from-zero"]["PolicyARN"]]

    # status, as text and JSON.
    printed = cli(moto_url, "status", "tts-rt")
    assert "tts-rt: InService" in printed and "autoscaling 2-4 instances" in printed and "invocation-5xx" in printed
    s = json.loads(cli(moto_url, "status", "tts-async", "--output", "json"))
    assert json.loads(cli(moto_url, "status", "tts-async", "--json")) == s  # the hidden, deprecated spelling
    assert s["status"] == "InService" and s["instance_type"] == "ml.g4dn.12xlarge"
    assert s["async"]["output"] == "s3://fish-sm-flow/async/out/" and s["async"]["max_concurrent"] == 2
    assert s["autoscaling"]["min"] == 0 and {p["name"] for p in s["autoscaling"]["policies"]} == \
        {"fish-sm-backlog", "fish-sm-wake-from-zero"}
    assert {a["name"] for a in s["alarms"]} == {"fish-sm/tts-async/invocation-5xx", "fish-sm/tts-async/5xx-rate",
                                                 "fish-sm/tts-async/has-backlog-without-capacity"}

    # invoke: real-time, then async with a result and with a failure (moto's queued answers).
    def queue(path, results):
        req = urllib.request.Request(f"{moto_url}/moto-api/static/sagemaker/{path}", method="POST",
                                     data=json.dumps({"results": results}).encode())
        urllib.request.urlopen(req).close()

    queue("endpoint-results", [{"Body": "RIFF-fake-wav", "ContentType": "audio/wav",
                                "InvokedProductionVariant": "AllTraffic", "CustomAttributes": ""}])
    out = tmp_path / "rt.wav"
    printed = cli(moto_url, "invoke", "tts-rt", "--text", "Hello.", "-o", out, "--seed", 1, ok=False)
    assert not out.exists() and "audio/wav, 13 B, starting b'RIFF-fake-wav'" in printed  # not audio: nothing written
    queue("async-endpoint-results", [{"data": "async audio bytes"},
                                     {"is_failure": True, "data": '{"error": "text is too long"}'}])
    out = tmp_path / "async.flac"
    printed = cli(moto_url, "invoke", "tts-async", "--async", "--text", "Hello.", "-o", out, "--poll", 0.01, ok=False)
    assert not out.exists() and "starting b'async audio bytes'" in printed
    uploaded = s3.list_objects_v2(Bucket="fish-sm-flow", Prefix="fish-sm/async-inputs/")["Contents"]
    request = json.loads(s3.get_object(Bucket="fish-sm-flow", Key=uploaded[0]["Key"])["Body"].read())
    assert request == {"text": "Hello.", "format": "flac"}
    printed = cli(moto_url, "invoke", "tts-async", "--async", "--text", "Hello.", "-o", out, "--poll", 0.01, ok=False)
    assert "failed the request: text is too long" in printed
    printed = cli(moto_url, "invoke", "tts-rt", "--async", "--text", "Hi", ok=False)
    assert "is real-time" in printed

    # transform over JSON Lines with the real-time endpoint's model.
    s3.put_object(Bucket="fish-sm-flow", Key="batch/in/requests.jsonl", Body=b'{"text": "One."}\n{"text": "Two."}\n')
    s3.put_object(Bucket="fish-sm-flow", Key="batch/out/requests.jsonl.out", Body=b"{}\n{}\n")  # what SageMaker writes
    s3.put_object(Bucket="fish-sm-flow", Key="batch/out/older-run.jsonl.out", Body=b"{}\n")
    printed = cli(moto_url, "transform", "tts-rt", "--input", "s3://fish-sm-flow/batch/in/",
                  "--output", "s3://fish-sm-flow/batch/out/", "--instances", 2, "--poll", 0.01,
                  "--download", tmp_path / "results")
    assert "Completed: 1 result file(s) for 1 input(s)" in printed
    assert (tmp_path / "results" / "requests.jsonl.out").read_bytes() == b"{}\n{}\n"
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["requests.jsonl.out"]
    assert "batch/out/requests.jsonl.out" in printed and "older-run" not in printed
    job, = [j for j in sm.list_transform_jobs()["TransformJobSummaries"] if j["TransformJobName"].startswith("tts-rt-")]
    desc = sm.describe_transform_job(TransformJobName=job["TransformJobName"])
    assert desc["ModelName"] == variant["ModelName"] and desc["BatchStrategy"] == "SingleRecord"
    assert desc["TransformInput"]["SplitType"] == "Line" and desc["TransformInput"]["ContentType"] == "application/jsonlines"
    assert desc["TransformOutput"] == {"S3OutputPath": "s3://fish-sm-flow/batch/out/", "Accept": "application/jsonlines",
                                       "AssembleWith": "Line"}
    assert desc["TransformResources"] == {"InstanceType": "ml.g4dn.xlarge", "InstanceCount": 2}

    # delete: everything goes, and a second delete says there is nothing left.
    for name in ("tts-rt", "tts-async"):
        printed = cli(moto_url, "delete", name)
        assert f"removed endpoint {name}" in printed and "removed scalable target" in printed
        assert "removed model" in printed and "removed endpoint config" in printed
    assert sm.list_endpoints()["Endpoints"] == []
    assert sm.list_endpoint_configs()["EndpointConfigs"] == []
    assert sm.list_models()["Models"] == []
    assert aa.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"] == []
    assert aa.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"] == []
    assert cw.describe_alarms()["MetricAlarms"] == []
    assert cw.list_dashboards()["DashboardEntries"] == []
    printed = cli(moto_url, "delete", "tts-rt")
    assert printed.startswith("nothing to delete: no endpoint tts-rt")


def test_redeploy_replaces_autoscaling_and_delete_leaves_other_endpoints(moto_url, package):
    """A second endpoint whose name extends the first's is not touched by the first's delete."""
    s3, sm = client(moto_url, "s3"), client(moto_url, "sagemaker")
    aa = client(moto_url, "application-autoscaling")
    s3.create_bucket(Bucket="fish-sm-two")
    s3.put_object(Bucket="fish-sm-two", Key="model.tar.gz", Body=package[0])
    common = ["--model-data", "s3://fish-sm-two/model.tar.gz", "--role", ROLE, "--image", "img",
              "--instance-type", "ml.m5.xlarge", "--poll", 0.01]
    cli(moto_url, "deploy", "voice", *common, "--max", 2, "--metric", "invocations")
    cli(moto_url, "deploy", "voice-2", *common)
    config = sm.describe_endpoint(EndpointName="voice")["EndpointConfigName"]
    assert "InferenceAmiVersion" not in _variant(sm, config)  # a CPU type: no GPU host image
    policy, = aa.describe_scaling_policies(ServiceNamespace="sagemaker",
                                           ResourceId="endpoint/voice/variant/AllTraffic")["ScalingPolicies"]
    assert policy["TargetTrackingScalingPolicyConfiguration"] == {
        "TargetValue": 60.0, "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
        "ScaleInCooldown": 300, "ScaleOutCooldown": 60}
    cli(moto_url, "delete", "voice")
    assert [e["EndpointName"] for e in sm.list_endpoints()["Endpoints"]] == ["voice-2"]
    assert [m["ModelName"].rsplit("-", 1)[0] for m in sm.list_models()["Models"]] == ["voice-2"]
    assert len(sm.list_endpoint_configs()["EndpointConfigs"]) == 1
    printed = cli(moto_url, "delete", "voice-2")
    assert "removed alarm fish-sm/voice-2/invocation-5xx" in printed
    assert sm.list_models()["Models"] == []


def test_default_concurrency_target_follows_the_server(moto_url, package):
    """Our image (batching server) on a GPU model not measured (EC2's T4) or unknown (--gpus): 32 a
    GPU with slots by memory, or half of FISH_SM_MAX_BATCH x GPUs when set, saying so; the
    one-request-per-GPU servers: 2. (moto's SageMaker knows no H100 type: the measured default is
    test_default_target.py's.)"""
    s3, aa = client(moto_url, "s3"), client(moto_url, "application-autoscaling")
    s3.create_bucket(Bucket="fish-sm-targets")
    s3.put_object(Bucket="fish-sm-targets", Key="model.tar.gz", Body=package[0])
    common = ["--model-data", "s3://fish-sm-targets/model.tar.gz", "--role", ROLE, "--max", 3, "--poll", 0.01]
    image = ["--image", "123.dkr/fish-sm:1", "--instance-type", "ml.g4dn.12xlarge"]
    stock = ["--stock-container", "--image", DLC, "--instance-type", "ml.g4dn.12xlarge"]
    not_measured = "`fish-sm capacity` measures one, and --target gives the measured figure"
    cases = [
        ("batching", [*image], 128.0, "(32 requests in flight per engine (4 GPUs): the server sizes its slots by "
                                      f"memory at start (FISH_SM_MAX_BATCH 0); the T4 GPU is not measured: {not_measured})"),
        ("batch-32", [*image, "--env", "FISH_SM_MAX_BATCH=32"], 64.0, "128 slots: 4 GPUs x FISH_SM_MAX_BATCH 32"),
        ("gpus-given", [*image, "--gpus", 2], 64.0,
         f"(2 GPUs): the server sizes its slots by memory at start (FISH_SM_MAX_BATCH 0); the GPU model is unknown "
         f"(--gpus N does not say it): {not_measured}"),
        ("mms-env", [*image, "--env", "FISH_SM_SERVER=mms"], 2.0, "one request at a time per GPU worker"),
        ("stock", stock, 2.0, "one request at a time per GPU worker"),
        ("given", [*image, "--target", 10], 10.0, "(given with --target)"),
    ]
    for name, extra, value, why in cases:
        printed = cli(moto_url, "deploy", name, *common, *extra)
        line, = [ln for ln in printed.splitlines() if ln.startswith("autoscaling target:")]
        assert line.startswith(f"autoscaling target: {value:g} concurrent requests per instance") and why in line, line
        policy, = aa.describe_scaling_policies(ServiceNamespace="sagemaker",
                                               ResourceId=f"endpoint/{name}/variant/AllTraffic")["ScalingPolicies"]
        assert policy["TargetTrackingScalingPolicyConfiguration"]["TargetValue"] == value, name
        cli(moto_url, "delete", name)
    printed = cli(moto_url, "deploy", "bad-batch", *common, *image, "--env", "FISH_SM_MAX_BATCH=lots", ok=False)
    assert printed.strip().splitlines()[-1] == "Error: --env: FISH_SM_MAX_BATCH='lots' is not a valid int"

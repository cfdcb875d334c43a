"""deploy checks what it can before anything is made: the server's settings in --env, the model
data as a fish-sm package, the instance type (EC2) and the image (ECR). Each failure is one line,
exit 1, and leaves nothing behind, which is checked in moto's own state. The options that shape
the resources (AMI version, tags, VPC, KMS, isolation, data capture) are checked in the requests:
in moto where it keeps them, and with botocore's Stubber against the real service models."""

import gzip
import hashlib
import io
import json
import tarfile

import boto3
import pytest
from botocore.config import Config
from botocore.response import StreamingBody
from botocore.stub import Stubber
from click.testing import CliRunner

from fish_sm.aws import AWSError
from fish_sm.aws import deploy as d
from fish_sm.aws.deploy_request import DEFAULT_GPU_AMI, DeployRequest, inference_ami_versions
from fish_sm.aws.package import package_manifest
from fish_sm.aws.s3 import parse_s3_uri
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from fish_sm.errors import InputError
from moto_helpers import moto_server
from package_bytes import package_tarball

pytestmark = pytest.mark.integration

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-checks"
ECR_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/fish-sm:1.0"
KMS = "arn:aws:kms:us-east-1:123456789012:key/0f0e0d0c-0b0a-0908-0706-050403020100"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return package_tarball(tmp_path_factory.mktemp("package"))


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory, package):
    with moto_server(tmp_path_factory) as url:
        s3 = client(url, "s3")
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key="model.tar.gz", Body=package[0])
        ecr = client(url, "ecr")
        ecr.create_repository(repositoryName="fish-sm")
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 2,
                               "digest": "sha256:" + "a" * 64}, "layers": []}
        ecr.put_image(repositoryName="fish-sm", imageManifest=json.dumps(manifest), imageTag="1.0")
        yield url
        ecr.delete_repository(repositoryName="fish-sm", force=True)  # moto's state outlives this server


def client(url, service):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def deploy_args(url, name, *extra, model_data=f"s3://{BUCKET}/model.tar.gz", image=ECR_IMAGE,
                instance_type="ml.g4dn.xlarge"):
    return ["deploy", name, "--model-data", model_data, "--role", ROLE, "--image", image,
            "--instance-type", instance_type, "--poll", "0.01", *map(str, extra), "--endpoint-url", url]


def nothing_made(url, name):
    sm = client(url, "sagemaker")
    assert not [m for m in sm.list_models()["Models"] if m["ModelName"].startswith(name + "-")]
    assert not [c for c in sm.list_endpoint_configs()["EndpointConfigs"]
                if c["EndpointConfigName"].startswith(name + "-")]
    assert not [e for e in sm.list_endpoints()["Endpoints"] if e["EndpointName"] == name]
    assert not client(url, "cloudwatch").describe_alarms(AlarmNamePrefix=f"fish-sm/{name}/")["MetricAlarms"]


def refused(url, name, *extra, **kwargs) -> str:
    """The deploy fails with one 'Error:' line (after click's usage lines for a bad option combination,
    exit 2), and nothing of it exists in moto."""
    result = CliRunner().invoke(main, deploy_args(url, name, *extra, **kwargs))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    if result.exit_code == 2:
        assert lines[0].startswith("Usage: "), result.output
    else:
        assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[-1].startswith("Error: "), result.output
    nothing_made(url, name)
    return lines[-1]


def put(url, key, data: bytes) -> str:
    client(url, "s3").put_object(Bucket=BUCKET, Key=key, Body=data)
    return f"s3://{BUCKET}/{key}"


def tar_gz(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_settings_in_env_are_checked_as_the_server_checks_them(moto_url):
    line = refused(moto_url, "typo", "--env", "FISH_SM_MAX_BACH=3")
    assert line.startswith("Error: --env: unknown setting FISH_SM_MAX_BACH; known: ") and "FISH_SM_MAX_BATCH" in line
    assert refused(moto_url, "quant", "--env", "FISH_SM_QUANTIZE=int4") == \
        "Error: --env: FISH_SM_QUANTIZE='int4': choose one of auto, int8, none"
    assert refused(moto_url, "batch", "--env", "FISH_SM_MAX_BATCH=abc") == \
        "Error: --env: FISH_SM_MAX_BATCH='abc' is not a valid int"
    assert refused(moto_url, "sha", "--env", "FISH_SM_MANIFEST_SHA256=xyz") == \
        "Error: --env: FISH_SM_MANIFEST_SHA256 must be 64 lowercase hex digits"
    assert refused(moto_url, "bench", "--env", "FISH_SM_BENCHMARK_LENGTHS=true").startswith(
        "Error: --env: FISH_SM_BENCHMARK_LENGTHS is for benchmarks only")


def test_model_data_must_be_a_fish_sm_package(moto_url):
    """Through the CLI for a missing object and one that is not gzip; the other reasons straight
    from package_manifest (each CLI run loads botocore's service models again: seconds)."""
    assert refused(moto_url, "missing", model_data=f"s3://{BUCKET}/missing.tar.gz") == \
        f"Error: --model-data s3://{BUCKET}/missing.tar.gz does not exist"
    uri = put(moto_url, "plain.tar.gz", b"just some bytes")
    assert refused(moto_url, "plain", model_data=uri) == \
        f"Error: --model-data {uri} is not a gzip file (model.tar.gz); make it with `fish-sm package`"
    no_files = tar_gz({"manifest.json": b'{"format": 1}'})
    cases = {
        "empty.tar.gz": (b"", "is empty"),
        "notar.tar.gz": (gzip.compress(b"not a tar archive" * 64), "has no manifest.json as its first entry"),
        "later.tar.gz": (tar_gz({"config.json": b"{}", "manifest.json": b"{}"}), "has no manifest.json as its first"),
        "nofiles.tar.gz": (no_files, "its manifest.json is not a fish-sm manifest (no \"files\" table)"),
        "notjson.tar.gz": (tar_gz({"manifest.json": b"\xff not json"}), "is not a fish-sm manifest"),
    }
    aws = AWS(region="us-east-1", endpoint_url=moto_url)
    for key, (data, why) in cases.items():
        uri = put(moto_url, key, data)
        with pytest.raises(InputError) as caught:
            package_manifest(aws, parse_s3_uri(uri))
        assert str(caught.value).startswith(f"--model-data {uri}") and why in str(caught.value), caught.value


def test_instance_type_comes_from_ec2(moto_url):
    assert refused(moto_url, "foo", instance_type="ml.foo.bar") == \
        "Error: --instance-type ml.foo.bar: EC2 knows no instance type foo.bar in us-east-1"
    assert refused(moto_url, "bad", instance_type="g5.xlarge") == \
        "Error: --instance-type must look like ml.g5.xlarge, got 'g5.xlarge'"


def test_missing_ecr_image(moto_url):
    missing_tag = ECR_IMAGE.replace(":1.0", ":2.0")
    assert refused(moto_url, "tag", image=missing_tag) == \
        f"Error: --image {missing_tag}: repository 'fish-sm' has no image with tag '2.0'"
    digest = "123456789012.dkr.ecr.us-east-1.amazonaws.com/fish-sm@sha256:" + "b" * 64
    assert refused(moto_url, "digest", image=digest) == \
        f"Error: --image {digest}: repository 'fish-sm' has no image with digest sha256:{'b' * 64}"
    repo = "123456789012.dkr.ecr.us-east-1.amazonaws.com/nope:1"
    assert refused(moto_url, "repo", image=repo) == \
        f"Error: --image {repo}: no repository 'nope' in ECR account 123456789012, us-east-1"


def test_bad_options_for_the_new_resources(moto_url):
    assert refused(moto_url, "vpc", "--subnets", "subnet-1") == \
        "Error: --subnets and --security-groups go together (the model's VPC): give both or neither"
    assert refused(moto_url, "vpc2", "--subnets", "net-1", "--security-groups", "sg-1").startswith(
        "Error: --subnets: net-1")
    assert refused(moto_url, "tag", "--tags", "novalue").startswith("Error: --tags must be KEY=VALUE")
    assert refused(moto_url, "tag2", "--tags", "aws:x=1").startswith("Error: --tags aws:x: keys starting with 'aws:'")
    assert refused(moto_url, "kms", "--kms-key", "my key").startswith("Error: --kms-key must be a KMS key")
    assert refused(moto_url, "cap", "--data-capture", "s3://cap-bucket/c/", "--data-capture-percent", "0") == \
        "Error: --data-capture-percent must be 1-100, got 0"
    assert refused(moto_url, "cap2", "--data-capture-percent", "5") == \
        "Error: --data-capture-percent only applies with --data-capture s3://..."
    line = refused(moto_url, "ami", "--ami-version", "al2-ami-sagemaker-inference-gpu-9")
    assert line.startswith("Error: --ami-version 'al2-ami-sagemaker-inference-gpu-9': choose one of ") and \
        DEFAULT_GPU_AMI in line


def test_the_options_reach_the_resources_in_moto(moto_url, package):
    """Tags on every resource, the VPC, KMS key, data capture and AMI version, as moto keeps them."""
    result = CliRunner().invoke(main, deploy_args(
        moto_url, "shaped", "--tags", "team=voice", "--tags", "cost-center=42", "--subnets", "subnet-0a,subnet-0b",
        "--security-groups", "sg-0c", "--kms-key", KMS, "--network-isolation", "--data-capture",
        f"s3://{BUCKET}/capture", "--data-capture-percent", 20, "--ami-version", "al2-ami-sagemaker-inference-gpu-3-1",
        "--max", 2, "--output", "json"))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # progress went to stderr: stdout is one object
    assert out["status"] == "InService" and out["gpus"] == 1 and out["action"] == "created"
    assert out["inference_ami_version"] == "al2-ami-sagemaker-inference-gpu-3-1"
    assert out["manifest_sha256"] == hashlib.sha256(package[1]).hexdigest()
    sm = client(moto_url, "sagemaker")
    ep = sm.describe_endpoint(EndpointName="shaped")
    cfg = sm.describe_endpoint_config(EndpointConfigName=ep["EndpointConfigName"])
    model = sm.describe_model(ModelName=cfg["ProductionVariants"][0]["ModelName"])
    assert model["VpcConfig"] == {"Subnets": ["subnet-0a", "subnet-0b"], "SecurityGroupIds": ["sg-0c"]}
    assert cfg["KmsKeyId"] == KMS
    assert cfg["DataCaptureConfig"] == {"EnableCapture": True, "InitialSamplingPercentage": 20,
                                        "DestinationS3Uri": f"s3://{BUCKET}/capture/",
                                        "CaptureOptions": [{"CaptureMode": "Input"}, {"CaptureMode": "Output"}]}
    assert cfg["ProductionVariants"][0]["InferenceAmiVersion"] == "al2-ami-sagemaker-inference-gpu-3-1"
    wanted = {"fish-sm:endpoint": "shaped", "team": "voice", "cost-center": "42"}
    for arn in (ep["EndpointArn"], cfg["EndpointConfigArn"], model["ModelArn"]):
        assert {t["Key"]: t["Value"] for t in sm.list_tags(ResourceArn=arn)["Tags"]} == wanted, arn
    cw = client(moto_url, "cloudwatch")
    alarms = cw.describe_alarms(AlarmNamePrefix="fish-sm/shaped/")["MetricAlarms"]
    assert len(alarms) == 4  # rollback, first audio, 5XX rate, rejection rate
    for alarm in alarms:
        assert {t["Key"]: t["Value"] for t in cw.list_tags_for_resource(ResourceARN=alarm["AlarmArn"])["Tags"]} == wanted
    assert CliRunner().invoke(main, ["delete", "shaped", "--endpoint-url", moto_url]).exit_code == 0


# Through Stubber: what moto drops (EnableNetworkIsolation, the scalable target's tags), and
# InferenceAmiVersion checked in the CreateEndpointConfig request itself.

@pytest.fixture
def stubbed(monkeypatch):
    monkeypatch.setattr(d, "new_stamp", lambda: "20250102030405678")
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    aws = AWS(region="us-east-1")
    aws._session = session
    stubs = {}
    for service in ("sagemaker", "s3", "cloudwatch", "ec2"):
        aws._clients[service] = session.client(service)
        stubs[service] = Stubber(aws._clients[service])
        stubs[service].activate()
    yield aws, stubs
    for s in stubs.values():
        s.deactivate()


def expect_reads(stubs, package, *, ec2_type, gpus):
    stubs["sagemaker"].add_client_error("describe_endpoint", "ValidationException", "Could not find endpoint tts")
    if ec2_type is not None:
        info = {"InstanceType": ec2_type}
        if gpus:
            info["GpuInfo"] = {"Gpus": [{"Name": "A10G", "Manufacturer": "NVIDIA", "Count": gpus}]}
        stubs["ec2"].add_response("describe_instance_types", {"InstanceTypes": [info]}, {"InstanceTypes": [ec2_type]})
    tarball = package[0]
    stubs["s3"].add_response("head_object", {"ContentLength": len(tarball)})
    stubs["s3"].add_response("get_object", {"Body": StreamingBody(io.BytesIO(tarball), len(tarball)),
                                            "ContentLength": len(tarball),
                                            "ContentRange": f"bytes 0-{len(tarball) - 1}/{len(tarball)}"})


def created_requests(aws, stubs, package, req, *, ec2_type, gpus):
    """Run the deploy (no wait) with every call answered; return (CreateModel, CreateEndpointConfig) params."""
    expect_reads(stubs, package, ec2_type=ec2_type, gpus=gpus)
    seen = {}

    def keep(params, model, **_):
        seen[model.name] = dict(params)

    aws.sagemaker.meta.events.register("provide-client-params.sagemaker.*", keep)
    arn = "arn:aws:sagemaker:us-east-1:123456789012:"
    stubs["sagemaker"].add_response("create_model", {"ModelArn": arn + "model/m"})
    stubs["sagemaker"].add_response("create_endpoint_config", {"EndpointConfigArn": arn + "endpoint-config/c"})
    stubs["cloudwatch"].add_response("put_metric_alarm", {})
    stubs["sagemaker"].add_response("create_endpoint", {"EndpointArn": arn + "endpoint/tts"})
    d.deploy(aws, req, wait=False)
    for s in stubs.values():
        s.assert_no_pending_responses()
    return seen["CreateModel"], seen["CreateEndpointConfig"]


def base_request(**overrides):
    fields = dict(name="tts", model_data=parse_s3_uri("s3://models/tts/model.tar.gz"), role=ROLE,
                  instance_type="ml.g5.12xlarge", image="img")
    fields.update(overrides)
    return DeployRequest(**fields)


def test_ami_version_default_override_and_cpu(stubbed, package):
    aws, stubs = stubbed
    assert DEFAULT_GPU_AMI in inference_ami_versions()  # the installed botocore's SageMaker model knows it
    _, cfg = created_requests(aws, stubs, package, base_request(), ec2_type="g5.12xlarge", gpus=4)
    assert cfg["ProductionVariants"][0]["InferenceAmiVersion"] == DEFAULT_GPU_AMI
    _, cfg = created_requests(aws, stubs, package, base_request(ami_version="al2-ami-sagemaker-inference-gpu-3-1"),
                              ec2_type="g5.12xlarge", gpus=4)
    assert cfg["ProductionVariants"][0]["InferenceAmiVersion"] == "al2-ami-sagemaker-inference-gpu-3-1"
    _, cfg = created_requests(aws, stubs, package, base_request(ami_version="none"), ec2_type="g5.12xlarge", gpus=4)
    assert "InferenceAmiVersion" not in cfg["ProductionVariants"][0]
    _, cfg = created_requests(aws, stubs, package, base_request(instance_type="ml.m5.xlarge"),
                              ec2_type="m5.xlarge", gpus=0)
    assert "InferenceAmiVersion" not in cfg["ProductionVariants"][0]  # a CPU type


@pytest.fixture(scope="module")
def vendored_package(tmp_path_factory):
    return package_tarball(tmp_path_factory.mktemp("vendored"), vendored=True)


def test_network_isolation_vpc_kms_capture_and_gpus_given(stubbed, vendored_package):
    """--gpus skips EC2 (no DescribeInstanceTypes is answered here); the rest reach the create requests.
    The stock package carries its dependencies (code/lib), as one under network isolation must."""
    package = vendored_package
    aws, stubs = stubbed
    from fish_sm.aws.deploy_request import DataCapture

    req = base_request(gpus=2, network_isolation=True, subnets=("subnet-1",), security_groups=("sg-1",),
                       kms_key=KMS, tags={"team": "voice"}, stock_container=True,
                       data_capture=DataCapture(parse_s3_uri("s3://cap-bucket/cap/", prefix=True), 5))
    model, cfg = created_requests(aws, stubs, package, req, ec2_type=None, gpus=None)
    assert model["EnableNetworkIsolation"] is True
    assert model["VpcConfig"] == {"Subnets": ["subnet-1"], "SecurityGroupIds": ["sg-1"]}
    assert model["Tags"] == [{"Key": "fish-sm:endpoint", "Value": "tts"}, {"Key": "team", "Value": "voice"}]
    assert model["PrimaryContainer"]["Environment"]["SAGEMAKER_TS_MIN_WORKERS"] == "2"  # from --gpus
    assert cfg["KmsKeyId"] == KMS and cfg["DataCaptureConfig"]["InitialSamplingPercentage"] == 5
    assert cfg["Tags"] == model["Tags"]


def test_ec2_denied_says_so_and_points_at_gpus(stubbed):
    aws, stubs = stubbed
    stubs["sagemaker"].add_client_error("describe_endpoint", "ValidationException", "Could not find endpoint tts")
    stubs["ec2"].add_client_error("describe_instance_types", "UnauthorizedOperation",
                                  "You are not authorized to perform this operation.")
    with pytest.raises(AWSError, match=r"^cannot look up ml.g5.12xlarge's GPUs: ec2:DescribeInstanceTypes is denied "
                                       r"to these credentials; pass --gpus N$"):
        d.deploy(aws, base_request(), wait=False)


def test_an_unknown_ami_version_is_refused_before_any_call(stubbed):
    aws, _ = stubbed
    with pytest.raises(InputError, match="--ami-version 'gpu-5': choose one of"):
        d.deploy(aws, base_request(ami_version="gpu-5"), wait=False)


def test_a_stock_package_that_pip_installs_at_start_is_refused_under_network_isolation(moto_url):
    line = refused(moto_url, "isolated", "--stock-container", "--network-isolation")
    assert line == (f"Error: --model-data s3://{BUCKET}/model.tar.gz installs code/requirements.txt with pip when "
                    "the stock container starts, which --network-isolation forbids; build it with `fish-sm package "
                    "--stock-container` to carry its dependencies")


def test_a_vendored_stock_package_starts_offline_and_a_vpc_gets_a_note():
    from types import SimpleNamespace

    notes = []
    with_pip = {"files": {"code/requirements.txt": {}, "code/inference.py": {}}}
    vendored = {"files": {"code/lib/soundfile.py": {}, "code/inference.py": {}}, "vendored": ["soundfile"]}
    isolated = SimpleNamespace(network_isolation=True, subnets=(), model_data="s3://b/model.tar.gz")
    d.check_offline_start(vendored, isolated, notes.append)
    in_vpc = SimpleNamespace(network_isolation=False, subnets=("subnet-1",), model_data="s3://b/model.tar.gz")
    d.check_offline_start(vendored, in_vpc, notes.append)
    assert notes == []
    d.check_offline_start(with_pip, in_vpc, notes.append)
    assert len(notes) == 1 and "NAT gateway" in notes[0]

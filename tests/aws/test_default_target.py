"""deploy's default concurrency target from the measured capacity of the instance's GPU model:
EC2's GPU names and counts (moto ships EC2's instance type catalogue), the default for a
measured GPU (H100), an unmeasured one (A10G) and an unknown one (--gpus), and the reason deploy
prints, through deploy() with botocore's Stubber (moto's SageMaker knows no g5 or p5 type)."""

import pytest

from fish_sm.aws.autoscaling import CAPACITY_HEADROOM, default_target, make_autoscaling
from fish_sm.aws.capacity import H100_STREAMS_PER_GPU, H200_STREAMS_PER_GPU, measured_capacity
from fish_sm.aws.deploy_request import DeployRequest
from fish_sm.aws.instances import GPUs, instance_hardware
from fish_sm.aws.s3 import parse_s3_uri
from fish_sm.aws.session import AWS
from moto_helpers import moto_server
from package_bytes import package_tarball
from stubbed_deploy import deploy_until_stopped, stub_checks, stubbed_aws

ROLE = "arn:aws:iam::123456789012:role/fish-sm"
NOT_MEASURED = "`fish-sm capacity` measures one, and --target gives the measured figure"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return package_tarball(tmp_path_factory.mktemp("package"))


@pytest.mark.integration
def test_ec2_names_the_gpu_model_and_count(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        aws = AWS(region="us-east-1", endpoint_url=url)
        assert instance_hardware(aws, "ml.p5.48xlarge") == GPUs(8, "H100")
        assert instance_hardware(aws, "ml.g5.xlarge") == GPUs(1, "A10G")
        assert instance_hardware(aws, "ml.g6e.12xlarge") == GPUs(4, "L40S")
        assert instance_hardware(aws, "ml.m5.xlarge") == GPUs(0, None)


def test_default_target_per_gpu_model():
    assert measured_capacity("h100").streams_per_gpu == H100_STREAMS_PER_GPU and measured_capacity("A10G") is None
    assert measured_capacity("H200").streams_per_gpu == H200_STREAMS_PER_GPU
    # Measured: 70% of the requests in flight at capacity (slots by memory), at most FISH_SM_MAX_BATCH when set.
    value, why = default_target("concurrency", gpus=8, gpu_model="H100")
    assert value == pytest.approx(8 * H100_STREAMS_PER_GPU * CAPACITY_HEADROOM)
    assert why.startswith("70% of 8 H100s x 256 requests in flight at the measured capacity: 256 real-time streams "
                          "per H100 under the SLO (nvidia-h100-x1, 2026-11-26")
    value, why = default_target("concurrency", gpus=8, gpu_model="H100", env={"FISH_SM_MAX_BATCH": "64"})
    assert value == pytest.approx(8 * 64 * CAPACITY_HEADROOM) and "FISH_SM_MAX_BATCH 64 decoding at once" in why
    # Not measured, or unknown: a fixed share of the slots (or, slots by memory, 32 a GPU), saying why.
    assert default_target("concurrency", gpus=1, gpu_model="A10G") == (
        32.0, "32 requests in flight per engine (1 GPU): the server sizes its slots by memory at start "
              f"(FISH_SM_MAX_BATCH 0); the A10G GPU is not measured: {NOT_MEASURED}")
    assert default_target("concurrency", gpus=1, gpu_model="A10G", env={"FISH_SM_MAX_BATCH": "64"}) == (
        32.0, f"50% of the batching server's 64 slots: 1 GPU x FISH_SM_MAX_BATCH 64; the A10G GPU is not measured: "
              f"{NOT_MEASURED}")
    value, why = default_target("concurrency", gpus=2, gpu_model=None)
    assert value == 64.0 and "the GPU model is unknown (--gpus N does not say it)" in why
    assert default_target("concurrency", gpus=8, gpu_model="H100", stock_container=True)[0] == 2.0  # one at a time
    assert default_target("invocations", gpus=8, gpu_model="H100")[0] == 60.0


def _stub_checks(stubs, package, ec2_type, gpus):
    stub_checks(stubs, package[0], ec2_type, gpus.model, gpus.count)
    # The target is worked out and printed before anything is made; stop at the first creation.
    stubs["sagemaker"].add_client_error("create_model", "ThrottlingException", "stop here")


@pytest.mark.parametrize("instance_type, gpus, line", [
    ("ml.p5.48xlarge", GPUs(8, "H100"),
     "autoscaling target: 1433.6 concurrent requests per instance (70% of 8 H100s x 256 requests in flight at the "
     "measured capacity: 256 real-time streams per H100 under the SLO (nvidia-h100-x1, 2026-11-26, "
     "docs/benchmarks.md \"Issue 35\"), in flight at most the measured streams; headroom for traffic while a new "
     "instance starts)"),
    ("ml.g5.xlarge", GPUs(1, "A10G"),
     "autoscaling target: 32 concurrent requests per instance (32 requests in flight per engine (1 GPU): the server "
     f"sizes its slots by memory at start (FISH_SM_MAX_BATCH 0); the A10G GPU is not measured: {NOT_MEASURED})"),
])
def test_deploy_prints_the_target_and_why(package, instance_type, gpus, line):
    aws, stubs = stubbed_aws()
    _stub_checks(stubs, package, instance_type.removeprefix("ml."), gpus)
    scaling = make_autoscaling(instances=1, min_instances=None, max_instances=4, target=None, metric="concurrency",
                               is_async=False, scale_to_zero=False)
    req = DeployRequest(name="tts", model_data=parse_s3_uri("s3://models/model.tar.gz"), role=ROLE,
                        instance_type=instance_type, image="registry.example/fish-sm:1", autoscaling=scaling)
    lines = deploy_until_stopped(aws, stubs, req)
    assert line in lines, lines

"""deploy's start-up and download timeouts: twice the start measured on the instance's GPU model
(with the package's compile cache when it was built on that model) plus two minutes, 1800 s where
nothing is measured; the download from the package's size; a flag given wins. Through deploy()
with botocore's Stubber, up to the endpoint config it asks for."""

import dataclasses
from unittest import mock
from unittest.mock import ANY

import pytest

from fish_sm.aws.deploy_request import DeployRequest
from fish_sm.aws.s3 import parse_s3_uri
from fish_sm.aws.startup import MEASURED_STARTS, cache_fits, deploy_timeouts, download_timeout, startup_timeout
from fish_sm.errors import InputError
from package_bytes import package_tarball
from stubbed_deploy import deploy_until_stopped, stub_checks, stubbed_aws

ROLE = "arn:aws:iam::123456789012:role/fish-sm"
H100_CACHE = {"torch": "2.11.0+cu130", "device_type": "cuda", "gpu_arch": "sm_90", "gpu_name": "NVIDIA H100 80GB HBM3"}


def test_the_start_up_timeout_follows_the_measured_start():
    h100, h200 = MEASURED_STARTS["H100"], MEASURED_STARTS["H200"]
    assert (h100.cold_s, h100.cached_s, h200.cold_s, h200.cached_s) == (219.3, 98.2, 110.4, 44.1)
    assert startup_timeout("H200", cached=False)[0] == 350  # 2 x 110.4 + 120 = 340.8, up to 10 s
    assert startup_timeout("h100", cached=True)[0] == 320  # 2 x 98.2 + 120
    assert startup_timeout("H100", cached=False)[0] == 560
    value, why = startup_timeout("H200", cached=True)
    assert value == 210 and why == ("2 x the 44.1 s a H200 start took with its compile cache (nvidia-h200 (one H200), "
                                    "2026-11-29) + 120 s")
    no_cache = dataclasses.replace(MEASURED_STARTS["H200"], cached_s=None)  # none measured with a cache: the cold one
    with mock.patch.dict(MEASURED_STARTS, {"H200": no_cache}):
        assert startup_timeout("H200", cached=True) == (
            350, "2 x the 110.4 s a H200 start took cold (nvidia-h200 (one H200), 2026-11-29) + 120 s")
    assert startup_timeout("A10G", cached=True) == (1800, "no start measured on A10G (benchmarks/ping_time.py measures one)")
    assert startup_timeout(None, cached=False) == (1800, "the GPU model is unknown (benchmarks/ping_time.py measures one)")
    assert startup_timeout("H100", cached=True, stock_container=True) == (1800, "the stock container's start is not measured")


def test_a_compile_cache_counts_on_the_gpu_model_it_was_built_on():
    assert cache_fits({"compile_cache": H100_CACHE}, "H100")
    assert not cache_fits({"compile_cache": {**H100_CACHE, "gpu_name": "NVIDIA H200"}}, "H100")
    assert not cache_fits({"compile_cache": None}, "H100") and not cache_fits(None, "H100")
    assert not cache_fits({"compile_cache": H100_CACHE}, None)


def test_the_download_timeout_follows_the_package_s_size():
    assert download_timeout(3_600_000_000) == (410, "3.60 GB at 25 MB/s, x 2 + 120 s")  # 2 x 144 + 120 = 408
    assert download_timeout(1000)[0] == 130
    assert download_timeout(100_000_000_000)[0] == 3600  # SageMaker's most
    assert download_timeout(None) == (1800, "the package's size is unknown")
    both = deploy_timeouts("H100", manifest={"compile_cache": H100_CACHE}, package_bytes=3_600_000_000)
    assert (both.startup, both.download) == (320, 410)


@pytest.mark.parametrize("ec2_type, gpu_model, cache, flags, startup, line", [
    ("p5.48xlarge", "H100", H100_CACHE, {}, 320,
     "timeouts: start-up 320 s (2 x the 98.2 s a H100 start took with its compile cache (nvidia-h100-x1, 2026-11-26) "
     "+ 120 s); download 130 s (0.00 GB at 25 MB/s, x 2 + 120 s)"),
    ("p5en.48xlarge", "H200", H100_CACHE, {}, 350,  # the H100's cache is compiled afresh on an H200
     "timeouts: start-up 350 s (2 x the 110.4 s a H200 start took cold (nvidia-h200 (one H200), 2026-11-29) + 120 s); "
     "download 130 s (0.00 GB at 25 MB/s, x 2 + 120 s)"),
    ("g5.xlarge", "A10G", None, {}, 1800,
     "timeouts: start-up 1800 s (no start measured on A10G (benchmarks/ping_time.py measures one)); "
     "download 130 s (0.00 GB at 25 MB/s, x 2 + 120 s)"),
    ("p5.48xlarge", "H100", None, {"startup_timeout": 900, "download_timeout": 600}, 900,
     "timeouts: start-up 900 s (--startup-timeout); download 600 s (--download-timeout)"),
])
def test_deploy_asks_for_the_derived_timeouts(tmp_path, ec2_type, gpu_model, cache, flags, startup, line):
    aws, stubs = stubbed_aws()
    tarball = package_tarball(tmp_path, compile_cache=cache)[0]
    stub_checks(stubs, tarball, ec2_type, gpu_model, 8 if ec2_type.startswith("p5") else 1)
    download = flags.get("download_timeout", 130)
    stubs["sagemaker"].add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:123456789012:model/tts"})
    variant = {"VariantName": "AllTraffic", "ModelName": ANY, "InitialInstanceCount": 1, "InstanceType": f"ml.{ec2_type}",
               "ContainerStartupHealthCheckTimeoutInSeconds": startup, "ModelDataDownloadTimeoutInSeconds": download,
               "InferenceAmiVersion": ANY, "RoutingConfig": ANY}
    # The endpoint config is refused once its parameters are checked: deploy stops there.
    stubs["sagemaker"].add_client_error("create_endpoint_config", "ThrottlingException", "stop here", expected_params={
        "EndpointConfigName": ANY, "ProductionVariants": [variant], "Tags": ANY})
    stubs["sagemaker"].add_response("delete_model", {}, {"ModelName": ANY})
    req = DeployRequest(name="tts", model_data=parse_s3_uri("s3://models/model.tar.gz"), role=ROLE,
                        instance_type=f"ml.{ec2_type}", image="registry.example/fish-sm:1", **flags)
    lines = deploy_until_stopped(aws, stubs, req)
    assert line in lines, lines


def test_a_timeout_outside_sagemaker_s_bounds_is_refused():
    req = DeployRequest(name="tts", model_data=parse_s3_uri("s3://models/model.tar.gz"), role=ROLE,
                        instance_type="ml.p5.48xlarge", image="registry.example/fish-sm:1", startup_timeout=30)
    with pytest.raises(InputError, match="the startup timeout must be 60-3600 s, got 30"):
        req.validate()

"""deploy() against botocore's Stubber, up to its first creation: the checks it makes before
anything is made (the endpoint, the instance type's GPUs, the package's manifest), for the
tests of what deploy derives from them (moto's SageMaker knows no g5 or p5 type)."""

import io

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from fish_sm.aws.session import AWS


def stubbed_aws(services=("sagemaker", "s3", "ec2")) -> tuple[AWS, dict[str, Stubber]]:
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    aws = AWS(region="us-east-1")
    aws._session = session
    stubs = {}
    for service in services:
        aws._clients[service] = client = session.client(service)
        stubs[service] = Stubber(client)
        stubs[service].activate()
    return aws, stubs


def stub_checks(stubs, tarball: bytes, ec2_type: str, gpu_model: str, gpus: int, name: str = "tts") -> None:
    """A new endpoint `name` on `ec2_type` (`gpus` of `gpu_model`), its package s3://models/model.tar.gz."""
    stubs["sagemaker"].add_client_error("describe_endpoint", "ValidationException",
                                        f'Could not find endpoint "{name}".', expected_params={"EndpointName": name})
    stubs["ec2"].add_response("describe_instance_types", {"InstanceTypes": [{"InstanceType": ec2_type, "GpuInfo": {
        "Gpus": [{"Name": gpu_model, "Manufacturer": "NVIDIA", "Count": gpus}]}}]},
        {"InstanceTypes": [ec2_type]})
    stubs["s3"].add_response("head_object", {"ContentLength": len(tarball)}, {"Bucket": "models", "Key": "model.tar.gz"})
    stubs["s3"].add_response("get_object", {"Body": StreamingBody(io.BytesIO(tarball), len(tarball)),
                                            "ContentLength": len(tarball),
                                            "ContentRange": f"bytes 0-{len(tarball) - 1}/{len(tarball)}"},
                             {"Bucket": "models", "Key": "model.tar.gz", "Range": "bytes=0-65535"})


def deploy_until_stopped(aws: AWS, stubs: dict[str, Stubber], req) -> list[str]:
    """deploy() up to the stub that refuses with "stop here"; the lines it said, every stub used."""
    from fish_sm.aws.deploy import deploy

    lines = []
    with pytest.raises(Exception, match="stop here"):
        deploy(aws, req, poll_s=0, log=lines.append)
    for s in stubs.values():
        s.assert_no_pending_responses()
    return lines

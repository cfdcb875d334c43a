"""`fish-sm adapters list|add|remove` and the adapter source `deploy` sets, end to end against moto's
standalone server: a real package with a packaged adapter, deployed; adapters added to its source
(checked against the base first, uploaded with their sha256), listed, refused, removed."""

import hashlib
import json

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from click.testing import CliRunner

from fish_sm.aws import AWSError
from fish_sm.aws.adapters import _s3, base_config, endpoint_model
from fish_sm.aws.s3 import S3Uri
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from moto_helpers import moto_server

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-adapters"
DEPLOY = ("--role", ROLE, "--image", "123.dkr/fish-sm:1", "--instance-type", "ml.g4dn.xlarge", "--gpus", 1,
          "--poll", 0.01, "--no-alarms", "--no-dashboard")
ENDPOINTS = ("tts", "tts-plain")


def cli(url, *args, ok=True):
    result = CliRunner().invoke(main, [*map(str, args), "--endpoint-url", url])
    assert "Traceback" not in result.output, result.output
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines()[-1].startswith("Error: "), result.output
    return result.output


def s3(url):
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(scope="module")
def fine_tunes(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("fine-tunes")
    for name, seed, rank in (("yasuo", 1, 8), ("ahri", 2, 4)):
        CliRunner().invoke(main, ["make-adapter", str(root / f"{name}.ckpt"), "--checkpoint", str(tiny_checkpoint),
                                  "--seed", str(seed), "--rank", str(rank)], catch_exceptions=False)
    return root


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory, tiny_checkpoint, fine_tunes):
    """moto with endpoint tts serving a package that holds adapter yasuo, deployed with the default
    adapter source, and tts-plain deployed with none."""
    with moto_server(tmp_path_factory) as url:
        s3(url).create_bucket(Bucket=BUCKET)
        out = tmp_path_factory.mktemp("package") / "model.tar.gz"
        cli(url, "package", tiny_checkpoint, "-o", out, "--adapter", f"yasuo={fine_tunes / 'yasuo.ckpt'}",
            "--upload", f"s3://{BUCKET}/models/v1/")
        model_data = f"s3://{BUCKET}/models/v1/model.tar.gz"
        printed = cli(url, "deploy", "tts", "--model-data", model_data, *DEPLOY)
        assert f"adapter source: s3://{BUCKET}/models/v1/adapters/tts/" in printed
        cli(url, "deploy", "tts-plain", "--model-data", model_data, "--adapter-source", "none", *DEPLOY)
        yield url
        for name in ENDPOINTS:  # moto's state outlives this server: leave none behind
            CliRunner().invoke(main, ["delete", name, "--endpoint-url", url])


def test_deploy_sets_the_adapter_source(moto_url):
    sm = boto3.client("sagemaker", endpoint_url=moto_url, region_name="us-east-1")

    def env(name):
        config = sm.describe_endpoint(EndpointName=name)["EndpointConfigName"]
        model = sm.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"][0]["ModelName"]
        return sm.describe_model(ModelName=model)["PrimaryContainer"]["Environment"]

    assert env("tts")["FISH_SM_ADAPTER_SOURCES"] == f"s3://{BUCKET}/models/v1/adapters/tts/"
    assert "FISH_SM_ADAPTER_SOURCES" not in env("tts-plain")


def test_add_list_remove(moto_url, fine_tunes, tmp_path):
    printed = cli(moto_url, "adapters", "add", "tts", f"ahri={fine_tunes / 'ahri.ckpt'}", "--lora-alpha", 8)
    key = "models/v1/adapters/tts/ahri.safetensors"
    assert "added adapter ahri (rank 4, alpha 8" in printed and f"s3://{BUCKET}/{key}" in printed
    obj = s3(moto_url).get_object(Bucket=BUCKET, Key=key)
    body = obj["Body"].read()
    assert obj["Metadata"] == {"sha256": hashlib.sha256(body).hexdigest(), "rank": "4", "alpha": "8.0"}

    doc = json.loads(cli(moto_url, "adapters", "list", "tts", "--json"))
    assert doc["sources"] == [f"s3://{BUCKET}/models/v1/adapters/tts/"]
    assert [(a["name"], a["where"], a["rank"], a["alpha"]) for a in doc["adapters"]] == [
        ("yasuo", "package", 8, 16.0), ("ahri", f"s3://{BUCKET}/{key}", 4, 8.0)]
    assert doc["adapters"][1]["bytes"] == len(body)

    # What the server reads: fish-sm's packaged form, checked against the base, whose config an older
    # package's manifest lacks: then it is read from the tarball, streamed up to config.json.
    from fish_sm.model.config import ModelConfig
    from fish_sm.model.lora import read_packaged

    local = tmp_path / "ahri.safetensors"
    local.write_bytes(body)
    aws = AWS(region="us-east-1", endpoint_url=moto_url)
    config = ModelConfig.from_dict(base_config(aws, endpoint_model(aws, "tts"), {}))
    assert read_packaged(local, "ahri", config).rank == 4

    # Refused, each in one line, and nothing uploaded: a name taken, a bad file, a packaged name.
    assert "adapter ahri exists already" in cli(moto_url, "adapters", "add", "tts", f"ahri={fine_tunes / 'ahri.ckpt'}",
                                                ok=False)
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a torch file")
    assert "cannot read the file" in cli(moto_url, "adapters", "add", "tts", f"other={bad}", ok=False)
    assert "adapter yasuo is packaged" in cli(moto_url, "adapters", "add", "tts",
                                              f"yasuo={fine_tunes / 'ahri.ckpt'}", ok=False)
    keys = [o["Key"] for o in s3(moto_url).list_objects_v2(Bucket=BUCKET, Prefix="models/v1/adapters/")["Contents"]]
    assert keys == [key]

    printed = cli(moto_url, "adapters", "remove", "tts", "ahri")
    assert f"removed s3://{BUCKET}/{key}" in printed and "within a minute" in printed
    assert "Contents" not in s3(moto_url).list_objects_v2(Bucket=BUCKET, Prefix="models/v1/adapters/")
    assert "build a package without it" in cli(moto_url, "adapters", "remove", "tts", "yasuo", ok=False)
    assert "has no adapter ahri" in cli(moto_url, "adapters", "remove", "tts", "ahri", ok=False)


def test_errors_are_one_line(moto_url, fine_tunes):
    assert "endpoint 'gone' does not exist" in cli(moto_url, "adapters", "list", "gone", ok=False)
    assert "has no adapter source" in cli(moto_url, "adapters", "add", "tts-plain",
                                          f"ahri={fine_tunes / 'ahri.ckpt'}", ok=False)
    assert "adapter name" in cli(moto_url, "adapters", "remove", "tts", "../x", ok=False)
    table = cli(moto_url, "adapters", "list", "tts-plain")
    assert "adapter source: none" in table and "yasuo" in table


def test_access_denied_names_what_was_refused():
    uri = S3Uri(BUCKET, "models/v1/adapters/tts/ahri.safetensors")

    def denied():
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "HeadObject")

    with pytest.raises(AWSError, match=f"^no access to read s3://{BUCKET}/models/v1/adapters/tts/ahri.safetensors "
                                       "with these credentials$"):
        _s3(denied, "read", uri)


def test_deploy_adapter_source_choices():
    """--adapter-source: auto (beside the package when it holds adapters, else none), default
    (beside the package), none, a prefix; the user's --env wins; not with --network-isolation,
    which keeps the container off S3."""
    from fish_sm.aws.deploy import adapter_environment
    from fish_sm.aws.deploy_request import DeployRequest
    from fish_sm.aws.s3 import parse_s3_uri
    from fish_sm.errors import InputError

    def request(**fields):
        fields = {"model_data": parse_s3_uri("s3://models/v2/model.tar.gz"), **fields}
        return DeployRequest(name="tts", role=ROLE, instance_type="ml.g6e.xlarge", image="img", **fields)

    notes = []
    assert adapter_environment(request(), packaged_adapters=True) == {
        "FISH_SM_ADAPTER_SOURCES": "s3://models/v2/adapters/tts/"}
    assert adapter_environment(request(), notes.append, packaged_adapters=False) == {}
    assert "none packaged" in notes.pop()
    assert adapter_environment(request(adapter_source="default")) == {
        "FISH_SM_ADAPTER_SOURCES": "s3://models/v2/adapters/tts/"}
    top = request(model_data=parse_s3_uri("s3://models/model.tar.gz"), adapter_source="default")
    assert adapter_environment(top) == {"FISH_SM_ADAPTER_SOURCES": "s3://models/adapters/tts/"}
    assert adapter_environment(request(adapter_source="s3://loras/team-a")) == {
        "FISH_SM_ADAPTER_SOURCES": "s3://loras/team-a/"}
    assert adapter_environment(request(adapter_source="none")) == {}
    assert adapter_environment(request(env={"FISH_SM_ADAPTER_SOURCES": "s3://x/y/"})) == {}
    assert adapter_environment(request(network_isolation=True), notes.append, packaged_adapters=True) == {}
    assert "--network-isolation" in notes[0]
    with pytest.raises(InputError, match="give the adapter source once"):
        adapter_environment(request(adapter_source="s3://a/b/", env={"FISH_SM_ADAPTER_SOURCES": "s3://x/y/"}))
    with pytest.raises(InputError, match="--network-isolation cuts"):
        adapter_environment(request(adapter_source="s3://a/b/", network_isolation=True))
    with pytest.raises(InputError, match="--adapter-source"):
        request(adapter_source="http://nope").validate()

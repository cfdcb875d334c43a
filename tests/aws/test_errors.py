"""Bad input and failures on the AWS side: one line starting with 'Error:', exit 1, never a traceback."""

import pytest
from click.testing import CliRunner
from moto.sagemaker import models as sagemaker_models

import boto3
from botocore.config import Config

from moto_helpers import moto_server
from package_bytes import package_tarball
from fish_sm.cli import main

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        s3 = boto3.client("s3", endpoint_url=url, config=Config(s3={"addressing_style": "path"}))
        s3.create_bucket(Bucket="fish-sm-errors")
        s3.put_object(Bucket="fish-sm-errors", Key="model.tar.gz",
                      Body=package_tarball(tmp_path_factory.mktemp("package"))[0])
        yield url


def fails(args, *expected):
    """Run the command; it must fail with one 'Error:' line containing each expected string."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code in (1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: "), result.output
    for text in expected:
        assert text in last, result.output
    return result.output


DEPLOY = ["deploy", "tts", "--model-data", "s3://fish-sm-errors/model.tar.gz", "--role", ROLE, "--image", "img",
          "--instance-type", "ml.m5.xlarge", "--poll", "0.01"]


def test_bad_s3_uris(moto_url, tmp_path):
    ep = ["--endpoint-url", moto_url]
    fails(["package", tmp_path, "--upload", "bucket/prefix/", *ep], "--upload must look like s3://bucket/key")
    fails(["package", tmp_path, "--upload", "s3://Bad_Bucket/x/", *ep], "not a valid bucket name")
    fails([*DEPLOY[:3], "https://example.com/model.tar.gz", *DEPLOY[4:], *ep], "--model-data must look like s3://")
    fails([*DEPLOY[:3], "s3://fish-sm-errors/models/", *DEPLOY[4:], *ep], "must name an object")
    fails([*DEPLOY[:3], "s3://fish-sm-errors/missing.tar.gz", *DEPLOY[4:], *ep], "does not exist")
    fails([*DEPLOY, "--async", "--async-output", "fish-sm-errors/out", *ep], "--async-output must look like s3://")
    fails(["transform", "tts", "--input", "s3:/x", "--output", "s3://fish-sm-errors/o/", *ep], "--input must look like")
    pkg = tmp_path / "pkg"
    (pkg / "code").mkdir(parents=True)
    (pkg / "manifest.json").write_text("{}")
    fails(["package", pkg, "-o", tmp_path / "m.tar.gz", "--upload", "s3://no-such-bucket/models/", *ep],
          "bucket 'no-such-bucket' of s3://no-such-bucket/models/ does not exist")
    assert not (tmp_path / "m.tar.gz").exists()  # refused before archiving
    fails(["package", pkg, "--upload", "s3://fish-sm-errors/models/", "--part-size", "1", *ep], "Invalid value for '--part-size'")


def test_bad_deploy_options(moto_url):
    ep = ["--endpoint-url", moto_url]
    fails([*DEPLOY, "--env", "NOVALUE", *ep], "--env must be KEY=VALUE")
    fails([*DEPLOY, "--env", "1ABC=x", *ep], "not a valid variable name")
    fails([*DEPLOY, "--env", "A-B=x", *ep], "not a valid variable name")
    fails([*DEPLOY[:5], "not-an-arn", *DEPLOY[6:], *ep], "--role must be an IAM role ARN")
    fails(["deploy", "tts", "--model-data", "s3://fish-sm-errors/model.tar.gz", "--role", ROLE, *ep],
          "--image URI", "--stock-container")
    fails([*DEPLOY, "--scale-to-zero", *ep], "only apply with --async")
    fails([*DEPLOY, "--async", *ep], "--async needs --async-output")
    fails([*DEPLOY, "--max", "0", *ep], "--max (0) must be at least")
    fails([*DEPLOY, "--target", "3", *ep], "autoscaling needs --max")
    fails([*DEPLOY, "--max", "3", "--no-wait", *ep], "leave out --no-wait")
    fails([*DEPLOY, "--async", "--async-output", "s3://fish-sm-errors/o/", "--sns-success", "topic", *ep],
          "SNS topic ARN")
    fails(["deploy", "bad_name", *DEPLOY[2:], *ep], "endpoint name 'bad_name'")
    fails(["deploy", "x" * 50, *DEPLOY[2:], *ep], "at most 45")


def test_nonexistent_endpoint(moto_url, tmp_path):
    ep = ["--endpoint-url", moto_url]
    fails(["status", "no-such-endpoint", *ep], "endpoint 'no-such-endpoint' does not exist in us-east-1")
    fails(["invoke", "no-such-endpoint", "--text", "Hi.", "-o", tmp_path / "x.wav", *ep], "does not exist")
    fails(["invoke", "no-such-endpoint", "--async", "--text", "Hi.", *ep], "does not exist")
    fails(["bench", "no-such-endpoint", "--requests", "1", "-o", tmp_path, *ep], "does not exist")
    fails(["transform", "no-such-endpoint", "--input", "s3://fish-sm-errors/in/", "--output",
           "s3://fish-sm-errors/out/", *ep], "no endpoint or model named 'no-such-endpoint'")
    assert not (tmp_path / "x.wav").exists()


def test_failed_endpoint_shows_failure_reason(moto_url, monkeypatch):
    """moto's endpoints are born InService; this one is born Failed, as a bad image makes it on AWS."""
    original = sagemaker_models.FakeEndpoint.__init__

    def born_failed(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.endpoint_name == "broken":
            self.endpoint_status = "Failed"
            self.failure_reason = "The primary container for production variant AllTraffic did not pass the ping health check."

    monkeypatch.setattr(sagemaker_models.FakeEndpoint, "__init__", born_failed)
    ep = ["--endpoint-url", moto_url]
    out = fails(["deploy", "broken", *DEPLOY[2:], *ep], "endpoint broken is Failed: The primary container", "ping health check")
    assert "[00:00] broken: Failed" in out  # the progress line came first
    status = CliRunner().invoke(main, ["status", "broken", *ep])
    assert status.exit_code == 0 and "broken: Failed (The primary container" in status.output
    # A new deploy over a failed endpoint is refused with what to do.
    fails(["deploy", "broken", *DEPLOY[2:], *ep], "is Failed", "fish-sm delete broken")
    fails(["invoke", "broken", "--text", "Hi.", *ep], "endpoint broken is Failed")
    assert "removed endpoint broken" in CliRunner().invoke(main, ["delete", "broken", *ep]).output


def test_aws_rejection_leaves_no_half_made_deploy(moto_url):
    """moto rejects ml.g5 types at CreateEndpointConfig: the model made just before is removed again."""
    ep = ["--endpoint-url", moto_url]
    fails(["deploy", "gfive", *DEPLOY[2:9], "ml.g5.xlarge", *DEPLOY[10:], *ep],
          "CreateEndpointConfig: ValidationException", "ml.g5.xlarge")
    sm = boto3.client("sagemaker", endpoint_url=moto_url)
    assert not [m for m in sm.list_models()["Models"] if m["ModelName"].startswith("gfive")]


def test_voice_and_file_errors(moto_url, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fails(["package", ckpt, "--voice", "alice"], "--voice must be ID=AUDIO[:TRANSCRIPT]")
    fails(["package", ckpt, "--voice", f"alice={tmp_path / 'nope.wav'}:Hi."], "audio file not found")
    fails(["invoke", "--url", "http://127.0.0.1:9", "--text", "Hi.", "--reference", tmp_path / "nope.wav",
           "--reference-text", "x"], "reference audio not found")
    fails(["invoke", "--url", "http://127.0.0.1:9", "--text", "Hi.", "--reference", "s3://b/"], "go together")
    fails(["invoke", "some-endpoint", "--url", "http://127.0.0.1:9", "--text", "Hi."], "exactly one of NAME, --url")


def test_credentials_and_connection_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fails(["status", "tts", "--endpoint-url", "http://127.0.0.1:9"], "no usable AWS credentials")
    fails(["status", "tts", "--profile", "nobody"], "ProfileNotFound")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    fails(["status", "tts"], "no AWS region")
    fails(["status", "tts", "--region", "us-east-1", "--endpoint-url", "ftp://x"], "--endpoint-url must be an http(s) URL")

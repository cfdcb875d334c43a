"""The AWS side of package trust: manifest.json first in a reproducible model.tar.gz, read back
from S3 with ranged GETs, pinned by `deploy` as FISH_SM_MANIFEST_SHA256; links leaving a
package and re-packaging a tampered package are refused. Against moto's standalone server."""

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile

import boto3
import pytest
from botocore.config import Config
from click.testing import CliRunner

from fish_sm.aws.package import MANIFEST_LIMIT, MANIFEST_RANGE, read_tarball_manifest
from fish_sm.aws.s3 import S3Uri
from fish_sm.aws.session import AWS
from fish_sm.cli import main
from fish_sm.errors import InputError
from fish_sm.package.tarball import make_tarball
from fish_sm.package.verify import verify_package
from moto_helpers import moto_server

ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-trust"
DEPLOY = ("--role", ROLE, "--image", "123.dkr/fish-sm:1", "--instance-type", "ml.g4dn.xlarge", "--poll", 0.01)


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with moto_server(tmp_path_factory) as url:
        s3(url).create_bucket(Bucket=BUCKET)
        yield url
        # moto keeps one state per process, which the next module's server shares: leave none behind.
        for name in ("trust-pinned", "trust-given"):
            CliRunner().invoke(main, ["delete", name, "--endpoint-url", url])


def s3(url):
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))


def aws(url):
    return AWS(region="us-east-1", endpoint_url=url)


def cli(url, *args, ok=True):
    result = CliRunner().invoke(main, [*map(str, args), "--endpoint-url", url])
    assert "Traceback" not in result.output
    assert (result.exit_code == 0) == ok, result.output
    return result.output


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(url, key, data: bytes) -> S3Uri:
    s3(url).put_object(Bucket=BUCKET, Key=key, Body=data)
    return S3Uri(BUCKET, key)


def test_manifest_is_the_first_entry_and_the_tarball_stays_reproducible(tiny_model, tmp_path):
    a = make_tarball(tiny_model, tmp_path / "a" / "model.tar.gz", progress=False)
    b = make_tarball(shutil.copytree(tiny_model, tmp_path / "copy"), tmp_path / "b" / "model.tar.gz", progress=False)
    assert a.sha256 == b.sha256 and a.path.read_bytes() == b.path.read_bytes()
    with tarfile.open(a.path) as tar:
        first = tar.next()
        assert first.name == "manifest.json" and first.isfile()
        assert tar.extractfile(first).read() == (tiny_model / "manifest.json").read_bytes()


def test_deploy_pins_the_manifest_of_the_uploaded_tarball(tiny_model, moto_url, tmp_path):
    out = tmp_path / "model.tar.gz"
    printed = cli(moto_url, "package", tiny_model, "-o", out, "--upload", f"s3://{BUCKET}/pinned/")
    uri = f"s3://{BUCKET}/pinned/model.tar.gz"
    assert printed.strip().splitlines()[-1] == uri
    manifest = (tiny_model / "manifest.json").read_bytes()
    assert read_tarball_manifest(aws(moto_url), S3Uri(BUCKET, "pinned/model.tar.gz"))[0] == manifest

    printed = cli(moto_url, "deploy", "trust-pinned", "--model-data", uri, *DEPLOY)
    assert f"pinned the package's manifest.json: FISH_SM_MANIFEST_SHA256={sha(manifest)}" in printed
    env = environment(moto_url, "trust-pinned")
    assert env["FISH_SM_MANIFEST_SHA256"] == sha(manifest)
    assert verify_package(tiny_model, env["FISH_SM_MANIFEST_SHA256"])  # what the container then accepts

    # A pin given with --env is checked against the package: the same one is kept as given...
    printed = cli(moto_url, "deploy", "trust-given", "--model-data", uri, *DEPLOY,
                  "--env", f"FISH_SM_MANIFEST_SHA256={sha(manifest)}")
    assert "pinned the package's manifest" not in printed and environment(moto_url, "trust-given")["FISH_SM_MANIFEST_SHA256"] == sha(manifest)
    # ...another, which the container would refuse to serve, is an error before anything is made.
    other = "ab" * 32
    printed = cli(moto_url, "deploy", "trust-wrong", "--model-data", uri, *DEPLOY,
                  "--env", f"FISH_SM_MANIFEST_SHA256={other}", ok=False)
    assert printed.strip().splitlines()[-1] == (
        f"Error: --env FISH_SM_MANIFEST_SHA256={other} does not match the manifest.json of {uri} ({sha(manifest)}); "
        "the container would refuse to serve it")
    sm = boto3.client("sagemaker", endpoint_url=moto_url, region_name="us-east-1")
    assert not [m for m in sm.list_models()["Models"] if m["ModelName"].startswith("trust-wrong")]


def test_deploy_of_another_tarball_is_refused(moto_url):
    put(moto_url, "other/model.tar.gz", gzip.compress(b"not a tar archive at all" * 40))
    printed = cli(moto_url, "deploy", "trust-other", "--model-data", f"s3://{BUCKET}/other/model.tar.gz", *DEPLOY,
                  ok=False)
    assert printed.strip().splitlines()[-1] == (
        f"Error: --model-data s3://{BUCKET}/other/model.tar.gz has no manifest.json as its first entry (or is not a "
        "tar archive); make it with `fish-sm package`")
    sm = boto3.client("sagemaker", endpoint_url=moto_url, region_name="us-east-1")
    assert not [e for e in sm.list_endpoints()["Endpoints"] if e["EndpointName"] == "trust-other"]


def environment(url, name):
    sm = boto3.client("sagemaker", endpoint_url=url, region_name="us-east-1")
    config = sm.describe_endpoint(EndpointName=name)["EndpointConfigName"]
    model = sm.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"][0]["ModelName"]
    return sm.describe_model(ModelName=model)["PrimaryContainer"]["Environment"]


def hand_made_package(root, manifest: bytes):
    """A directory with manifest.json and a weight file: all make_tarball needs."""
    root.mkdir(parents=True)
    (root / "manifest.json").write_bytes(manifest)
    (root / "model.pth").write_bytes(os.urandom(300_000))
    return root


def test_a_long_manifest_is_read_over_several_ranges(moto_url, tmp_path):
    manifest = json.dumps({"files": {f"code/{i}.py": os.urandom(48).hex() for i in range(3000)}}).encode()
    tarball = make_tarball(hand_made_package(tmp_path / "pkg", manifest), tmp_path / "m.tar.gz", progress=False)
    assert len(gzip.compress(manifest, 1)) > 2 * MANIFEST_RANGE  # the first two ranges hold only part of it
    uri = put(moto_url, "long/model.tar.gz", tarball.path.read_bytes())
    assert read_tarball_manifest(aws(moto_url), uri)[0] == manifest


def test_what_is_not_a_manifest_first_tarball_reads_as_none(moto_url, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:  # manifest.json present, but not first
        for name in ("config.json", "manifest.json"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    oversized = hand_made_package(tmp_path / "big", os.urandom(MANIFEST_LIMIT // 2 + 1).hex().encode())
    objects = {
        "not-first.tar.gz": buf.getvalue(),
        "not-gzip.tar.gz": b"tarball",
        "empty.tar.gz": b"",
        "oversized.tar.gz": make_tarball(oversized, tmp_path / "big.tar.gz", progress=False).path.read_bytes(),
    }
    for key, data in objects.items():
        assert read_tarball_manifest(aws(moto_url), put(moto_url, key, data))[0] is None, key


def test_make_tarball_refuses_a_link_leaving_the_package(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "secret").write_bytes(b"host file")
    (model / "voices" / "narrator" / "reference.wav").unlink()
    (model / "voices" / "narrator" / "reference.wav").symlink_to(tmp_path / "secret")
    with pytest.raises(InputError, match=r"reference.wav: a symlink to .*secret, outside"):
        make_tarball(model, tmp_path / "m.tar.gz", progress=False)
    assert not (tmp_path / "m.tar.gz").exists()


def test_repackaging_a_tampered_package_is_refused(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    data = bytearray((model / "model.pth").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (model / "model.pth").write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["package", str(model), "-o", str(tmp_path / "m.tar.gz")])
    line, = result.output.strip().splitlines()
    assert result.exit_code == 1 and line.startswith("Error: ") and "model.pth: sha256" in line, result.output
    assert not (tmp_path / "m.tar.gz").exists()
    # The untampered package re-packages to the same bytes make_tarball gives.
    result = CliRunner().invoke(main, ["package", str(tiny_model), "-o", str(tmp_path / "ok.tar.gz")])
    assert result.exit_code == 0, result.output
    assert sha((tmp_path / "ok.tar.gz").read_bytes()) == make_tarball(tiny_model, tmp_path / "ref.tar.gz",
                                                                       progress=False).sha256

"""`pip install fish-sm` is the control plane without torch: installed into a fresh virtual
environment from this source tree, `deploy` runs against moto's server, and a command that needs
the engine says in one line what to install."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from fish_sm.package.tarball import make_tarball
from moto_helpers import moto_server

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ROLE = "arn:aws:iam::123456789012:role/fish-sm-test"
BUCKET = "fish-sm-base-install"


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    """A fresh venv with the base package (from a copy of the source, so no build files land here)."""
    root = tmp_path_factory.mktemp("base-install")
    source = root / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "fish_sm", source / "fish_sm", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-compile", str(source)], check=True, timeout=900)
    return venv


def test_the_base_install_deploys_without_torch(base_venv, tiny_model, tmp_path, tmp_path_factory):
    python, fish_sm = base_venv / "bin" / "python", base_venv / "bin" / "fish-sm"
    assert subprocess.run([str(python), "-c", "import importlib.util, sys; "
                           "sys.exit(any(importlib.util.find_spec(m) for m in ('torch', 'torchao', 'triton')))"]
                          ).returncode == 0
    shown = subprocess.run([str(fish_sm), "deploy", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--model-data" in shown.stdout
    tarball = make_tarball(tiny_model, tmp_path / "model.tar.gz", progress=False)
    with moto_server(tmp_path_factory) as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        s3.upload_file(str(tarball.path), BUCKET, "base/model.tar.gz")
        deployed = subprocess.run(
            [str(fish_sm), "deploy", "base-install", "--model-data", f"s3://{BUCKET}/base/model.tar.gz",
             "--role", ROLE, "--image", "123.dkr/fish-sm:1", "--instance-type", "ml.g4dn.xlarge", "--poll", "0.01",
             "--endpoint-url", url], capture_output=True, text=True, timeout=300, env=os.environ.copy())
        assert deployed.returncode == 0, deployed.stderr
        sagemaker = boto3.client("sagemaker", endpoint_url=url, region_name="us-east-1")
        assert sagemaker.describe_endpoint(EndpointName="base-install")["EndpointStatus"] == "InService"
        sagemaker.delete_endpoint(EndpointName="base-install")
    needs = subprocess.run([str(fish_sm), "synthesize", str(tiny_model), "Hello.", "-o", str(tmp_path / "x.wav")],
                           capture_output=True, text=True)
    lines = needs.stderr.strip().splitlines()
    assert needs.returncode != 0 and len(lines) == 1 and "Traceback" not in needs.stderr
    assert "`fish-sm synthesize` needs the engine" in lines[0] and "pip install 'fish-sm[engine]'" in lines[0]

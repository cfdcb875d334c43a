"""The image, without Docker: deploy/serve's start-up path against an extracted model.tar.gz,
and deploy/Dockerfile's stack against the one docs/benchmarks.md measured."""

import io
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest
import soundfile as sf

from server_helpers import QUICK_ENV, Server, free_port, request

from fish_sm.package.tarball import make_tarball

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_deploy_serve_runs_an_extracted_package(package_dir, tmp_path):
    tarball = tmp_path / "model.tar.gz"
    make_tarball(package_dir, tarball, progress=False)
    model_dir = tmp_path / "opt" / "ml" / "model"
    model_dir.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(model_dir, filter="data")
    assert (model_dir / "manifest.json").is_file() and (model_dir / "code" / "inference.py").is_file()
    port = free_port()
    env = {**QUICK_ENV, "FISH_SM_MODEL_DIR": str(model_dir), "SAGEMAKER_BIND_TO_PORT": str(port),
           "FISH_SM_HOST": "127.0.0.1", "FISH_SM_CACHE_DIR": str(tmp_path / "cache"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    server = Server([str(REPO / "deploy" / "serve")], port, env, tmp_path / "serve.log")
    try:
        server.wait_ready()
        status, headers, body = request(server.url + "/invocations", {"text": "From the image.", "voice": "narrator",
                                                                      "max_new_tokens": 3, "seed": 0})
        assert status == 200 and headers["Content-Type"] == "audio/wav"
        assert sf.info(io.BytesIO(body)).samplerate == 44100
    finally:
        server.stop()
    assert server.proc.returncode == 0  # SIGTERM is a clean stop


def dockerfile_args() -> dict[str, str]:
    """The image's declared stack: deploy/Dockerfile's ARG defaults."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))


def test_image_is_built_on_the_benchmarked_stack():
    """Every figure in docs/benchmarks.md comes from one stack; the image must install that one."""
    args = dockerfile_args()
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    current = " ".join(docs.split("## Current figures", 1)[1].split("\n## ", 1)[0].split())
    torch_version, cuda_tag = re.search(r"torch (\d+\.\d+\.\d+)\+(cu\d+)", current).groups()
    assert (args["TORCH_VERSION"], args["TORCH_CUDA"]) == (torch_version, cuda_tag)
    assert args["TRITON_VERSION"] == re.search(r"Triton (\d+\.\d+\.\d+)", current).group(1)
    assert args["TORCHAO_VERSION"] == re.search(r"torchao (\d+\.\d+\.\d+)", current).group(1)
    # The base image's CUDA is the one torch's wheels were built for: 13.0.x for cu130.
    image, tag = args["CUDA_IMAGE"].split(":")
    cuda = re.fullmatch(r"(\d+)\.(\d+)\.\d+-runtime-ubuntu24\.04", tag)
    assert image == "nvidia/cuda" and cuda is not None, tag
    assert "cu" + "".join(cuda.groups()) == args["TORCH_CUDA"]


def test_image_installs_the_declared_stack_and_what_serving_needs():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    lines = " ".join(text.replace("\\\n", " ").split())
    # The ARGs are what is installed, not decoration.
    assert "FROM ${CUDA_IMAGE}" in text
    for pin in ("torch==${TORCH_VERSION}", "triton==${TRITON_VERSION}", "torchao==${TORCHAO_VERSION}",
                "--index-url https://download.pytorch.org/whl/${TORCH_CUDA}"):
        assert pin in lines, pin
    apt = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", lines).group(1).split()
    # Java for the model server, libsndfile for soundfile, gcc and Python.h for Triton's launcher stubs.
    assert {"openjdk-17-jre-headless", "libsndfile1", "gcc", "python3-dev", "python3-venv"} <= set(apt)
    assert "python3 -m venv $VIRTUAL_ENV" in lines and 'pip install "/src[serve]"' in lines
    assert "LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in text
    assert "COPY deploy/serve /usr/local/bin/serve" in text and 'CMD ["serve"]' in text
    # pip writes every module's bytecode (PYTHONDONTWRITEBYTECODE stops only the interpreter's own
    # writes): without it each process of every start compiles torch's sources again, seconds each
    # (benchmarks/ping_time.py's --bytecode).
    assert "--no-compile" not in lines and "PIP_NO_COMPILE" not in lines

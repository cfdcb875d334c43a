"""The image's start-up path, on the host: deploy/serve against an extracted model.tar.gz."""

import io
import os
import sys
import tarfile
from pathlib import Path

import soundfile as sf

from server_helpers import QUICK_ENV, Server, free_port, request

from fish_sm.package.tarball import make_tarball

REPO = Path(__file__).resolve().parents[2]


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

"""The stock SageMaker PyTorch container's path: sagemaker-pytorch-inference 2.0.25 and
TorchServe 0.12.0 (with their own copy of sagemaker_inference) serving a plain package.

They live in their own virtual environment, .venv-stock (built by `make test`), as they
would in the image: installing them here would replace our sagemaker_inference.
"""

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import soundfile as sf

from server_helpers import Server, free_port, request

REPO = Path(__file__).resolve().parents[2]
STOCK_PYTHON = REPO / ".venv-stock" / "bin" / "python"


@pytest.mark.skipif(os.geteuid() != 0, reason="the stock entrypoint writes /etc/sagemaker-ts.properties, as root in its image")
def test_stock_container_serves_the_package(package_dir, tmp_path):
    assert STOCK_PYTHON.exists(), "build .venv-stock first: make .venv-stock"
    base = tmp_path / "ml"
    shutil.copytree(package_dir, base / "model")
    port = free_port()
    env = {
        "SAGEMAKER_BASE_DIR": str(base), "SAGEMAKER_BIND_TO_PORT": str(port), "SAGEMAKER_PROGRAM": "inference.py",
        "SAGEMAKER_SUBMIT_DIRECTORY": str(base / "model" / "code"),
        # what `fish-sm deploy --stock-container` sets: one worker per GPU, long timeouts
        "SAGEMAKER_TS_MIN_WORKERS": "1", "SAGEMAKER_TS_MAX_WORKERS": "1", "SAGEMAKER_TS_RESPONSE_TIMEOUT": "300",
        "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "*/*", "FISH_SM_WARMUP": "1", "FISH_SM_CACHE_DIR": str(tmp_path / "cache"),
        "PATH": str(STOCK_PYTHON.parent) + os.pathsep + os.environ["PATH"], "PYTHONPATH": "",
        "TMPDIR": str(tmp_path),  # TorchServe's one-instance lock lives there
    }
    cmd = [str(STOCK_PYTHON), "-c", "from sagemaker_pytorch_serving_container import serving; serving.main()"]
    server = Server(cmd, port, env, tmp_path / "stock.log")
    try:
        server.wait_ready(timeout=240)
        # TorchServe answers /ping before the worker's model_fn is done; requests queue meanwhile.
        status, headers, body = request(server.url + "/invocations",
                                        {"text": "From the stock container.", "voice": "narrator", "max_new_tokens": 3, "seed": 0},
                                        timeout=240)
        assert status == 200, body
        assert headers["Content-Type"] == "audio/wav" and sf.info(io.BytesIO(body)).samplerate == 44100
        status, headers, body = request(server.url + "/invocations", {"text": "x", "temperature": 9}, timeout=60)
        assert status == 400 and json.loads(body) == {"error": "temperature must be a number in [0.1, 1.0], got 9.0"}
        assert "model_fn ready" in server.log.read_text()
    finally:
        server.stop()

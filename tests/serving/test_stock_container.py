"""The stock SageMaker PyTorch container's path: sagemaker-pytorch-inference 2.0.25 and
TorchServe 0.12.0 (with their own copy of sagemaker_inference) serving a package, one that
pip-installs code/requirements.txt at start and one that carries its dependencies in code/lib.

They live in their own virtual environment, .venv-stock (built by `make test`), as they
would in the image: installing them here would replace our sagemaker_inference.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from server_helpers import Server, free_port, request

from fish_sm.package.vendor import LIB_DIR, STOCK_WHEELS, download_wheels

REPO = Path(__file__).resolve().parents[2]
STOCK_PYTHON = REPO / ".venv-stock" / "bin" / "python"


as_root = pytest.mark.skipif(os.geteuid() != 0,
                             reason="the stock entrypoint writes /etc/sagemaker-ts.properties, as root in its image")
REQUEST = {"text": "From the stock container.", "voice": "narrator", "max_new_tokens": 3, "seed": 0}


def start_stock(package: Path, tmp_path: Path, python: Path, extra_env: dict[str, str] | None = None) -> Server:
    """The stock container's serving stack on `package`, as SageMaker starts it, on loopback."""
    assert STOCK_PYTHON.exists(), "build .venv-stock first: make .venv-stock"
    base = tmp_path / "ml"
    shutil.copytree(package, base / "model")
    port = free_port()
    env = {
        "SAGEMAKER_BASE_DIR": str(base), "SAGEMAKER_BIND_TO_PORT": str(port), "SAGEMAKER_PROGRAM": "inference.py",
        "SAGEMAKER_SUBMIT_DIRECTORY": str(base / "model" / "code"),
        # what `fish-sm deploy --stock-container` sets: one worker per GPU, long timeouts
        "SAGEMAKER_TS_MIN_WORKERS": "1", "SAGEMAKER_TS_MAX_WORKERS": "1", "SAGEMAKER_TS_RESPONSE_TIMEOUT": "300",
        "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "*/*", "FISH_SM_WARMUP": "1", "FISH_SM_CACHE_DIR": str(tmp_path / "cache"),
        "PATH": str(python.parent) + os.pathsep + os.environ["PATH"], "PYTHONPATH": "",
        "TMPDIR": str(tmp_path),  # TorchServe's one-instance lock lives there
        # TorchServe's metrics API listens on 8082 unless told otherwise: two servers of parallel
        # test workers would fight over it.
        "TS_METRICS_ADDRESS": f"http://127.0.0.1:{free_port()}",
        **(extra_env or {}),
    }
    cmd = [str(python), "-c", "from sagemaker_pytorch_serving_container import serving; serving.main()"]
    return Server(cmd, port, env, tmp_path / "stock.log")


def check_serves(server: Server) -> None:
    server.wait_ready(timeout=240)
    # TorchServe answers /ping before the worker's model_fn is done; requests queue meanwhile.
    status, headers, body = request(server.url + "/invocations", REQUEST, timeout=240)
    assert status == 200, body
    assert headers["Content-Type"] == "audio/wav" and sf.info(io.BytesIO(body)).samplerate == 44100
    status, headers, body = request(server.url + "/invocations", {"text": "x", "temperature": 9}, timeout=60)
    assert status == 400 and json.loads(body) == {"error": "temperature must be a number in [0.1, 1.0], got 9.0"}
    assert "model_fn ready" in server.log.read_text()


@pytest.mark.integration
@as_root
def test_stock_container_serves_the_package(package_dir, tmp_path):
    server = start_stock(package_dir, tmp_path, STOCK_PYTHON)
    try:
        check_serves(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vendored_package(tiny_checkpoint, voice_audio, tmp_path_factory):
    """A package built with its dependencies in code/lib; the wheels are this machine's (the
    product downloads the stock container's: Python 3.12, manylinux x86_64)."""
    from fish_sm.package.build import build_package_dir

    python_version = "{}.{}".format(*sys.version_info[:2])
    wheels = download_wheels(tmp_path_factory.mktemp("wheels"), python_version=python_version, platform=None)
    out = tmp_path_factory.mktemp("vendored") / "model"
    build_package_dir(tiny_checkpoint, out, voices={"narrator": (voice_audio, "This is the narrator speaking.")},
                      vendor_wheels=wheels)
    return out


@pytest.fixture(scope="module")
def bare_stock_python(vendored_package, tmp_path_factory):
    """An interpreter with .venv-stock's packages except those the package vendors (and click,
    which only the CLI imports): what the stock image offers, so their imports can only come
    from code/lib. TorchServe starts its workers on the interpreter it runs on."""
    assert STOCK_PYTHON.exists(), "build .venv-stock first: make .venv-stock"
    root = tmp_path_factory.mktemp("bare-stock")
    site = next((REPO / ".venv-stock" / "lib").glob("python3.*/site-packages"))
    vendored = {p.name for p in (vendored_package / "code" / LIB_DIR).iterdir()}
    projects = {_project(n) for n in vendored if n.endswith(".dist-info")} | {"click"}
    hidden = vendored | {"click"} | {n for n in os.listdir(site) if _project(n) in projects}
    mirror = root / "site-packages"
    mirror.mkdir()
    for name in sorted(set(os.listdir(site)) - hidden):
        (mirror / name).symlink_to(site / name)
    venv = root / "venv"
    subprocess.run([os.path.realpath(STOCK_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    own_site = next((venv / "lib").glob("python3.*/site-packages"))
    (own_site / "stock.pth").write_text(f"import site; site.addsitedir({str(mirror)!r})\n")
    python = venv / "bin" / "python"
    torchserve = venv / "bin" / "torchserve"
    torchserve.write_text(f"#!{python}\nimport sys\nfrom ts.model_server import start\nsys.exit(start())\n")
    torchserve.chmod(0o755)
    return python


def _project(entry: str) -> str:
    """A .dist-info directory's project name, normalised; '' for anything else."""
    if not entry.endswith(".dist-info"):
        return ""
    return entry.split("-")[0].lower().replace("-", "_").replace(".", "_")


def test_vendored_package_has_lib_and_no_requirements(vendored_package):
    from fish_sm.package.verify import verify_package

    code = vendored_package / "code"
    assert not (code / "requirements.txt").exists()  # nothing for the container to fetch
    manifest = json.loads((vendored_package / "manifest.json").read_text())
    assert [w.split("-")[0].lower() for w in manifest["vendored"]] == sorted(r.split("==")[0] for r in STOCK_WHEELS)
    lib_files = {str(p.relative_to(vendored_package)) for p in (code / LIB_DIR).rglob("*") if p.is_file()}
    assert {"code/lib/soundfile.py", "code/lib/tiktoken/core.py", "code/lib/torchao/__init__.py"} <= lib_files
    assert lib_files <= set(manifest["files"])  # every vendored file is hashed and verified like the rest
    assert verify_package(vendored_package)


@pytest.mark.integration
def test_code_lib_alone_provides_the_dependencies(vendored_package, bare_stock_python):
    code = vendored_package / "code"
    # torchao is found, not imported: 0.12 (for the image's torch 2.6) does not import on this torch.
    check = ("import importlib.util, json, sys; sys.path.insert(0, sys.argv[1]); import inference; "
             "import soundfile, tiktoken, regex; "
             "files = {m.__name__: m.__file__ for m in (soundfile, tiktoken, regex)}; "
             "files['torchao'] = importlib.util.find_spec('torchao').origin; print(json.dumps(files))")
    env = {"PATH": os.environ["PATH"], "PYTHONNOUSERSITE": "1"}
    hidden = subprocess.run([str(bare_stock_python), "-c", "import soundfile"], env=env, capture_output=True, text=True)
    assert hidden.returncode != 0 and "No module named 'soundfile'" in hidden.stderr  # the venv's copy is out of reach
    done = subprocess.run([str(bare_stock_python), "-c", check, str(code)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(Path(f).is_relative_to(code / LIB_DIR) for f in files.values()), files


@pytest.mark.integration
@as_root
def test_stock_container_serves_a_vendored_package_offline(vendored_package, bare_stock_python, tmp_path):
    # No index for pip and no requirements.txt: the start must fetch nothing.
    server = start_stock(vendored_package, tmp_path, bare_stock_python, {"PIP_NO_INDEX": "1"})
    try:
        check_serves(server)
    finally:
        server.stop()
    assert "installing packages from requirements.txt" not in server.log.read_text()

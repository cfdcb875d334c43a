"""Starting the model server the way a SageMaker container does.

sagemaker-inference's multi-model server (Java) runs one Python worker per GPU (one on
a CPU-only machine) with `fish_sm.serving.handler_service`, on a private loopback port;
the public port is `front`'s readiness gate, which answers `GET /ping` and streams
`POST /invocations` through. MMS's configuration is written to a private temporary
directory rather than /etc, with limits set for long audio: MMS caps responses at
6.5 MB and requests at 6 MB by default, and times a request out after 60 s (the
`MMS_*` environment variables still override what is set here).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from aiohttp import web

from fish_sm.errors import CheckpointError, ConfigError
from fish_sm.serving.front import READY_DIR_ENV, Front, make_app
from fish_sm.serving.handler_service import MODEL_DIR_ENV
from fish_sm.serving.settings import Settings

HANDLER = "fish_sm.serving.handler_service:handle"
PAYLOAD_LIMIT = 100 * 1024 * 1024  # bytes, each way: an hour of 44.1 kHz 16-bit WAV is 318 MB, so ~15 min
REQUIRED = ("config.json", "tokenizer.tiktoken", "special_tokens.json")


@dataclass(frozen=True)
class ServerConfig:
    model_dir: Path
    port: int = 8080
    host: str = "127.0.0.1"
    workers: int | None = None  # default: one per GPU, or one on the CPU
    response_timeout: int = 900  # seconds for one request: long texts on a busy worker


def check_model_dir(model_dir: Path) -> None:
    """A package directory or a plain checkpoint directory: the checkpoint files at the top."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    missing = [f for f in REQUIRED if not (model_dir / f).is_file()]
    for stem in ("model", "codec"):
        if not any((model_dir / (stem + s)).is_file() for s in (".pth", ".safetensors")):
            missing.append(stem + ".pth")
    if missing:
        raise CheckpointError(f"{model_dir}: not a checkpoint or package directory (missing {', '.join(missing)})")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port() -> int:
    """A free loopback port for the model server; MMS rejects ports above 32767."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ConfigError("no free loopback port in 20000-32767 for the model server")


def mms_properties(cfg: ServerConfig, workers: int, port: int) -> str:
    defaults = resources.files("sagemaker_inference").joinpath("etc/default-mms.properties").read_text()
    ours = {
        "inference_address": f"http://127.0.0.1:{port}",
        "management_address": f"http://127.0.0.1:{port}",
        "default_service_handler": HANDLER,
        "default_workers_per_model": workers,
        "default_response_timeout": cfg.response_timeout,
        "max_request_size": PAYLOAD_LIMIT,
        "max_response_size": PAYLOAD_LIMIT,
        "load_models": "ALL",
        "preload_model": "false",
    }
    return defaults.rstrip("\n") + "\n" + "".join(f"{k}={v}\n" for k, v in ours.items())


def server_env(ready_dir: Path, model_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[READY_DIR_ENV] = str(ready_dir)
    env[MODEL_DIR_ENV] = str(model_dir.resolve())
    # Workers are started with `python` from PATH: make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    # No Accept (or */*) reaches output_fn as */*, which lets a request's `format` decide.
    env.setdefault("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT", "*/*")
    return env


def serve(cfg: ServerConfig) -> int:
    """Run the model server in the foreground until it exits or we are told to stop."""
    check_model_dir(cfg.model_dir)
    Settings.from_env()  # a bad FISH_SM_* variable stops here, not in every worker
    mms = shutil.which("multi-model-server", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mms is None:
        raise ConfigError("multi-model-server is not installed (pip install 'fish-sm[serve]')")
    if shutil.which("java") is None:
        raise ConfigError("the model server needs Java 11 or newer on PATH (Debian: apt-get install default-jre-headless)")
    workers = cfg.workers or max(1, gpu_count())
    log_config = resources.files("sagemaker_inference").joinpath("etc/log4j2.xml")
    with tempfile.TemporaryDirectory(prefix="fish-sm-serve-") as tmp:
        props, ready_dir, backend_port = Path(tmp) / "mms.properties", Path(tmp) / "ready", free_port()
        props.write_text(mms_properties(cfg, workers, backend_port))
        # MMS reads a top-level manifest.json as a legacy model archive and fails on ours,
        # so it is given an empty model directory; workers find the package through the environment.
        mms_model_dir = Path(tmp) / "model"
        mms_model_dir.mkdir()
        cmd = [mms, "--start", "--foreground", "--mms-config", str(props), "--model-store", "/",
               "--models", f"model={mms_model_dir}", "--log-config", str(log_config)]
        env = server_env(ready_dir, cfg.model_dir)
        # MMS keeps its pid file and worker sockets in TMPDIR and refuses to start beside
        # another instance there: a private one lets servers run side by side.
        env["TMPDIR"] = tmp
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, start_new_session=True)
        try:
            front = Front(f"http://127.0.0.1:{backend_port}", ready_dir, workers, cfg.response_timeout + 30)
            asyncio.run(_run_front(make_app(front, PAYLOAD_LIMIT), cfg, proc))
        finally:
            _terminate(proc)
        return proc.returncode if proc.returncode and proc.returncode > 0 else 0


async def _run_front(app, cfg: ServerConfig, proc: subprocess.Popen) -> None:
    """Serve the public port until a signal arrives or the model server exits."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set() and proc.poll() is None:
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await runner.cleanup()


def _terminate(proc: subprocess.Popen) -> None:
    """Stop the server and its Java and Python children (they share its process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

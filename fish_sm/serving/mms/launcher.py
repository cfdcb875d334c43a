"""Starting the model server the way a SageMaker container does.

sagemaker-inference's multi-model server (Java) runs one Python worker per GPU (one on
a CPU-only machine) with `fish_sm.serving.mms.handler_service`, its inference API on a private
loopback port and its management API (which registers models with handlers of the
caller's choosing and scales workers) on a unix socket only this user can open; the
public port is `gate`'s readiness gate, which answers `GET /ping` and passes on
`POST /invocations` alone. Each server has a private temporary directory for MMS's
configuration (rather than /etc), pid file, sockets and logs, removed when it stops;
MMS's limits are set for long audio: it caps responses at 6.5 MB and requests at 6 MB by
default, and times a request out after 60 s (the `MMS_*` environment variables still
override what is set here). MMS restarts a worker that fails to load the model forever, so
the launcher stops the server once a device's worker has failed LOAD_ATTEMPTS times (see
`gate.load_failure`), with the worker's error as the last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

from fish_sm.errors import ConfigError, FishSMError
from fish_sm.serving.http import PAYLOAD_LIMIT, Limits, bind, listening
from fish_sm.serving.metrics import Metrics
from fish_sm.serving.mms.gate import READY_DIR_ENV, Front, load_failure, make_app
from fish_sm.serving.mms.handler_service import MODEL_DIR_ENV
from fish_sm.serving.config import ServerConfig, check_model_dir
from fish_sm.settings import Settings

HANDLER = "fish_sm.serving.mms.handler_service:handle"
JOB_QUEUE = 100  # requests MMS holds for its workers (its default); beyond, it answers 503
# Times a device's worker may fail to load the model before the server gives up: MMS itself
# restarts it forever, and SageMaker would wait out its whole health-check timeout.
LOAD_ATTEMPTS = 3


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


def mms_properties(cfg: ServerConfig, workers: int, port: int, management_socket: Path) -> str:
    defaults = resources.files("sagemaker_inference").joinpath("etc/default-mms.properties").read_text()
    ours = {
        "inference_address": f"http://127.0.0.1:{port}",
        # MMS cannot switch its management API off; a unix socket in the private directory is
        # out of reach of the gate and of other users (MMS needs native IO for it, its default).
        "management_address": f"unix:{management_socket}",
        "use_native_io": "true",
        "default_service_handler": HANDLER,
        "default_workers_per_model": workers,
        "default_response_timeout": cfg.response_timeout,
        "max_request_size": PAYLOAD_LIMIT,
        "max_response_size": PAYLOAD_LIMIT,
        "job_queue_size": JOB_QUEUE,
        # The JVM keeps its performance counters in /tmp/hsperfdata_<user> whatever its temp directory.
        "vmargs": "-XX:-UsePerfData",
        "load_models": "ALL",
        "preload_model": "false",
    }
    return defaults.rstrip("\n") + "\n" + "".join(f"{k}={v}\n" for k, v in ours.items())


# sun_path holds 108 bytes; the longest name in the private directory is "/management.sock"
# and mkdtemp's "/fish-sm-serve-XXXXXXXX" comes before it.
UNIX_PATH_MAX = 107
PRIVATE_DIR_SUFFIX = len("/fish-sm-serve-XXXXXXXX/management.sock")


def socket_root() -> str:
    """The temp directory, or /tmp where the temp directory's path is too long for a unix socket."""
    root = tempfile.gettempdir()
    return root if len(root) + PRIVATE_DIR_SUFFIX <= UNIX_PATH_MAX else "/tmp"


def server_env(ready_dir: Path, model_dir: Path, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    # MMS keeps its pid file in Python's temp directory and its worker sockets in Java's,
    # which its launcher sets from TEMP; both private, servers run side by side and leave
    # nothing behind when the directory goes.
    env["TMPDIR"] = env["TEMP"] = str(tmp)
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
    settings = Settings.from_env()  # a bad FISH_SM_* variable stops here, not in every worker
    mms = shutil.which("multi-model-server", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mms is None:
        raise ConfigError("multi-model-server is not installed (pip install 'fish-sm[serve]')")
    if shutil.which("java") is None:
        raise ConfigError("the model server needs Java 11 or newer on PATH (Debian: apt-get install default-jre-headless)")
    log_config = resources.files("sagemaker_inference").joinpath("etc/log4j2.xml")
    public = bind(cfg.host, cfg.port)  # a port in use stops us before Java starts
    with contextlib.closing(public), StopSignals() as stop:
        workers = cfg.workers or max(1, gpu_count())
        with tempfile.TemporaryDirectory(prefix="fish-sm-serve-", dir=socket_root()) as tmp_name:
            if stop.received:
                return 0
            tmp = Path(tmp_name)
            props, ready_dir, backend_port = tmp / "mms.properties", tmp / "ready", free_port()
            props.write_text(mms_properties(cfg, workers, backend_port, tmp / "management.sock"))
            # MMS reads a top-level manifest.json as a legacy model archive and fails on ours,
            # so it is given an empty model directory; workers find the package through the environment.
            mms_model_dir = tmp / "model"
            mms_model_dir.mkdir()
            cmd = [mms, "--start", "--foreground", "--mms-config", str(props), "--model-store", "/",
                   "--models", f"model={mms_model_dir}", "--log-config", str(log_config)]
            proc = subprocess.Popen(cmd, cwd=tmp, env=server_env(ready_dir, cfg.model_dir, tmp), start_new_session=True)
            try:
                front = Front(f"http://127.0.0.1:{backend_port}", ready_dir, workers, cfg.response_timeout + 30,
                              connections=JOB_QUEUE + workers,
                              metrics=Metrics("mms", enabled=settings.metrics == "emf"))
                failure = asyncio.run(_run_front(make_app(front, Limits.from_settings(settings)), cfg, public, proc,
                                                 stop, ready_dir))
            finally:
                _terminate(proc)
            if failure:
                raise FishSMError(failure)  # after the model server's last word, so it is the log's last line
            if not stop.received and proc.returncode:
                raise FishSMError(f"the model server exited by itself with status {proc.returncode} (its log is above)")
            return 0


class StopSignals:
    """SIGTERM and SIGINT, recorded instead of ending the process while `serve` runs, so that
    whenever one comes the model server is stopped and the private directory removed."""

    def __init__(self):
        self.received = False
        self._wake = None  # wakes the running event loop
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum, frame) -> None:
        self.received = True
        if self._wake is not None:
            self._wake()

    async def wait(self, proc: subprocess.Popen, failed=lambda: None):
        """Until a signal comes, the model server exits, or `failed()` returns why it cannot
        serve (then that reason)."""
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(woken.set)
        try:
            while not self.received and proc.poll() is None:
                if reason := failed():
                    return reason
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=0.5)
            return None
        finally:
            self._wake = None


async def _run_front(app, cfg: ServerConfig, sock: socket.socket, proc: subprocess.Popen, stop: StopSignals,
                     ready_dir: Path) -> str | None:
    """Serve the public port until a signal arrives, the model server exits, or a worker has
    failed to load the model LOAD_ATTEMPTS times (then its error)."""
    async with listening(app, cfg.host, cfg.port, sock=sock):
        return await stop.wait(proc, lambda: load_failure(ready_dir, LOAD_ATTEMPTS))


def _terminate(proc: subprocess.Popen) -> None:
    """Stop the server and its Java and Python children (they share its process group), and
    wait until none is left, so that none writes to the private directory once it is removed."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while _group_running(proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _group_running(proc):
            break
    proc.wait()


def _group_running(proc: subprocess.Popen) -> bool:
    """Whether a process of the server's group still runs; zombies (orphans waiting for
    init to reap them) no longer count."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError, IndexError):
            continue
        if int(group) == proc.pid and state != "Z":
            return True
    return False

"""A local `fish-sm serve` to benchmark: started on a free port, stopped when the block ends."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

from fish_sm.aws import AWSError
from fish_sm.clients.url import ping
from fish_sm.errors import InputError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model: Path, *, log_path: Path, startup_timeout_s: float = 600, command: list[str] | None = None):
    """Run `fish-sm serve MODEL` (a directory or model.tar.gz) on a free port until the block ends (also on errors and Ctrl-C).

    Yields the base URL once /ping answers; the server's output goes to log_path, whose tail
    is shown if it dies or never becomes ready.
    """
    model = Path(model)
    if not model.exists():
        raise InputError(f"--local needs a model directory or model.tar.gz, not found: {model}")
    port = free_port()
    cmd = command or [sys.executable, "-m", "fish_sm.cli", "serve", str(model), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            t0 = time.monotonic()
            while not ping(url, timeout_s=2.0):
                if proc.poll() is not None:
                    raise AWSError(f"the local server exited with code {proc.returncode} before it was ready: "
                                   f"{_tail(log_path)}")
                if time.monotonic() - t0 > startup_timeout_s:
                    raise AWSError(f"the local server did not answer /ping within {startup_timeout_s:g} s "
                                   f"(log: {log_path})")
                time.sleep(0.25)
            yield url
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _tail(path: Path, lines: int = 3) -> str:
    text = Path(path).read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(no output)"

"""Starting `fish-sm serve` (or deploy/serve) for real on loopback, and talking HTTP to it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: bytes | str | dict | None = None, content_type="application/json", accept=None,
            method=None, timeout=60) -> tuple[int, "http.client.HTTPMessage", bytes]:
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    headers = {"Content-Type": content_type} if body is not None else {}
    if accept:
        headers["Accept"] = accept
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class Server:
    """A server process in its own session, stopped with everything it started."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str], log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.pings: list[int] = []
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=log.parent, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                status = request(self.url + "/ping", timeout=2)[0]
            except OSError:
                status = 0
            self.pings.append(status)
            if status == 200:
                return time.monotonic() - t0
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def serve_cmd(model_dir: Path, port: int, server: str = "mms") -> list[str]:
    return [sys.executable, "-m", "fish_sm.cli", "serve", str(model_dir), "--port", str(port), "--server", server]


QUICK_ENV = {"FISH_SM_WARMUP": "1"}


def check_bad_request_then_a_good_one(server: "Server", body, ctype: str, status: int, message: str) -> None:
    """The error a bad request gets (status, JSON message, no traceback), and that the next request is served."""
    import io

    import soundfile as sf

    accept = "text/html" if status == 406 else "audio/wav" if "asks for" in message else None
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    got, headers, out = request(server.url + "/invocations", body, ctype, accept)
    assert got == status, out
    assert headers["Content-Type"].startswith("application/json") and b"Traceback" not in out
    assert message in json.loads(out)["error"]
    ok, _, audio = request(server.url + "/invocations", {"text": "Still fine.", "max_new_tokens": 2, "seed": 0})
    assert ok == 200 and sf.info(io.BytesIO(audio)).samplerate == 44100

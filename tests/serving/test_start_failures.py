"""A server that cannot start says why in one line and exits non-zero: a model that does not
load (the model server gives up after a few worker attempts instead of restarting it forever),
a port in use, a bad setting."""

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from server_helpers import QUICK_ENV, free_port, request, serve_cmd

from fish_sm.cli import main
from fish_sm.serving.mms.gate import READY_DIR_ENV, live_ready_workers, load_failure, mark_failed, mark_ready
from fish_sm.serving.mms.launcher import LOAD_ATTEMPTS

BAD_CONFIG = "config.json: not valid JSON"
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d[ T][\d:,]+ |Warning: |WARNING: |Model server started|[A-Z][a-z]+ [a-z]+: )")


@pytest.fixture(scope="module")
def corrupt_checkpoint(tiny_checkpoint, tmp_path_factory):
    model = shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("corrupt") / "model")
    (model / "config.json").write_text('{"dim": 1')  # cut short
    return model


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def run_until_exit(cmd, env, timeout):
    """Run a server to its end, asking /ping meanwhile; (exit code, output lines, /ping statuses, seconds)."""
    port = int(cmd[cmd.index("--port") + 1])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    pings = []
    try:
        while proc.poll() is None:
            assert time.monotonic() - t0 < timeout, "the server did not give up"
            try:
                pings.append(request(f"http://127.0.0.1:{port}/ping", timeout=2)[0])
            except OSError:
                pings.append(0)
            time.sleep(0.25)
        out = proc.stdout.read().decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, out.strip().splitlines(), pings, time.monotonic() - t0


@pytest.mark.integration
def test_the_model_server_gives_up_on_a_model_that_cannot_load(corrupt_checkpoint, tmp_path):
    temp = Path(tempfile.mkdtemp(prefix="fail-", dir="/tmp"))  # short, for MMS's unix sockets
    try:
        env = {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(temp)}
        code, lines, pings, seconds = run_until_exit(serve_cmd(corrupt_checkpoint, free_port(), "mms"), env, 120)
        assert code == 1 and seconds < 120
        assert lines[-1] == (f"Error: the model did not load on cpu after {LOAD_ATTEMPTS} attempts; the last error: "
                             f"{corrupt_checkpoint}/config.json: not valid JSON (Expecting ',' delimiter: line 1 "
                             "column 10 (char 9))"), lines[-5:]
        assert 200 not in pings and 503 in pings  # the gate answered, and never said healthy
        text = "\n".join(lines)
        assert "Traceback" not in text
        assert text.count(f"model_fn failed on cpu: {corrupt_checkpoint}/{BAD_CONFIG}") == LOAD_ATTEMPTS
        assert not any(temp.iterdir())  # the private directory and everything in it are gone
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.integration
def test_the_batching_server_says_why_it_cannot_load_in_one_line(corrupt_checkpoint, tmp_path):
    env = {**QUICK_ENV, "FISH_SM_CACHE_DIR": str(tmp_path / "cache")}
    code, lines, pings, _ = run_until_exit(serve_cmd(corrupt_checkpoint, free_port(), "batching"), env, 120)
    assert code == 1 and 200 not in pings
    assert lines[-1].startswith(f"Error: {corrupt_checkpoint}/{BAD_CONFIG} ("), lines
    assert "Traceback" not in "\n".join(lines)
    assert all(LOG_LINE.match(line) for line in lines[:-1]), lines  # the rest is the log of its start


@pytest.mark.parametrize("server", ["batching", "mms"])
def test_a_port_in_use_or_a_bad_setting_is_one_line_before_anything_loads(tiny_checkpoint, busy_port, server):
    runner = CliRunner()
    result = runner.invoke(main, ["serve", str(tiny_checkpoint), "--port", str(busy_port), "--server", server])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines() == [f"Error: cannot listen on 127.0.0.1:{busy_port}: address already in use"]
    result = runner.invoke(main, ["serve", str(tiny_checkpoint), "--port", str(busy_port), "--server", server],
                           env={"FISH_SM_MAX_BATCH": "many"})
    assert result.exit_code == 1
    assert result.output.splitlines() == ["Error: FISH_SM_MAX_BATCH='many' is not a valid int"]


def test_failures_count_per_device_until_it_loads(tmp_path, monkeypatch):
    """What the workers leave in the ready directory and what the launcher reads from it."""
    ready = tmp_path / "ready"
    monkeypatch.setenv(READY_DIR_ENV, str(ready))
    mark_failed("cuda:0", "first")
    mark_failed("cuda:1", "a different GPU")  # one failure on each of two devices is not two on one
    assert load_failure(ready, 2) is None and live_ready_workers(ready) == 0
    (ready / "failed-cuda:0-1").write_text("CheckpointError: config.json:\n not valid JSON")  # another pid's
    assert load_failure(ready, 2) == ("the model did not load on cuda:0 after 2 attempts; the last error: "
                                      "CheckpointError: config.json: not valid JSON")
    mark_ready("cuda:0")  # loaded after all: its failures no longer count, the other device's still do
    assert load_failure(ready, 1) == "the model did not load on cuda:1 after 1 attempt; the last error: a different GPU"
    assert live_ready_workers(ready) == 1 and sorted(p.name for p in ready.iterdir())[0].isdigit()

"""The README's Python example runs as written, where `make run` leaves a fresh clone (its tiny
checkpoint in checkpoints/tiny, its sentence in out/hello.wav)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def make_run_commands() -> list[list[str]]:
    """What `make run` runs after installing: the Makefile's own recipe lines, `fish-sm` from this Python."""
    makefile = (REPO / "Makefile").read_text()
    checkpoint = re.search(r"^CHECKPOINT := (\S+)", makefile, re.M).group(1)
    lines = re.findall(r"^\t\$\(VENV\)/bin/fish-sm (.+)$", makefile, re.M)
    commands = []
    for line in lines:
        line = line.replace("$(CHECKPOINT)", checkpoint)
        commands.append([sys.executable, "-m", "fish_sm.cli", *shlex.split(line)])
    return commands


def test_the_readme_python_example_runs_as_written(tmp_path):
    for command in make_run_commands():
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, timeout=600)
    assert (tmp_path / "checkpoints" / "tiny" / "config.json").is_file() and (tmp_path / "out" / "hello.wav").is_file()
    readme = (REPO / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    ran = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ran.returncode == 0, ran.stderr

"""Dependencies shipped inside a package for the stock SageMaker PyTorch container.

Without them the container pip-installs code/requirements.txt when it starts, which needs the
internet: an endpoint with network isolation, or in a VPC without a NAT, never starts. A
package built with `fish-sm package --stock-container` instead carries their wheels unpacked
into code/lib/ (which code/inference.py puts first on sys.path) and no requirements.txt, so
nothing is fetched at start and every vendored file is in the manifest like the rest.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from fish_sm.errors import InputError

LIB_DIR = "lib"  # under code/: code/inference.py adds it to sys.path
# The image `deploy --stock-container` uses: pytorch-inference:2.6.0-gpu-py312-cu124-ubuntu22.04-sagemaker,
# Python 3.12 on Ubuntu 22.04 (glibc 2.35; pip also takes every older manylinux tag for it).
STOCK_PYTHON = "3.12"
STOCK_PLATFORM = "manylinux_2_35_x86_64"
# What fish_sm's serving path imports that the image lacks, exactly pinned, with their own
# dependencies that it lacks; numpy, cffi, requests and torch are the image's. Each satisfies
# fish_sm/serving/stock_requirements.txt (a test holds the two together).
STOCK_WHEELS = (
    "soundfile==0.14.0",   # its manylinux wheel carries libsndfile
    "tiktoken==0.14.0",
    "regex==2026.11.19",   # tiktoken's
    "torchao==0.12.0",     # INT8 weight-only, for the image's torch 2.6
)


def download_wheels(dest: Path, requirements=STOCK_WHEELS, *, python_version: str = STOCK_PYTHON,
                    platform: str | None = STOCK_PLATFORM) -> list[Path]:
    """`pip download` one binary wheel per requirement, for `python_version` and `platform`
    (None: this machine's), without their dependencies; returns the wheel files."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
           "--only-binary=:all:", "--no-deps", "--dest", str(dest)]
    if platform is not None:
        abi = "cp" + python_version.replace(".", "")
        cmd += ["--platform", platform, "--python-version", python_version, "--implementation", "cp", "--abi", abi]
    proc = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:] or ["no output"]
        raise InputError(f"pip download of the stock container's wheels failed: {errors[-1]} "
                         "(give wheels already downloaded with --wheels DIR)")
    return find_wheels(dest, requirements)


def find_wheels(directory: Path, requirements=STOCK_WHEELS) -> list[Path]:
    """The one wheel in `directory` for each `name==version` requirement; refuses a missing or doubled one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: not a directory of wheels")
    wheels = sorted(p for p in directory.iterdir() if p.suffix == ".whl" and p.is_file())
    found = []
    for req in requirements:
        name, _, version = req.partition("==")
        matches = [w for w in wheels if _wheel_name_version(w) == (_normalise(name), version)]
        if len(matches) != 1:
            what = "no wheel" if not matches else f"{len(matches)} wheels ({', '.join(w.name for w in matches)})"
            raise InputError(f"{directory}: {what} for {req}")
        found.append(matches[0])
    return found


def unpack_wheels(wheels, lib: Path) -> list[str]:
    """Install each wheel by unpacking it into `lib` (what pip does for a pure or platform
    library wheel: its .data/purelib and .data/platlib join the top level, scripts and headers
    are left out); returns the wheels' names. Compiled .pyc files are left out, as the manifest
    check ignores them."""
    lib = Path(lib)
    lib.mkdir(parents=True, exist_ok=True)
    names = []
    for wheel in sorted(wheels, key=lambda w: Path(w).name):
        with zipfile.ZipFile(wheel) as zf:
            for info in sorted(zf.infolist(), key=lambda i: i.filename):
                target = _target(PurePosixPath(info.filename), Path(wheel).name)
                if target is None or info.is_dir():
                    continue
                out = lib.joinpath(*target.parts)
                out.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(out, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        names.append(Path(wheel).name)
    return names


def _target(member: PurePosixPath, wheel: str) -> PurePosixPath | None:
    if member.is_absolute() or ".." in member.parts or not member.parts:
        raise InputError(f"{wheel}: member {member} would land outside code/{LIB_DIR}")
    first = member.parts[0]
    if first.endswith(".data"):
        if len(member.parts) < 3 or member.parts[1] not in ("purelib", "platlib"):
            return None
        member = PurePosixPath(*member.parts[2:])
    if "__pycache__" in member.parts or member.suffix == ".pyc":
        return None
    return member


def _wheel_name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return _normalise(name), version


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


__all__ = ["LIB_DIR", "STOCK_PYTHON", "STOCK_PLATFORM", "STOCK_WHEELS", "download_wheels", "find_wheels",
           "unpack_wheels"]

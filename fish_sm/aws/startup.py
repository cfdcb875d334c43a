"""Measured start-up per GPU model, and the SageMaker timeouts `deploy` derives from it.

A container's start is timed from its process starting to its first healthy `/ping` (unpack,
verify, load, compile, capture, warm-up), as `benchmarks/ping_time.py` and `fish-sm serve`
measure it: nothing cached, and from a package that carries a compile cache built on that GPU
model. `deploy` gives the container a few times that to pass its first `/ping`, so that one that
hangs is replaced in minutes rather than after SageMaker's half hour; a GPU model without a
measurement keeps the half hour. GPU models are named as EC2's DescribeInstanceTypes names them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# What an unmeasured start gets, and SageMaker's bounds for both timeouts.
UNMEASURED_TIMEOUT_S = 1800
LOWEST_S, HIGHEST_S = 60, 3600
# The start's margin: twice the measured start (a slower host, a cold page cache, more slots to
# size) plus two minutes (SageMaker starting the container, the stock image's own start).
START_FACTOR, START_EXTRA_S = 2.0, 120
# The package's download: at no less than this many bytes a second from S3, twice over, plus two minutes.
DOWNLOAD_FLOOR_BYTES_S = 25e6
DOWNLOAD_FACTOR, DOWNLOAD_EXTRA_S = 2.0, 120


@dataclass(frozen=True)
class MeasuredStart:
    """One GPU model's start-up to a healthy `/ping`, in seconds, and where it comes from."""

    cold_s: float  # nothing cached: every kernel compiled
    cached_s: float | None  # from a package whose compile cache was built on this GPU model (None: not measured)
    device: str
    date: str
    command: str
    source: str


MEASURED_STARTS: dict[str, MeasuredStart] = {
    "H100": MeasuredStart(
        cold_s=219.3, cached_s=98.2, device="nvidia-h100-x1", date="2026-11-26",
        command="FISH_SM_MAX_SEQ_LEN=2048 python benchmarks/ping_time.py s1-mini [--cache DIR]",
        source='docs/benchmarks.md "Issue 35"'),
    "H200": MeasuredStart(
        cold_s=110.4, cached_s=44.1, device="nvidia-h200 (one H200)", date="2026-11-29",
        command="FISH_SM_BENCHMARK_LENGTHS=true FISH_SM_MAX_SEQ_LEN=2048 python benchmarks/ping_time.py s1-mini",
        source='docs/benchmarks.md "Issue 44"'),
}


@dataclass(frozen=True)
class Timeouts:
    """The two SageMaker timeouts of a deploy, in seconds, and why each is what it is."""

    startup: int
    download: int
    startup_why: str
    download_why: str


def _bounded(seconds: float) -> int:
    """Up to a multiple of 10 s, within SageMaker's 60-3600 s."""
    return int(min(HIGHEST_S, max(LOWEST_S, 10 * math.ceil(seconds / 10))))


def cache_fits(manifest: dict | None, gpu_model: str | None) -> bool:
    """Whether a package's compile cache (its manifest's `compile_cache`, as `fish-sm package
    --compile-cache` records it) was built on this GPU model: the server then loads it."""
    cache = (manifest or {}).get("compile_cache") or {}
    name = str(cache.get("gpu_name") or "")
    return bool(gpu_model) and gpu_model.upper() in name.upper().split()


def startup_timeout(gpu_model: str | None, *, cached: bool, stock_container: bool = False) -> tuple[int, str]:
    """Seconds the container may take to pass its first `/ping`, and why."""
    if stock_container:
        return UNMEASURED_TIMEOUT_S, "the stock container's start is not measured"
    found = MEASURED_STARTS.get((gpu_model or "").upper())
    if found is None:
        what = f"no start measured on {gpu_model}" if gpu_model else "the GPU model is unknown"
        return UNMEASURED_TIMEOUT_S, f"{what} (benchmarks/ping_time.py measures one)"
    seconds, kind = (found.cached_s, "with its compile cache") if cached and found.cached_s else (found.cold_s, "cold")
    value = _bounded(START_FACTOR * seconds + START_EXTRA_S)
    return value, (f"{START_FACTOR:g} x the {seconds:g} s a {gpu_model} start took {kind} "
                   f"({found.device}, {found.date}) + {START_EXTRA_S} s")


def download_timeout(package_bytes: int | None) -> tuple[int, str]:
    """Seconds for downloading the package, from its size, and why."""
    if package_bytes is None:
        return UNMEASURED_TIMEOUT_S, "the package's size is unknown"
    seconds = DOWNLOAD_FACTOR * package_bytes / DOWNLOAD_FLOOR_BYTES_S + DOWNLOAD_EXTRA_S
    return _bounded(seconds), (f"{package_bytes / 1e9:.2f} GB at {DOWNLOAD_FLOOR_BYTES_S / 1e6:g} MB/s, "
                               f"x {DOWNLOAD_FACTOR:g} + {DOWNLOAD_EXTRA_S} s")


def deploy_timeouts(gpu_model: str | None, *, manifest: dict | None, package_bytes: int | None,
                    stock_container: bool = False) -> Timeouts:
    """Both timeouts for a deploy of this package on this GPU model."""
    startup, startup_why = startup_timeout(gpu_model, cached=cache_fits(manifest, gpu_model),
                                           stock_container=stock_container)
    download, download_why = download_timeout(package_bytes)
    return Timeouts(startup, download, startup_why, download_why)

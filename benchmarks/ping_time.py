"""How soon the batching server answers `/ping` healthy: a cold start (empty compile cache),
then a start from a package directory built with that compile cache (as `fish-sm package --compile-cache`
builds it and SageMaker unpacks it, with a fresh FISH_SM_CACHE_DIR), each followed by one
streamed request to show it serves. Settings come from the environment (FISH_SM_MAX_BATCH,
FISH_SM_MAX_SEQ_LEN, ...), as a deployed server takes them.

    python benchmarks/ping_time.py CHECKPOINT [--cache FISH_SM_CACHE_DIR] [--work DIR] [--port 8091] [--out DIR]

One JSON line per start (seconds to a healthy /ping, the server's own log lines about its
slots and graphs, the first request's status and first audio); DIR/ping_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LOG_MARKS = ("slots of", "captured", "every graph captured", "ready with")


def start(model: Path, cache_dir: Path, port: int, log_path: Path) -> dict:
    """Start `fish-sm serve MODEL`, wait for a healthy /ping, send one streamed request, stop it."""
    env = {**os.environ, "FISH_SM_CACHE_DIR": str(cache_dir)}
    log = open(log_path, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fish_sm.cli", "serve", str(model), "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    healthy = None
    try:
        while proc.poll() is None and time.perf_counter() - t0 < 900:
            try:
                with urllib.request.urlopen(url + "/ping", timeout=2) as r:
                    if r.status == 200:
                        healthy = time.perf_counter() - t0
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        first = status = None
        if healthy is not None:
            body = json.dumps({"text": "Hello there, this is the first request.", "stream": True,
                               "max_new_tokens": 60, "seed": 1}).encode()
            req = urllib.request.Request(url + "/invocations", data=body, headers={"Content-Type": "application/json"})
            t1 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=120) as r:
                status = r.status
                r.read(1)
                first = time.perf_counter() - t1
                r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    lines = [line.strip() for line in open(log_path) if any(m in line for m in LOG_MARKS)]
    return {"ping_healthy_s": healthy, "first_request_status": status, "first_audio_s": first, "log": lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ping-time"))
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--cache", type=Path, help="a FISH_SM_CACHE_DIR a server already filled: no cold start, "
                    "the package gets its cache")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    results = []
    cold_cache = args.cache or work / "cache-cold"
    if args.cache is None:
        cold = {"start": "cold", **start(args.checkpoint, cold_cache, args.port, work / "cold.log")}
        print(json.dumps(cold), flush=True)
        results.append(cold)
    # The package as SageMaker unpacks model.tar.gz into /opt/ml/model (no tarball in between).
    from fish_sm.package.build import build_package_dir

    built = next(p.parent for p in cold_cache.glob("*/cache.json"))  # FISH_SM_CACHE_DIR/<device>
    unpacked = work / "model"
    shutil.rmtree(unpacked, ignore_errors=True)
    build_package_dir(args.checkpoint, unpacked, None, built)
    packaged = {"start": "package with its compile cache",
                **start(unpacked, work / "cache-fresh", args.port, work / "packaged.log")}
    print(json.dumps(packaged), flush=True)
    results.append(packaged)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ping_time.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

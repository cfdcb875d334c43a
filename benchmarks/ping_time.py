"""How soon the batching server answers `/ping` healthy: a cold start (empty compile cache),
then a start from a package directory built with that compile cache (as `fish-sm package --compile-cache`
builds it and SageMaker unpacks it, with a fresh FISH_SM_CACHE_DIR), each followed by one
streamed request to show it serves. Settings come from the environment (FISH_SM_MAX_BATCH,
FISH_SM_MAX_SEQ_LEN, ...), as a deployed server takes them.

    python benchmarks/ping_time.py CHECKPOINT [--cache FISH_SM_CACHE_DIR] [--work DIR] [--port 8091] [--out DIR]
        [--steady 1,256 [--steady-requests N] [--max-new-tokens 200]]

One JSON line per start (seconds to a healthy /ping, the server's own log lines about its
slots and graphs, the first request's status and first audio); DIR/ping_time.json.

Python's bytecode: our image's `pip install` writes every module's `.pyc`, so a container
imports torch from bytecode; a machine whose packages were installed without it (`pip install
--no-compile`, or PYTHONDONTWRITEBYTECODE) compiles torch's sources at every start instead
(seconds on every process, every start). By default (`--bytecode image`) the script first
compiles every module on the server's path into DIR/pycache and starts the servers with
PYTHONPYCACHEPREFIX pointing there, as the image would run; `--bytecode as-is` starts them as
the machine is.

`--steady LEVELS`: after the first request, each packaged start also waits until its server
logs every graph captured (the decode steps' and the codec's: `FISH_SM_CAPTURE=early` captures
them while serving), then runs `fish-sm bench --stream` at each of those concurrencies (a level
of N streams sends max(N, --steady-requests) requests); and the package is started once more
with `FISH_SM_CAPTURE=all` (every graph before `/ping`) for the same bench: the speed after a
fast start against a slow one. Those servers run with pacing off (`FISH_SM_STREAM_HORIZON_S=0`):
paced, a stream is made at real time once its listener has two seconds buffered, and the bench
would time playback, not the server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LOG_MARKS = ("slots of", "captured", "every graph captured", "ready with")
# What a server logs at start about the graphs it leaves for later, and once each kind is all in.
LEFT = re.compile(r"(\d+) decode and (\d+) codec shapes more once serving")
ALL_CAPTURED = ("batching: every graph captured", "codec: every graph captured")


def all_captured(log_path: Path, proc: subprocess.Popen, t0: float, timeout_s: float) -> float | None:
    """Seconds from the start until the server's log says every graph it left for later is
    captured (at once when it left none, as on a CPU; None: not within `timeout_s`, or the
    server ended)."""
    while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
        text = log_path.read_text(errors="replace")
        left = LEFT.search(text)
        if all(mark in text for mark, n in zip(ALL_CAPTURED, left.groups() if left else (0, 0)) if int(n)):
            return time.perf_counter() - t0
        time.sleep(0.5)
    return None


def steady(url: str, levels: str, requests: int, max_new_tokens: int, out: Path) -> list[dict]:
    """`fish-sm bench --stream` against the server, a level at a time (max(level, `requests`)
    requests each): each level's audio seconds a second and first audio."""
    results = []
    for level in (int(n) for n in levels.split(",")):
        level_out = out / f"level-{level}"
        subprocess.run([sys.executable, "-m", "fish_sm.cli", "bench", "--url", url, "--stream", "--concurrency",
                        str(level), "--requests", str(max(level, requests)), "--max-new-tokens", str(max_new_tokens),
                        "--seed", "1", "-o", str(level_out)], check=True, stdout=subprocess.DEVNULL)
        report = json.loads((level_out / "bench.json").read_text())
        results += [{"concurrency": lv["concurrency"], "requests": lv["requests"],
                     "audio_s_per_s": round(lv["audio_seconds_per_wall_second"], 2),
                     "first_audio_ms_p50": lv["first_audio_ms"]["p50"], "error_rate": lv["error_rate"]}
                    for lv in report["levels"]]
    return results


def compile_bytecode(prefix: Path) -> dict:
    """Every module on this interpreter's path (the standard library, site-packages, ours)
    compiled to bytecode under `prefix` (PYTHONPYCACHEPREFIX: Python then reads bytecode only
    there), as the image's `pip install` writes it beside the sources."""
    shutil.rmtree(prefix, ignore_errors=True)
    roots = [p for p in dict.fromkeys(sys.path) if p and Path(p).is_dir()]
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *roots],
                         env={**os.environ, "PYTHONPYCACHEPREFIX": str(prefix)}, capture_output=True, text=True)
    files = sum(1 for _ in prefix.rglob("*.pyc"))
    return {"bytecode": "image", "pycache_prefix": str(prefix), "compiled_s": round(time.perf_counter() - t0, 1),
            "pyc_files": files, "compileall_status": run.returncode}  # (a few test files fail to compile: status 1)


READY = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO fish_sm\.serving: (\S+) ready with \d+ slots "
                   r"in ([\d.]+) s \((.*)\)$")


def cores(log_path: Path, launched: float) -> list[dict]:
    """Each engine core's start from its log line "DEVICE ready with N slots in T s (phase X s, ...)":
    when its process began, in seconds after `fish-sm serve` was launched (the front end's part:
    its imports, and the core's process start), and its phases (the "start" phase: the core's
    interpreter, imports and CUDA context; "verify": what it then waited for the front end's
    verification, and its own check)."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        m = READY.match(line.strip())
        if m:
            stamp, ms, device, total, phases = m.groups()
            ready = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
            out.append({"device": device, "process_began_s": round(ready - float(total) - launched, 2),
                        "phases": {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", phases)}})
    return out


def start(model: Path, cache_dir: Path, port: int, log_path: Path, bench: dict | None = None,
          capture: str | None = None, pycache: Path | None = None) -> dict:
    """Start `fish-sm serve MODEL`, wait for a healthy /ping, send one streamed request; with
    `bench` (`steady`'s arguments but the URL), wait for every graph, then bench it; stop it.
    `pycache`: PYTHONPYCACHEPREFIX for the server (`compile_bytecode`)."""
    env = {**os.environ, "FISH_SM_CACHE_DIR": str(cache_dir)}
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if bench is not None:  # the server's speed, not the listeners' playback (see the module's doc)
        env["FISH_SM_STREAM_HORIZON_S"] = "0"
    if capture:
        env["FISH_SM_CAPTURE"] = capture
    result: dict = {}
    log = open(log_path, "w")
    launched, t0 = time.time(), time.perf_counter()
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
        if healthy is not None and bench is not None:
            done = all_captured(log_path, proc, t0, 900) if capture != "all" else healthy
            result = {"all_captured_s": done, "steady": steady(url, **bench)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    lines = [line.strip() for line in open(log_path) if any(m in line for m in LOG_MARKS)]
    return {"ping_healthy_s": healthy, "first_request_status": status, "first_audio_s": first, **result,
            "cores": cores(log_path, launched), "log": lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ping-time"))
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--cache", type=Path, help="a FISH_SM_CACHE_DIR a server already filled: no cold start, "
                    "the package gets its cache")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--steady", metavar="LEVELS", help="concurrencies to bench once every graph is captured, "
                    "and against a start that captures them all first (FISH_SM_CAPTURE=all), e.g. 1,256")
    ap.add_argument("--steady-requests", type=int, default=32,
                    help="requests per --steady level, at least the level's concurrency")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="frames per --steady request")
    ap.add_argument("--bytecode", choices=("image", "as-is"), default="image",
                    help="image: the servers import from bytecode compiled first, as in our image (see above)")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    results = []
    pycache = None
    if args.bytecode == "image":
        pycache = work / "pycache"
        bytecode = compile_bytecode(pycache)
        print(json.dumps(bytecode), flush=True)
        results.append(bytecode)
    cold_cache = args.cache or work / "cache-cold"
    if args.cache is None:
        cold = {"start": "cold", **start(args.checkpoint, cold_cache, args.port, work / "cold.log", pycache=pycache)}
        print(json.dumps(cold), flush=True)
        results.append(cold)
    # The package as SageMaker unpacks model.tar.gz into /opt/ml/model (no tarball in between).
    from fish_sm.package.build import build_package_dir

    # FISH_SM_CACHE_DIR/<device>; none on a CPU, which compiles nothing (the package then has no cache)
    built = next((p.parent for p in cold_cache.glob("*/cache.json")), None)
    unpacked = work / "model"
    shutil.rmtree(unpacked, ignore_errors=True)
    build_package_dir(args.checkpoint, unpacked, None, built)
    bench = None
    if args.steady:
        bench = {"levels": args.steady, "requests": args.steady_requests, "max_new_tokens": args.max_new_tokens,
                 "out": work / "bench-early"}
    label = "package with its compile cache" if built is not None else "package"
    packaged = {"start": label,
                **start(unpacked, work / "cache-fresh", args.port, work / "packaged.log", bench, pycache=pycache)}
    print(json.dumps(packaged), flush=True)
    results.append(packaged)
    if bench is not None:
        shutil.rmtree(work / "cache-all", ignore_errors=True)
        everything = {"start": f"{label}, FISH_SM_CAPTURE=all",
                      **start(unpacked, work / "cache-all", args.port, work / "packaged-all.log",
                              {**bench, "out": work / "bench-all"}, capture="all", pycache=pycache)}
        print(json.dumps(everything), flush=True)
        results.append(everything)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ping_time.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

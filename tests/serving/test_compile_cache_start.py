"""A start from a packaged compile cache against the start that filled it (issue 44; GPU): each
in a process of its own, as servers start, the second from the package `fish-sm package
--compile-cache` builds with the first's cache, into an empty cache directory of its own. It
compiles nothing (every inductor graph a cache hit), and its graphs give the codes and audio of
the freshly compiled ones, bit for bit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# One start (`serving.core.start_engine`, as an engine core starts), then requests one after
# another (each alone in its steps, so both starts run the same graphs on the same rows).
START_AND_SERVE = r"""
import json, logging, sys
from pathlib import Path

import numpy as np
from torch._dynamo.utils import counters

from fish_sm.engine.batching import Job
from fish_sm.engine.sampling import SamplingParams
from fish_sm.serving.core import start_engine
from fish_sm.settings import Settings

model_dir, device, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.INFO)  # the compile cache's status line
model, batcher = start_engine(model_dir, device, Settings.from_env())
texts = ["Hello there.", "A somewhat longer sentence, so that more frames come out.", "Short.", "One more!"]
results = [batcher.submit(Job(text, params=SamplingParams(seed=i, max_new_tokens=24), stream=i % 2 == 0)).result()
           for i, text in enumerate(texts)]
batcher.stop()
np.savez(out, **{f"codes{i}": r.codes.cpu().numpy() for i, r in enumerate(results)},
         **{f"audio{i}": r.audio for i, r in enumerate(results)})
print("RESULT " + json.dumps({"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
                             "timings": model.timings}))
"""


def start_and_serve(model_dir, device: str, cache_dir, out) -> dict:
    env = {**os.environ, "FISH_SM_CACHE_DIR": str(cache_dir), "FISH_SM_CAPTURE": "all", "FISH_SM_MAX_BATCH": "8",
           "FISH_SM_MAX_SEQ_LEN": "512", "FISH_SM_BENCHMARK_LENGTHS": "true"}
    run = subprocess.run([sys.executable, "-c", START_AND_SERVE, str(model_dir), device, str(out)], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
    return {**json.loads(line[7:]), "log": run.stderr}


def test_a_start_from_a_packaged_compile_cache_compiles_nothing_and_replays_the_fresh_start_s_codes(
        tiny_checkpoint, tmp_path):
    from fish_sm.package.build import build_package_dir

    device = "cuda:0"
    fresh = start_and_serve(tiny_checkpoint, device, tmp_path / "cache", tmp_path / "fresh.npz")
    assert fresh["inductor"].get("fxgraph_cache_miss", 0) > 0  # it did compile
    package = tmp_path / "package"
    build_package_dir(tiny_checkpoint, package, None, tmp_path / "cache" / device.replace(":", ""))
    packaged = start_and_serve(package, device, tmp_path / "cache-of-the-packaged-start", tmp_path / "packaged.npz")
    assert "packaged cache loaded" in packaged["log"], packaged["log"][-3000:]
    hits = packaged["inductor"].get("fxgraph_cache_hit", 0) + packaged["aot_autograd"].get("autograd_cache_hit", 0)
    assert packaged["inductor"].get("fxgraph_cache_miss", 0) == 0 and hits > 0, packaged
    a, b = np.load(tmp_path / "fresh.npz"), np.load(tmp_path / "packaged.npz")
    assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    assert all(a[k].size for k in a.files if k.startswith("audio"))

"""The persisted kernel cache: seeded from the package when it fits this machine, else ignored."""

import json
import os

import torch

from fish_sm.serving.compile_cache import META, CompileCache, build_info


def test_matching_cache_is_copied_to_the_writable_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    packaged = tmp_path / "pkg" / "compile_cache"
    (packaged / "fxgraph").mkdir(parents=True)
    (packaged / "fxgraph" / "entry").write_text("kernel")
    (packaged / META).write_text(json.dumps(build_info(torch.device("cpu"))))
    cache = CompileCache(packaged, tmp_path / "writable", verified=True)
    assert cache.activate(torch.device("cpu")).startswith("packaged cache loaded")
    assert (tmp_path / "writable" / "fxgraph" / "entry").read_text() == "kernel"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "writable")
    cache.save()
    assert json.loads((tmp_path / "writable" / META).read_text())["torch"] == torch.__version__


def test_cache_for_another_machine_is_reported_and_ignored(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    packaged = tmp_path / "compile_cache"
    (packaged / "fxgraph").mkdir(parents=True)
    (packaged / "fxgraph" / "entry").write_text("kernel")
    other = {**build_info(torch.device("cpu")), "torch": "2.6.0+cu124", "gpu_arch": "sm_86"}
    (packaged / META).write_text(json.dumps(other))
    cache = CompileCache(packaged, tmp_path / "writable", verified=True)
    status = cache.activate(torch.device("cpu"))
    assert "ignored" in status and "torch '2.6.0+cu124'" in status and "gpu_arch 'sm_86'" in status
    assert not (tmp_path / "writable" / "fxgraph").exists()
    # The same architecture on another GPU model, or another CUDA: compiled afresh too.
    for key, value in (("gpu_name", "NVIDIA H100 80GB HBM3"), ("cuda", "12.4")):
        (packaged / META).write_text(json.dumps({**build_info(torch.device("cpu")), key: value}))
        status = CompileCache(packaged, tmp_path / "writable", verified=True).activate(torch.device("cpu"))
        assert status.startswith("packaged cache ignored") and f"{key} {value!r} != None" in status

"""The compiled-kernel cache: written by a first start, shipped in the package, reused after.

Inductor and Triton write their caches under one directory (`TORCHINDUCTOR_CACHE_DIR`);
a start that finds a matching packaged copy skips code generation and autotuning. The
packaged copy is read-only on SageMaker, so it is copied to a writable directory first,
and what the warm-up adds is kept there. `cache.json` records what the kernels were built
for; a cache for another GPU model, CUDA, torch or Triton is reported in one line and ignored.
Inductor unpickles cache entries, so the packaged copy is used only from a package whose
files were verified against its manifest (`fish_sm.package.verify`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from fish_sm.package.build import COMPILE_CACHE_META as META

logger = logging.getLogger("fish_sm.serving")


def build_info(device) -> dict:
    import torch

    info = {"torch": torch.__version__, "device_type": device.type}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        info.update(gpu_arch=f"sm_{major}{minor}", gpu_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def mismatch(found: dict, wanted: dict) -> list[str]:
    """What differs between the machine a cache was built on and this one. The GPU model, not
    only its architecture: kernels tuned on one model are not the fastest on another of the same
    architecture (an H100's on an H200)."""
    keys = ("torch", "device_type", "gpu_arch", "gpu_name", "cuda", "triton")
    return [f"{k} {found.get(k)!r} != {wanted.get(k)!r}" for k in keys if found.get(k) != wanted.get(k)]


class CompileCache:
    def __init__(self, packaged: Path, writable: Path, *, verified: bool):
        self.packaged, self.writable = packaged, writable
        self.verified = verified  # the package's files matched its manifest.json
        self.status = "not used"
        self.info: dict = {}

    def activate(self, device) -> str:
        """Point inductor at the writable cache, seeded from the package when it fits this machine."""
        self.info = build_info(device)
        self.writable.mkdir(parents=True, exist_ok=True)
        meta = self.packaged / META
        if not self.verified and os.path.lexists(self.packaged):
            self.status = (f"packaged cache not used: {self.packaged} is not in a verified package "
                           "(no manifest.json), and torch unpickles its entries")
            logger.warning(self.status)
        elif meta.is_file():
            found = json.loads(meta.read_text())
            problems = mismatch(found, self.info)
            if problems:
                self.status = "packaged cache ignored: built for another machine (" + "; ".join(problems) + ")"
                logger.warning(self.status)
            else:
                shutil.copytree(self.packaged, self.writable, dirs_exist_ok=True)
                self.status = f"packaged cache loaded ({_size(self.packaged) / 1e6:.1f} MB)"
                logger.info(self.status)
        else:
            self.status = "no packaged cache; compiling from scratch"
            logger.info(self.status)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.writable)
        os.environ.setdefault("TRITON_CACHE_DIR", str(self.writable / "triton"))
        pin_ptxas()
        return self.status

    def save(self) -> None:
        """Record what the kernels in the writable cache were built for (after the warm-up)."""
        if not self.info:
            return
        (self.writable / META).write_text(json.dumps(self.info, indent=2) + "\n")
        logger.info("compile cache at %s: %.1f MB", self.writable, _size(self.writable) / 1e6)


def pin_ptxas() -> None:
    """Point Triton at the ptxas inductor would, from the start.

    Triton's cache keys include the ptxas that builds a kernel. On its first compile in a
    process, inductor sets `TRITON_PTXAS_PATH` to the ptxas shipped with torch (if there is
    one) for the rest of the process: a first start does compile, a warm start finds
    everything cached and never does. Our own Triton kernels (`row_products`,
    `decode_attention`, `sampling`) built at a first start would then miss at every
    warm start and be built again (~12 s of a 31 s start on an H100)."""
    try:  # inductor's own (private) setter: the same path it would set later
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:
        return
    _set_triton_ptxas_path()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

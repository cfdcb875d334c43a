"""Programmatic dependent launch (PDL) for our own Triton kernels.

On Hopper and later, a kernel launched with PDL starts while the one before it drains: it
reads what does not depend on that one (weights, tables), then waits inside (`gdc_wait`)
before reading what it wrote. A one-row decode step is ~400 small kernels whose fixed costs
are most of its time, so overlapping each one's start with the last one's end matters.
Older GPUs, and a Triton without the launch option (the stock inference container's),
launch as usual.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda, "gdc_wait")


def dependent_launch(device: torch.device) -> tuple[bool, dict]:
    """(whether kernels on `device` use PDL: the kernels' PDL flag, their launch options)."""
    pdl = _triton_has_pdl() and torch.cuda.get_device_capability(device)[0] >= 9
    return pdl, ({"launch_pdl": True} if pdl else {})

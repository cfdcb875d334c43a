"""`torch.compile` as the decode step's functions use it: inductor's options for steps of one
row and of several."""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

# One row: coordinate-descent tuning turns a one-row matmul into a tuned Triton reduction with
# the norm, SwiGLU and residual add around it fused in; not the static launcher, which torch
# 2.11 reloads from the compile cache without the tuned configs (so it tunes at every start);
# programmatic dependent launch (Hopper and later), so each of a frame's small kernels starts
# while the one before drains.
ONE_ROW_OPTIONS = MappingProxyType(
    {"coordinate_descent_tuning": True, "use_static_cuda_launcher": False, "triton.enable_pdl": True})
# Not with INT8 weights: dependent launch made torchao's dequantizing reductions slower.
NOT_WITH_INT8 = ("triton.enable_pdl",)
# Several rows: matmuls stay with cuBLAS (tuning would be redone for every batch size at
# start), and no dependent launch, which made 32 and 64 streams slower.
MANY_ROWS_OPTIONS = MappingProxyType({})


def _has_option(config, name: str) -> bool:
    for part in name.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def rows_dynamic(*tensors: torch.Tensor | None) -> None:
    """Mark dim 0 (the rows) of each tensor dynamic before a call of a several-row compiled
    function: its first compile then serves every batch size. Unmarked, dynamo compiles the
    first batch size it sees and, at the second, everything again for any size: a second
    compile of every several-row function in a cold start."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def compile_decode(fn, one_row: bool, tune: bool = True, int8: bool = False, one_row_options=ONE_ROW_OPTIONS,
                   many_rows_options=MANY_ROWS_OPTIONS, not_with_int8=NOT_WITH_INT8, rows_first: bool = False):
    """`torch.compile` of a decode step's function: for one row, static shapes and
    `one_row_options` (without the tuning if not `tune`, without `not_with_int8` for a model
    with INT8 weights); for several, one graph for any number and `many_rows_options`.
    `rows_first`: every tensor argument of `fn` has its rows first, and the function returned
    marks them dynamic at each call (`rows_dynamic`); a several-row function with other
    arguments has its callers mark its rows."""
    from torch._inductor import config

    options = dict(one_row_options if one_row else many_rows_options)
    if not tune:
        options.pop("coordinate_descent_tuning", None)
    if int8:
        options = {k: v for k, v in options.items() if k not in not_with_int8}
    # An option this torch lacks is left out (torch.compile would refuse it): the stock
    # inference container's torch 2.6 has no static launcher to turn off.
    options = {k: v for k, v in options.items() if _has_option(config, k)}
    compiled = torch.compile(fn, fullgraph=True, dynamic=False if one_row else None, options=options)
    if one_row or not rows_first:
        return compiled

    @functools.wraps(fn)
    def rows_marked(*args, **kwargs):
        rows_dynamic(*(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)))
        return compiled(*args, **kwargs)

    return rows_marked

"""`install`: the one place the decode step's fast paths go into a model."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch

from fish_sm.kernels import sampling
from fish_sm.kernels.compile import compile_decode
from fish_sm.kernels.modules import KernelBlock, KernelDualAR, uses_row_products
from fish_sm.kernels.quantize import quantized
from fish_sm.model.dual_ar import DualARTransformer, TransformerBlock

# What `install` puts in place: EAGER, the kernels that need no compiling; SEQUENTIAL, also the
# decode step's layers compiled (steps of one row and of several); BATCHING, also prompts of
# any batch and length compiled (the batching engine's admissions).
EAGER, SEQUENTIAL, BATCHING = "eager", "sequential", "batching"

# How many products ahead a one-row product's kernel starts streaming weights into L2 (0:
# none), by weight type: bf16's products read twice the bytes, and its prefetches competed
# with the reads the kernel in flight waits on.
PREFETCH_AHEAD = MappingProxyType({"bf16": 0, "int8": 1})


class Installed(NamedTuple):
    rows: bool  # decode steps of one row run on the row-product kernels
    picks: bool  # the sampling kernels run on the model's device


def install(model: DualARTransformer, mode: str = EAGER, rows: bool | None = None,
            prefetch_ahead: Mapping[str, int] = PREFETCH_AHEAD, compile_options: Mapping = MappingProxyType({})
            ) -> Installed:
    """Put the fast paths for `mode` into `model`, in place (the engines hold it): its blocks
    become `KernelBlock`s sharing their modules, the model a `KernelDualAR`. Parameters,
    buffers, state-dict names and KV caches stay as they are; installing again replaces what
    an earlier call installed.

    With SEQUENTIAL or BATCHING, the per-layer work of a decode step around attention (norms,
    projections, QK-norm, RoPE and the cache write before it; the rest after) is compiled once
    for all slow layers and once for all fast ones (the same code and shapes share graphs), so
    no graph depends on the attention length; steps of one row and of several apart. `rows`:
    steps of one row on the row-product kernels instead, nothing compiled for them (None:
    where `uses_row_products`); INT8 weights are then read by those kernels, not torchao's.
    Steps of several rows run wo and w2 as `split_products` kernels where their weights are
    plain (not torchao's INT8) and the rows few (`split_products.MOST_SPLIT_ROWS`). BATCHING
    also compiles the slow layers for prompts of any batch and length: the admissions, which
    otherwise launch ~2,700 kernels one by one from Python while every active stream waits.
    `prefetch_ahead`: see `PREFETCH_AHEAD`; `compile_options`: keyword arguments of every
    `compile_decode` call (its inductor options)."""
    device = model.norm.weight.device
    if mode == EAGER:
        _replace_blocks(model, lambda block, slow: KernelBlock(block))
        _as_kernel_model(model, rows=False)
        return Installed(False, sampling.usable(device))
    if mode not in (SEQUENTIAL, BATCHING):
        raise ValueError(f"unknown mode {mode!r}; choose one of {EAGER}, {SEQUENTIAL}, {BATCHING}")
    # One cache entry per layer shape and weight type (bf16, int8), per engine in this process.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    int8 = quantized(model)
    rows = uses_row_products(model) if rows is None else rows
    halves = KernelBlock._pre_attention_writing, TransformerBlock._post_attention
    one_row = None if rows else tuple(compile_decode(f, True, int8=int8, **compile_options) for f in halves)
    split = all(KernelBlock.split_products_readable(b) for b in [*model.layers, *model.fast_layers])
    many = (halves[0], KernelBlock._post_attention_split if split else halves[1])
    compiled = (one_row, tuple(compile_decode(f, False, int8=int8, **compile_options) for f in many))
    prefill = None
    if mode == BATCHING:
        prefill = (torch.compile(TransformerBlock._pre_attention, fullgraph=True, dynamic=True),
                   torch.compile(TransformerBlock._post_attention, fullgraph=True, dynamic=True))
    _replace_blocks(model, lambda block, slow: KernelBlock(block, compiled, prefill if slow else None, rows, split))
    _as_kernel_model(model, rows)
    if rows:
        model.attach_heads()
        model.chain_row_weights(prefetch_ahead["int8" if int8 else "bf16"])
        model.step_inputs_compiled = compile_decode(DualARTransformer.step_inputs, True, **compile_options)
    return Installed(rows, sampling.usable(device))


def _replace_blocks(model: DualARTransformer, make) -> None:
    for blocks, slow in ((model.layers, True), (model.fast_layers, False)):
        for i, block in enumerate(blocks):
            blocks[i] = make(block, slow)


def _as_kernel_model(model: DualARTransformer, rows: bool) -> None:
    """The model as a `KernelDualAR`, in place: the engines hold this object (a new one would
    leave theirs without the fast paths). As `torch.nn.utils.parametrize` does, only the class
    changes; its modules and tensors stay."""
    model.__class__ = KernelDualAR
    model.row_steps = rows
    model.step_inputs_compiled = None

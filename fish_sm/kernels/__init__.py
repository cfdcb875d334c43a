"""The decode step's fast paths (our Triton kernels, compiled halves, INT8 weights) and the one
place they go into a model: the engine uses this module, nothing else imports the kernel
modules beneath it. Each kernel module imports Triton only if it is there (CPU builds of
torch come without it) and runs the same arithmetic in torch where its kernel cannot run."""

from fish_sm.kernels.compile import compile_decode
from fish_sm.kernels.dispatch import BATCHING, EAGER, SEQUENTIAL, Installed, install, uses_row_products
from fish_sm.kernels.lora import AdapterSlots, adapted
from fish_sm.kernels.quantize import Int8Embedding, quantize_int8, quantized
from fish_sm.kernels.sampling import (exponential_noise, noise_key, noise_keys, pick_head_kernels,
                                      pick_residual_kernels, usable as sampling_usable)

__all__ = ["BATCHING", "EAGER", "SEQUENTIAL", "AdapterSlots", "Installed", "Int8Embedding", "adapted",
           "compile_decode", "exponential_noise", "install", "noise_key", "noise_keys", "pick_head_kernels",
           "pick_residual_kernels", "quantize_int8", "quantized", "sampling_usable", "uses_row_products"]

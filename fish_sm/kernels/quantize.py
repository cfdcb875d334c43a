"""INT8 weight-only quantization of the transformer, done from outside it: torchao's INT8
weights in place of the linear layers' and `Int8Embedding` in place of the two large
embedding tables."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fish_sm.errors import FishSMError
from fish_sm.model.dual_ar import DualARTransformer


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 with one scale per row (symmetric, weight-only).

    A lookup gathers its rows and scales only those: torchao's quantized tensors implement
    `embedding` by dequantizing the whole table first, 160 M values for the token table on
    every decode step."""

    def __init__(self, weight: Tensor):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.qweight = nn.Parameter(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.qweight[ids].to(self.scale.dtype) * self.scale[ids].unsqueeze(-1)


def quantize_int8(model: DualARTransformer) -> None:
    """INT8 weight-only quantization of the transformer's linear layers (torchao) and of its
    token and codebook embeddings (`Int8Embedding`), in place. The fast head stays as it is:
    read nine times a frame at one row, its INT8 product was far slower than bf16's."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise FishSMError("INT8 quantization needs torchao matching this torch (pip install torchao), "
                          "or turn it off (FISH_SM_QUANTIZE=none)") from None
    # Not torchao's process-wide inductor settings: the decode step sets its own
    # (`compile.ONE_ROW_OPTIONS`), and the codec's compile should not inherit them.
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False),
              filter_fn=lambda m, _: isinstance(m, nn.Linear) and m is not model.fast_output)
    for name in ("embeddings", "codebook_embeddings"):
        setattr(model, name, Int8Embedding(getattr(model, name).weight))


def quantized(model: DualARTransformer) -> bool:
    """The model's projections hold INT8 weights (torchao's tensors in place of their weights)."""
    return type(model.layers[0].attention.wqkv.weight) is not nn.Parameter

"""LoRA adapters of upstream fine-tunes: which tensors an adapter has, reading them checked by
name and shape against the base model, and the packaged form fish-sm serves them from.

Upstream (`fish_speech/models/text2semantic/lora.py`, loralib) puts rank-r adapters on the
three embeddings, the output head, the fast head and every linear layer of both transformers.
For a linear layer with weight W [out, in]: lora_A [r, in], lora_B [out, r], and the output
gains x·Aᵀ·Bᵀ·alpha/r. For an embedding with weight [num, dim]: lora_A [r, num],
lora_B [dim, r], and a lookup of id t gains B·A[:, t]·alpha/r. Merging (upstream's
`merge_lora`) is W + B·A·alpha/r (an embedding's: its transpose). alpha is not stored in the
weights: upstream's `configs/lora/r_8_alpha_16.yaml` sets 16 for rank 8.

A packaged adapter is one `.safetensors` file with the rank and alpha in its metadata: read
without unpickling anything. A fine-tune's training checkpoint (a torch pickle) is read only
at package time, by torch's weights-only loader, which refuses anything but tensors.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fish_sm.contract import check_adapter_name
from fish_sm.errors import AdapterError, CheckpointError
from fish_sm.model.config import ModelConfig
from fish_sm.model.dual_ar import expected_shapes
from fish_sm.model.weights import read_state_dict, write_safetensors

# upstream configs/lora/r_8_alpha_16.yaml
DEFAULT_ALPHA = 16.0
LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
EMBEDDINGS = ("embeddings", "codebook_embeddings", "fast_embeddings")
HEADS = ("output", "fast_output")
FORMAT = "fish-sm-lora"


def check_name(name: str) -> str:
    return check_adapter_name(name, AdapterError)


def targets(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every module upstream adapts, by upstream name: (in, out) of a linear layer, or
    (num, dim) of an embedding (see `is_embedding`)."""
    shapes = expected_shapes(config)
    out = {}
    for name in EMBEDDINGS:
        out[name] = shapes[f"{name}.weight"]
    for name in HEADS:
        weight = shapes.get(f"{name}.weight", (config.vocab_size, config.dim) if name == "output" else None)
        out[name] = (weight[1], weight[0])
    for stack, n in (("layers", config.n_layer), ("fast_layers", config.n_fast_layer)):
        for i in range(n):
            for linear in LINEARS:
                out_features, in_features = shapes[f"{stack}.{i}.{linear}.weight"]
                out[f"{stack}.{i}.{linear}"] = (in_features, out_features)
    return out


def is_embedding(target: str) -> bool:
    return target in EMBEDDINGS


def lora_shapes(target: str, dims: tuple[int, int], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(lora_A, lora_B) shapes of a target: loralib's, for a linear layer and an embedding alike
    A [r, first dim], B [second dim, r]."""
    first, second = dims
    return (rank, first), (second, rank)


@dataclass
class Adapter:
    """One LoRA fine-tune: target -> (lora_A, lora_B), upstream's orientation, float32."""

    name: str
    rank: int
    alpha: float
    pairs: dict[str, tuple[Tensor, Tensor]] = field(repr=False)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values())

    def delta(self, target: str) -> Tensor | None:
        """What merging adds to the target's weight (upstream's layout: [out, in], [num, dim])."""
        if target not in self.pairs:
            return None
        a, b = self.pairs[target]
        d = (b.double() @ a.double()) * self.scaling
        return (d.T if is_embedding(target) else d).float()


def adapter_from_state(name: str, weights: dict[str, Tensor], config: ModelConfig, alpha: float,
                       source: str) -> Adapter:
    """An adapter from upstream-named LoRA tensors (`<module>.lora_A`, `<module>.lora_B`,
    any `model.` prefix dropped), each checked; the error names the first tensor that is
    not one of the base model's LoRA tensors or not of its shape."""
    check_name(name)
    if not alpha > 0:
        raise AdapterError(f"{source}: lora_alpha must be positive, not {alpha}")
    weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}
    dims = targets(config)
    lora = {k: v for k, v in weights.items() if ".lora_" in k or k.startswith("lora_")}
    if not lora:
        base = next((k for k in weights if k.endswith(".weight")), None)
        if base is not None:
            raise AdapterError(f"{source}: holds no LoRA tensors but model weights ({base}): a merged fine-tune "
                               "is a full model; package it on its own (fish-sm package) and serve it beside the "
                               "base as another inference component (fish-sm deploy ENDPOINT --component NAME)")
        raise AdapterError(f"{source}: holds no LoRA tensors (<module>.lora_A / <module>.lora_B)")
    other = next((k for k in weights if k not in lora), None)
    if other is not None:
        raise AdapterError(f"{source}: tensor {other} is not a LoRA tensor; an adapter file holds only "
                           "lora_A/lora_B tensors (upstream saves only these from a LoRA fine-tune)")
    rank = None
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    for key in sorted(lora, key=_in_model_order(dims)):
        target, _, part = key.rpartition(".")
        if target not in dims or part not in ("lora_A", "lora_B"):
            raise AdapterError(f"{source}: tensor {key} is not a LoRA tensor of this model "
                               f"(expected <module>.lora_A/.lora_B for a module such as layers.0.attention.wqkv)")
        t = lora[key]
        if not t.is_floating_point() or t.dim() != 2:
            raise AdapterError(f"{source}: tensor {key} must be a 2-D float tensor, not {t.dtype} {tuple(t.shape)}")
        if rank is None:
            rank = t.shape[0] if part == "lora_A" else t.shape[1]
            if not 1 <= rank <= 256:
                raise AdapterError(f"{source}: tensor {key} has rank {rank}; ranks 1-256 are served")
        expected = lora_shapes(target, dims[target], rank)[part == "lora_B"]
        if tuple(t.shape) != expected:
            raise AdapterError(f"{source}: tensor {key} has shape {tuple(t.shape)}, expected {expected} "
                               f"(rank {rank})")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{source}: tensor {key} holds NaN or infinite values")
        if part == "lora_A":
            partner = f"{target}.lora_B"
            if partner not in lora:
                raise AdapterError(f"{source}: tensor {key} has no {partner}")
            pairs[target] = (t.float().contiguous(), lora[partner].float().contiguous())
        elif f"{target}.lora_A" not in lora:
            raise AdapterError(f"{source}: tensor {key} has no {target}.lora_A")
    return Adapter(name, rank, float(alpha), pairs)


def _in_model_order(dims: dict):
    order = {name: i for i, name in enumerate(dims)}
    return lambda key: (order.get(key.rpartition(".")[0], len(order)), key)


def read_fine_tune(path: str | Path, name: str, config: ModelConfig, alpha: float | None = None) -> Adapter:
    """An adapter from a fine-tune's file (package time): upstream's training checkpoint
    (`{"state_dict": {"model.<module>.lora_A": ...}}`), a `.pth` of only the LoRA tensors, or
    a `.safetensors` (ours, or any with upstream's names). Torch pickles go through torch's
    weights-only loader: a file holding anything but tensors is refused, never run. alpha:
    the fine-tune's lora_alpha (the file's own metadata wins; else 16, upstream's default)."""
    path = Path(path)
    source = str(path)
    check_name(name)
    if path.suffix == ".safetensors":
        meta = read_metadata(path)
        if alpha is None and "alpha" in meta:
            alpha = _float(meta["alpha"], source)
    try:
        weights = read_state_dict(path)
    except CheckpointError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found:
            raise AdapterError(f"{source}: holds Python objects ({found.group(1)}), not only tensors; not read. Save "
                               "only the LoRA tensors: torch.save({k: v for k, v in ckpt['state_dict'].items() "
                               "if 'lora' in k}, 'lora.pth')") from None
        raise AdapterError(_one_line(str(exc))) from None
    return adapter_from_state(name, weights, config, DEFAULT_ALPHA if alpha is None else alpha, source)


def read_packaged(path: str | Path, name: str, config: ModelConfig) -> Adapter:
    """A packaged adapter (serve time): only our `.safetensors` form is read, so nothing is
    unpickled, whatever the file holds."""
    path = Path(path)
    source = str(path)
    if path.suffix != ".safetensors":
        raise AdapterError(f"{source}: a served adapter is a .safetensors file written by fish-sm package "
                           "(torch pickles are not read at serve time)")
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"PK" or head[:1] == b"\x80":  # a torch zip, a pickle's PROTO opcode
            raise AdapterError(f"{source}: is a torch pickle, not safetensors; not read")
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{source}: not a fish-sm adapter (metadata format {meta.get('format')!r}); "
                           "package it with fish-sm package --adapter")
    try:
        weights = read_state_dict(path)
    except CheckpointError as exc:
        raise AdapterError(_one_line(str(exc))) from None
    adapter = adapter_from_state(name, weights, config, _float(meta.get("alpha"), source), source)
    if str(adapter.rank) != meta.get("rank"):
        raise AdapterError(f"{source}: its metadata says rank {meta.get('rank')}, its tensors rank {adapter.rank}")
    return adapter


def write_packaged(adapter: Adapter, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The adapter as fish-sm serves it: upstream's tensor names, `dtype`, rank and alpha in the metadata."""
    tensors = {}
    for target, (a, b) in adapter.pairs.items():
        tensors[f"{target}.lora_A"], tensors[f"{target}.lora_B"] = a.to(dtype), b.to(dtype)
    write_safetensors(tensors, path, metadata={"format": FORMAT, "rank": str(adapter.rank),
                                               "alpha": repr(adapter.alpha)})


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's `__metadata__` (strings), {} when it has none."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise AdapterError(f"{path}: truncated safetensors file")
            (size,) = struct.unpack("<Q", head)
            if size > 100 << 20:
                raise AdapterError(f"{path}: safetensors header of {size} bytes; not read")
            header = json.loads(f.read(size))
    except AdapterError:
        raise
    except FileNotFoundError:
        raise AdapterError(f"{path}: file not found") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not a safetensors file ({type(exc).__name__})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def _float(value, source: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise AdapterError(f"{source}: lora_alpha {value!r} is not a number") from None


def _one_line(message: str) -> str:
    return " ".join(message.split())


def random_adapter(config: ModelConfig, name: str = "random", rank: int = 8, alpha: float = DEFAULT_ALPHA,
                   seed: int = 0, scale: float = 0.02) -> Adapter:
    """An adapter of random weights on every target (tests, benchmarks): unlike a fresh
    fine-tune (lora_B zero), it changes the model's outputs."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for target, dims in targets(config).items():
        sa, sb = lora_shapes(target, dims, rank)
        pairs[target] = (torch.randn(sa, generator=g) * scale, torch.randn(sb, generator=g) * scale)
    return Adapter(check_name(name), rank, alpha, pairs)

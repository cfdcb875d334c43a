"""Reading and writing state dicts in the formats the official checkpoints use.

`.pth` files are read with `torch.load(weights_only=True, mmap=True)` so a 1.7 GB
checkpoint is paged in lazily; `.safetensors` files are parsed here (the format is
an 8-byte header length, a JSON header and raw little-endian data), which saves a
dependency for a 30-line reader.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from fish_sm.errors import CheckpointError

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a flat `{name: tensor}` dict from `.pth`/`.pt`/`.bin` or `.safetensors`.

    A Lightning-style `{"state_dict": {...}}` wrapper is unwrapped. Any failure to
    parse becomes a `CheckpointError` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        if path.suffix == ".safetensors":
            weights = _read_safetensors(path)
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except Exception as exc:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"{path}: cannot read the file ({type(exc).__name__}: {exc})") from None
    if isinstance(weights, dict) and isinstance(weights.get("state_dict"), dict):
        weights = weights["state_dict"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return dict(weights)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # lazy, copy-on-write
    (header_len,) = struct.unpack("<Q", buf[:8])
    if 8 + header_len > size:
        raise CheckpointError(f"{path}: truncated safetensors header")
    header = json.loads(buf[8 : 8 + header_len])
    header.pop("__metadata__", None)
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(info["shape"])
    return out


def write_safetensors(weights: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors in the safetensors layout (tests, conversions, packaged adapters), with
    `metadata` (strings) as its `__metadata__`."""
    header, chunks, offset = ({"__metadata__": dict(metadata)} if metadata else {}), [], 0
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for c in chunks:
            f.write(c)


def strip_prefix(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Drop `prefix` from every key that has it when the first key does (Lightning checkpoints)."""
    if weights and next(iter(weights)).startswith(prefix):
        return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()}
    return weights


def take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    """Fetch one tensor and check its shape, with an error that names it."""
    if name not in weights:
        raise CheckpointError(f"{source}: missing tensor {name} (expected shape {tuple(shape)})")
    t = weights[name]
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t

"""Unmerged LoRA adapters on a model, several in one batch: every module upstream adapts is
wrapped (`LoraLinear`, `LoraEmbedding`) to add the low-rank product of the adapter that each
row of the batch names, from weights stacked over adapter slots (`lora_products`: the shrink
and expand of Punica and S-LoRA, kernels on CUDA). Slot 0 holds zeros: rows without an
adapter, for which the kernels do no work. While `AdapterSlots.without()` holds, the wrappers
add nothing: the engines capture a second set of decode graphs that way, for steps none of
whose rows has an adapter, which then run exactly the model's own products.

Which slot row b uses is entry b of one index tensor, `AdapterSlots.ids`, shared by every
wrapper; the engines fill its first B entries before running B rows, and captured CUDA graphs
read it as an input, so one graph serves any mix of adapters. alpha/r is folded into the
stacked lora_B, and the model's own layout is followed: w1 and w3 are one product (w13) with
two halves, the heads keep only the rows that may be chosen.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from fish_sm.errors import AdapterError
from fish_sm.kernels import split_products
from fish_sm.kernels.lora_products import beside_usable, lora_delta, lora_lookup, product_and_delta
from fish_sm.model.dual_ar import DualARTransformer
from fish_sm.model.lora import Adapter, is_embedding, targets

# Most rows one call may run (decode steps and admissions are far fewer).
MAX_ROWS = 4096


class Switch:
    """Whether the wrappers add the adapters' part: one object shared by all of a model's
    wrappers. Compiled code reads it as a constant (a guard), so each setting compiles and
    captures code of its own."""

    def __init__(self):
        self.on = True


class Adapted(nn.Module):
    """A module (`base`) plus each row's adapter (`delta`), with the weights stacked over slots as
    buffers, the rows' slots in `ids`, and whether to add them at all in `switch`."""

    def __init__(self, base: nn.Module, ids: Tensor, switch: Switch, **stacked: Tensor):
        super().__init__()
        self.base, self.switch = base, switch
        for name, t in stacked.items():
            self.register_buffer(name, t, persistent=False)
        self.register_buffer("ids", ids, persistent=False)

    @property
    def weight(self) -> Tensor:  # what kernels that read the weight directly see (the base's)
        return self.base.weight

    @property
    def adds(self) -> bool:
        """The adapters' part is added (not within `AdapterSlots.without()`)."""
        return self.switch.on

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        return y + self.delta(x) if self.adds else y

    def delta(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class LoraLinear(Adapted):
    """A linear layer plus each row's adapter: x·Aᵀ·Bᵀ (B scaled by alpha/r). `lora_a` [slots,
    parts·r, in], `lora_b` [slots, parts, out/parts, r]: a product of `parts` stacked halves (w13:
    w1's, then w3's) has one rank-r pair per half."""

    def __init__(self, base: nn.Module, a: Tensor, b: Tensor, ids: Tensor, switch: Switch):
        super().__init__(base, ids, switch, lora_a=a, lora_b=b)

    @property
    def bias(self):
        return self.base.bias

    @property
    def parts(self) -> int:
        return self.lora_b.shape[1]

    def stacked_b(self) -> Tensor:
        """lora_b as [slots, out, r], the halves one after the other."""
        slots, parts, out, rank = self.lora_b.shape
        return self.lora_b.view(slots, parts * out, rank)

    def forward(self, x: Tensor) -> Tensor:
        if self.adds and self.base.bias is None and beside_usable(x, self.base.weight):
            y, delta = product_and_delta(x, self.base.weight, *self._adapters(x))
            return y + delta
        return super().forward(x)

    def delta(self, x: Tensor) -> Tensor:
        """The adapters' part of the output for x [B, ..., in], row b by adapter slot ids[b]."""
        rows = x.reshape(-1, x.shape[-1])
        return lora_delta(rows, *self._adapters(x)).view(*x.shape[:-1], -1)

    def _adapters(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, int, int]:
        """A, B, the rows' slots, rows a slot and halves, as `lora_delta` takes them for x [B, ..., in]."""
        per_id = x.numel() // x.shape[-1] // max(x.shape[0], 1)
        return self.lora_a, self.stacked_b(), self.ids[: x.shape[0]], per_id, self.parts

    def split(self, x: Tensor, res: Tensor, counts: Tensor) -> Tensor:
        """res + this product of x through `split_products.split_product` (tile counters
        `counts`), plus the adapters' part when added (beside it, as `forward` adds it)."""
        if self.adds and beside_usable(x, self.base.weight):
            y, delta = product_and_delta(x, self.base.weight, *self._adapters(x), res=res, counts=counts)
            return y + delta
        return with_delta(self, x, split_products.split_product(x, self.base.weight, res, counts))


class LoraEmbedding(Adapted):
    """An embedding plus each row's adapter: lookup t gains B·A[:, t] (B scaled by alpha/r).
    `lora_a_t` [slots, num, r] (A transposed, so a lookup gathers rows), `lora_b` [slots, dim, r]."""

    def __init__(self, base: nn.Module, a_t: Tensor, b: Tensor, ids: Tensor, switch: Switch):
        super().__init__(base, ids, switch, lora_a_t=a_t, lora_b=b)

    def delta(self, index: Tensor) -> Tensor:
        """The adapters' part of the lookup of index [B, ...], row b by adapter slot ids[b]."""
        n = index.shape[0]
        flat = index.reshape(-1)
        return lora_lookup(flat, self.lora_a_t, self.lora_b, self.ids[:n], flat.shape[0] // max(n, 1)).view(*index.shape, -1)


def with_delta(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """y, a product of `module`'s weight computed without it (a kernel of our own), plus the
    adapters' part when the module carries adapters that are added."""
    return y + module.delta(x) if isinstance(module, Adapted) and module.adds else y


def adapted(model: DualARTransformer) -> bool:
    """The model carries adapter slots (`AdapterSlots`)."""
    return isinstance(model.head, LoraLinear)


class AdapterSlots:
    """Room for `slots` adapters of rank up to `rank` on the model (slot 0, zeros, is 'none'),
    and the wrappers that read it, put into the model in place."""

    def __init__(self, model: DualARTransformer, slots: int, rank: int):
        if adapted(model):
            raise AdapterError("the model already carries adapter slots")
        self.model, self.slots, self.rank = model, slots, rank
        dev, dtype = model.device, model.dtype
        self.ids = torch.zeros(MAX_ROWS, dtype=torch.long, device=dev)
        self.switch = Switch()
        self._head_rows = model.head_rows().to(dev)
        self.modules: dict[str, nn.Module] = {}  # upstream target -> its wrapper
        n = slots + 1
        for target, (first, second) in _served_dims(model).items():
            owner, name, parts = self._place(target)
            base = getattr(owner, name)
            if isinstance(base, Adapted):  # w3 shares w1's wrapper
                self.modules[target] = base
                continue
            if is_embedding(target):
                wrapper = LoraEmbedding(base, torch.zeros(n, first, rank, dtype=dtype, device=dev),
                                        torch.zeros(n, second, rank, dtype=dtype, device=dev), self.ids, self.switch)
            else:
                wrapper = LoraLinear(base, torch.zeros(n, parts * rank, first, dtype=dtype, device=dev),
                                     torch.zeros(n, parts, second, rank, dtype=dtype, device=dev), self.ids, self.switch)
            setattr(owner, name, wrapper)
            self.modules[target] = wrapper
        self.bytes_per_slot = self.slot_bytes(model, rank)

    @staticmethod
    def slot_bytes(model: DualARTransformer, rank: int) -> int:
        """Bytes one adapter slot of `rank` takes on `model` (its dtype)."""
        size = torch.finfo(model.dtype).bits // 8
        return sum((first + second) * rank * size for first, second in _served_dims(model).values())

    def _place(self, target: str) -> tuple[nn.Module, str, int]:
        """Where an upstream target lives in our model: (owner module, attribute, halves)."""
        m = self.model
        if target == "output":
            return m, "head", 1
        if "." not in target:
            return m, target, 1
        stack, i, part, name = target.split(".")
        owner = getattr(getattr(m, stack)[int(i)], part)
        if name in ("w1", "w3"):
            return owner, "w13", 2
        return owner, name, 1

    def load(self, slot: int, adapter: Adapter) -> None:
        """Copy an adapter into slot (1..slots), replacing what it held; ranks below the
        slots' are padded with zeros (the same products)."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"adapter slot {slot} outside 1..{self.slots}")
        if adapter.rank > self.rank:
            raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}; this server serves ranks up to "
                               f"{self.rank} (FISH_SM_ADAPTER_RANK)")
        self.clear(slot)
        r, scale = adapter.rank, adapter.scaling
        for target, (a, b) in adapter.pairs.items():
            module = self.modules[target]
            a, b = _on(a, module.lora_b.device), _on(b, module.lora_b.device) * scale
            if isinstance(module, LoraEmbedding):
                module.lora_a_t[slot, :, :r] = a.T
                module.lora_b[slot, :, :r] = b
                continue
            if target == "output":
                b = b[self._head_rows]
            elif target == "fast_output":
                b = b[: module.lora_b.shape[2]]
            half = 1 if target.endswith("feed_forward.w3") else 0
            module.lora_a[slot, half * self.rank : half * self.rank + r] = a
            module.lora_b[slot, half, :, :r] = b

    def clear(self, slot: int) -> None:
        for module in set(self.modules.values()):
            for t in module.buffers():
                if t is not self.ids:
                    t[slot].zero_()

    @contextlib.contextmanager
    def without(self):
        """Within it, the wrappers add nothing: code compiled and graphs captured then are the
        model's own, for steps none of whose rows has an adapter."""
        self.switch.on = False
        try:
            yield
        finally:
            self.switch.on = True

    def set_rows(self, slots: Tensor) -> None:
        """Rows 0..len-1 of the next calls use these adapter slots (a tensor on any device)."""
        self.ids[: slots.shape[0]].copy_(slots, non_blocking=True)


def _on(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, queued on the current stream
    (a pageable copy would wait for the decode steps queued before it)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _served_dims(model: DualARTransformer) -> dict[str, tuple[int, int]]:
    """`targets` as the model holds them: the heads with only the rows they keep."""
    dims = dict(targets(model.config))
    dims["output"] = (dims["output"][0], model.head_rows().shape[0])
    dims["fast_output"] = (dims["fast_output"][0], model.fast_output.weight.shape[0])
    return dims

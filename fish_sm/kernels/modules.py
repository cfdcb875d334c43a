"""The transformer's classes with the decode step's fast paths: `install` (fish_sm.kernels)
puts them in place of the model's own, sharing its parameters, buffers and KV caches.

- `KernelAttention`: a masked decode step's attention over each row's live slots as the
  `decode_attention` kernel.
- `KernelBlock`: a decode step (one new position of cache rows 0..B-1) on halves compiled
  around attention; one row on the `row_products` kernels instead; several rows with wo and
  w2 as `split_products` kernels; prompts on halves compiled for any batch and length.
- `KernelDualAR`: one row's step inputs compiled into one kernel, its heads as `row_products`
  kernels with their norms, its first fast position stopping once the last layer's k/v are
  written, and the fast transformer's first two positions as one compiled pass.

Where a kernel cannot run (the CPU, another dtype), the same arithmetic runs in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fish_sm.kernels import decode_attention, row_products, split_products
from fish_sm.kernels.compile import rows_dynamic
from fish_sm.kernels.lora import Adapted, LoraLinear
from fish_sm.model.dual_ar import Attention, DualARTransformer, TransformerBlock
from fish_sm.model.layers import RMSNorm


def adapted_product(owner: nn.Module, name: str, module: nn.Module, x: Tensor, norm: RMSNorm | None = None,
                    res: Tensor | None = None, swiglu: bool = False) -> Tensor:
    """`row_products.row_product` of `module`'s weight as `attach_rows` hung it on `owner` as
    `name`: of RMSNorm(x) by `norm` if given, of SwiGLU(x) with `swiglu`, plus `res` if given,
    plus the row's adapter's part in the same kernel when `module` carries adapters that are added."""
    prologue = row_products.NORM if norm is not None else row_products.SWIGLU if swiglu else row_products.PLAIN
    lora = (dict(lora_a=module.lora_a, lora_b=module.stacked_b(), lora_ids=module.ids, parts=module.parts)
            if isinstance(module, Adapted) and module.adds else {})
    return row_products.row_product(x, getattr(owner, f"rows_{name}"), getattr(owner, f"rows_{name}_scale"),
                                    None if norm is None else norm.weight, res, prologue,
                                    0.0 if norm is None else norm.eps, getattr(owner, "rows_ahead", {}).get(name),
                                    **lora)


def split_product(module: nn.Module, x: Tensor, res: Tensor, counts: Tensor) -> Tensor:
    """res + `module`'s product of x as a `split_products` kernel (tile counters `counts`),
    plus the adapters' part when `module` carries adapters that are added."""
    if isinstance(module, LoraLinear):
        return module.split(x, res, counts)
    return split_products.split_product(x, module.weight, res, counts)


def attach_rows(owner: nn.Module, name: str, linear: nn.Linear) -> None:
    """`linear`'s weight as the row-product kernels read it, as buffers `rows_<name>` and
    `rows_<name>_scale` of `owner` (views of the weight's storage): compiled code takes a
    module's buffers as inputs, so one graph serves every layer of a shape."""
    w, scale = row_products.product_weights(linear)
    owner.register_buffer(f"rows_{name}", w, persistent=False)
    owner.register_buffer(f"rows_{name}_scale", scale, persistent=False)


class KernelAttention(Attention):
    """`Attention` whose masked decode steps run the `decode_attention` kernel where it can."""

    def __init__(self, attention: Attention):
        nn.Module.__init__(self)  # the same projections, norms and cache as `attention`
        self.n_head, self.n_local_heads, self.head_dim = attention.n_head, attention.n_local_heads, attention.head_dim
        self.wqkv, self.wo, self.q_norm, self.k_norm = attention.wqkv, attention.wo, attention.q_norm, attention.k_norm
        self.kv_cache = attention.kv_cache

    def over(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, live: int, mask: Tensor | None) -> Tensor:
        # One new token: the kernel reads each row's slots up to its position. With the decode
        # step's mask ("slot <= position", `forward_slow`'s) it applies that mask itself; without
        # one (a fast layer's codebook position, its k/v the last of the `live` slots) those are
        # every live slot, where SDPA's kernels cost tens of µs a call for many rows' few slots.
        if q.shape[2] == 1 and (mask is not None or input_pos.numel() == 1) and decode_attention.usable(q, k, v):
            return decode_attention.decode_attention(q, k, v, input_pos)
        return super().over(q, k, v, input_pos, live, mask)

    def over_rows(self, q: Tensor, rows: Tensor, input_pos: Tensor, live: int, mask: Tensor | None) -> Tensor:
        """`over` for sequences in the cache rows `rows` [B] names (any rows, in any order):
        the kernel reads them where they are; elsewhere they are gathered first."""
        cache = self.kv_cache
        k, v = cache.k[:, :, :live], cache.v[:, :, :live]
        if mask is not None and q.shape[2] == 1 and decode_attention.usable(q, k, v):
            return decode_attention.decode_attention(q, k, v, input_pos, rows=rows)
        k, v = cache.read(live, rows, q.shape[0])
        return super().over(q, k, v, input_pos, live, mask)


class KernelBlock(TransformerBlock):
    """`TransformerBlock` whose decode steps run on `compiled` halves: ((pre, post) for one row,
    or None for the row-product kernels; (pre, post) for several), and whose prompts run on
    `prefill` halves if given (the batching engine's admissions). `rows`: the row-product
    kernels' weights attached; `split`: the split products' tile counters."""

    # A one-row step's products, by the names of their attached weights.
    PRODUCTS = {"wqkv": ("attention", "wqkv"), "wo": ("attention", "wo"), "w13": ("feed_forward", "w13"),
                "w2": ("feed_forward", "w2")}

    def __init__(self, block: TransformerBlock, compiled: tuple | None = None, prefill: tuple | None = None,
                 rows: bool = False, split: bool = False):
        nn.Module.__init__(self)  # the same modules (names, tensors) as `block`
        self.attention = KernelAttention(block.attention)
        self.feed_forward, self.attention_norm, self.ffn_norm = block.feed_forward, block.attention_norm, block.ffn_norm
        self.compiled, self.prefill_compiled = compiled, prefill
        self.rows_ahead: dict[str, Tensor] = {}  # see `KernelDualAR.chain_row_weights`
        if rows:
            for key, (part, name) in self.PRODUCTS.items():
                attach_rows(self, key, getattr(getattr(self, part), name))
        if split:
            # Zeroed once; wo and w2 of a block run one after another, so they share them.
            self.register_buffer("split_counts", torch.zeros(split_products.COUNTERS, dtype=torch.int32,
                                                             device=self.ffn_norm.weight.device), persistent=False)

    def row_products_readable(self) -> bool:
        return all(row_products.readable(getattr(getattr(self, part), name)) for part, name in self.PRODUCTS.values())

    def split_products_readable(self) -> bool:
        return split_products.readable(self.attention.wo) and split_products.readable(self.feed_forward.w2)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None = None,
                row: int | Tensor = 0) -> Tensor:
        if self.compiled is not None and x.shape[1] == 1 and (isinstance(row, Tensor) or row == 0):
            return self.decode_step(x, rope, input_pos, live, mask, row if isinstance(row, Tensor) else None)
        if self.prefill_compiled is None or x.shape[1] == 1:
            return super().forward(x, rope, input_pos, live, mask, row)
        pre, post = self.prefill_compiled
        q, k, v = pre(self, x, rope)
        return post(self, x, self.attention.attend(q, k, v, input_pos, live, mask, row))

    def decode_step(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None = None,
                    rows: Tensor | None = None) -> Tensor:
        """S new positions (one; two for `KernelDualAR.forward_fast_pair`) of cache rows 0..B-1,
        or of the cache rows `rows` [B] names (the batching engine's slots), on the compiled
        halves: the first also writes the step's k/v into the cache, attention runs between them."""
        if self.compiled is None:
            return self(x, rope, input_pos, live, mask, 0 if rows is None else rows)
        if self.compiled[x.shape[0] > 1] is None:
            return self._decode_row(x, rope, input_pos, live, mask, rows=rows)
        if x.shape[0] > 1:
            # The number of positions is part of each graph: dynamo, having seen one and then two,
            # would otherwise generalise the halves to any number (as it does the batch), and on
            # the CPU that code wrote wrong cache entries.
            for t, dim in ((x, 1), (rope, rope.dim() - 3), (input_pos, input_pos.dim() - 1)):
                torch._dynamo.mark_static(t, dim)
            # The rows: the slow layers' positions and RoPE are per row, the fast pair's shared.
            rows_dynamic(x, rows, *((rope, input_pos) if input_pos.dim() > 1 else ()))
        pre, post = self.compiled[x.shape[0] > 1]
        if rows is None:
            q = pre(self, x, rope, input_pos)
            k, v = self.attention.kv_cache.read(live, 0, x.shape[0])
            y = self.attention.over(q, k, v, input_pos, live, mask)
        else:
            q = pre(self, x, rope, input_pos, rows)
            y = self.attention.over_rows(q, rows, input_pos, live, mask)
        if x.shape[0] > 1:
            rows_dynamic(y)
        return post(self, x, y)

    def _pre_attention_writing(self, x: Tensor, rope: Tensor, input_pos: Tensor, rows: Tensor | None = None) -> Tensor:
        """`_pre_attention`, then k/v into cache rows 0..B-1 (or `rows`) at input_pos ([S], or
        [B, 1]). The rows are named by a tensor, so the write indexes the whole cache rather than
        a slice of it: inductor then writes in place (fused with RoPE) instead of copying the cache."""
        q, k, v = self._pre_attention(x, rope)
        if rows is None:
            rows = torch.arange(x.shape[0], device=x.device)
        self.attention.kv_cache.write(input_pos.view(-1, x.shape[1]), k, v, rows)
        return q

    def _post_attention_split(self, x: Tensor, y: Tensor) -> Tensor:
        """`_post_attention` of a step of several rows, wo and w2 with their residual adds as
        `split_products` kernels (the same arithmetic)."""
        h = split_product(self.attention.wo, y, x, self.split_counts)
        gated = self.feed_forward.gated(self.ffn_norm(h))
        return split_product(self.feed_forward.w2, gated, h, self.split_counts)

    def _decode_row(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None,
                    cache_only: bool = False, rows: Tensor | None = None) -> Tensor:
        """A decode step of one row (cache row 0, or the one `rows` [1] names) as five kernels of our own, each with the work
        around it fused: norm and wqkv; QK-norm, RoPE, the cache write and attention over the
        row's live slots (plus a kernel combining its pieces over long caches); wo and the
        residual; norm and w13; SwiGLU, w2 and the residual (not with `cache_only`). Where the
        kernels cannot run, the same arithmetic in torch."""
        a = self.attention
        qkv = adapted_product(self, "wqkv", a.wqkv, x, norm=self.attention_norm)
        cache = a.kv_cache
        k, v = cache.read(live, 0, 1)
        if row_products.usable(qkv) and decode_attention.usable(qkv.view(1, -1, 1, a.head_dim), k, v):
            q_norm, k_norm = (a.q_norm.weight, a.k_norm.weight) if a.q_norm is not None else (None, None)
            y = decode_attention.attend_new_token(qkv, a.n_head, a.n_local_heads, q_norm, k_norm,
                                                  a.q_norm.eps if a.q_norm is not None else 0.0, rope, cache.k, cache.v,
                                                  input_pos, live, row=rows)
        else:
            q, k_new, v_new = a.heads(qkv, rope)
            y = a.attend(q, k_new, v_new, input_pos, live, mask, 0 if rows is None else rows)
        if cache_only:  # the caller needs only the cache's new entries
            return x
        ff = self.feed_forward
        h = adapted_product(self, "wo", a.wo, y, res=x)
        gate_up = adapted_product(self, "w13", ff.w13, h, norm=self.ffn_norm)
        return adapted_product(self, "w2", ff.w2, gate_up, res=h, swiglu=True)


def uses_row_products(model: DualARTransformer) -> bool:
    """The row-product kernels run on this model's device and dtype (CUDA with Triton, bf16)
    and read every layer's projections and both heads (the base weights of those that carry
    adapters: their part is added by `adapted_product`)."""
    return (row_products.usable(model.norm.weight) and row_products.readable(model.head)
            and row_products.readable(model.fast_output)
            and all(KernelBlock.row_products_readable(b) for b in [*model.layers, *model.fast_layers]))


class KernelDualAR(DualARTransformer):
    """`DualARTransformer` whose decode steps of one row run on the row-product kernels (where
    `row_steps`), and whose layers are `KernelBlock`s. `install` turns a loaded model into one
    in place, as the engines hold it; `step_inputs_compiled` is one row's `step_inputs` compiled."""

    row_steps = False
    step_inputs_compiled = None

    def uses_row_products(self) -> bool:
        return uses_row_products(self)

    def on_rows(self, batch: int) -> bool:
        """A decode step of `batch` rows runs on the row-product kernels."""
        return self.row_steps and batch == 1

    def attach_heads(self) -> None:
        """Both heads' weights as the row-product kernels read them (see `attach_rows`)."""
        attach_rows(self, "head", self.head)
        attach_rows(self, "fast_head", self.fast_output)

    def chain_row_weights(self, ahead: int) -> None:
        """Tell each one-row product the weights of the product `ahead` after it in a frame (the
        slow layers, the head, then the fast layers and their head, in a loop), for its kernel
        to start streaming into L2."""
        for owner in (*self.layers, *self.fast_layers, self):
            owner.rows_ahead = {}
        if ahead <= 0:
            return
        names = list(KernelBlock.PRODUCTS)
        slow = [(b, n) for b in self.layers for n in names] + [(self, "head")]
        fast = [(b, n) for b in self.fast_layers for n in names] + [(self, "fast_head")]
        for i, (owner, name) in enumerate(slow + fast):  # a frame: slow, then fast over and over
            k = i + ahead
            after, after_name = slow[k] if k < len(slow) else fast[(k - len(slow)) % len(fast)]
            owner.rows_ahead[name] = getattr(after, f"rows_{after_name}")

    def forward_slow(self, tokens: Tensor, input_pos: Tensor, live: int, key_pos: Tensor | None = None,
                     row: int | Tensor = 0, last: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`DualARTransformer.forward_slow`; a step of one row on the row-product kernels reads
        its inputs through one compiled kernel and builds no mask (the kernels' attention masks
        by position itself)."""
        if (key_pos is not None and self.on_rows(tokens.shape[0]) and tokens.shape[-1] == 1
                and (isinstance(row, Tensor) or row == 0) and row_products.usable(self.norm.weight)):
            x, rope = self.step_inputs_compiled(self, tokens, input_pos)
            return self.run_slow(x, rope, input_pos, key_pos.shape[0], row=row, last=last)
        return super().forward_slow(tokens, input_pos, live, key_pos, row, last)

    def prime_fast(self, hidden: Tensor) -> None:
        """`DualARTransformer.prime_fast`; on the row-product kernels, the last layer stops once
        its k/v are written (three products fewer)."""
        if not self.on_rows(hidden.shape[0]):
            return super().prime_fast(hidden)
        input_pos, x, rope = self.positions[:1], hidden[:, None], self.fast_rope[:1]
        for layer in self.fast_layers[:-1]:
            x = layer(x, rope, input_pos, 1)
        self.fast_layers[-1]._decode_row(x, rope, input_pos, 1, None, cache_only=True)

    def forward_fast_pair(self, hidden: Tensor, x: Tensor) -> Tensor:
        """`DualARTransformer.forward_fast_pair` on the layers' compiled decode halves."""
        pair = torch.stack([hidden, x], dim=1)
        for layer in self.fast_layers:
            pair = layer.decode_step(pair, self.fast_rope[:2], self.positions[:2], 2)
        return pair[:, 1]

    def head_logits(self, x: Tensor) -> Tensor:
        if self.on_rows(x.shape[0]):
            return adapted_product(self, "head", self.head, x, norm=self.norm)
        return super().head_logits(x)

    def fast_logits(self, hidden: Tensor) -> Tensor:
        if self.on_rows(hidden.shape[0]):
            return adapted_product(self, "fast_head", self.fast_output, hidden, norm=self.fast_norm)
        return super().fast_logits(hidden)

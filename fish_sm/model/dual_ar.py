"""The DualAR transformer of S1-mini: a slow transformer over the token sequence and a
fast transformer over the codebooks of one frame.

Per frame: the slow transformer reads the previous frame (text token or semantic
token plus its ten codebook ids), and its head picks the next semantic token
(codebook 0) or `<|im_end|>`. The fast transformer then starts from the slow
hidden state and emits codebooks 1..9 one at a time, each conditioned on the
ones before it.

Layout, names and numerics follow upstream (RoPE tables rounded to bf16, RMSNorm in
float32, GQA), so the official `model.pth` loads unchanged. Two things differ by
design: the heads only have the rows that may be chosen (the slow head: the semantic
tokens and `<|im_end|>`, see `head_rows`; the fast head: the residual codebooks' 1,024
codes), and attention reads the live part of the KV cache only.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from fish_sm.errors import CheckpointError
from fish_sm.model import decode_attention, row_products, split_products
from fish_sm.model.config import RESIDUAL_CODEBOOK_SIZE, ModelConfig
from fish_sm.model.layers import RMSNorm, apply_rope, rope_table
from fish_sm.model.weights import read_state_dict, strip_prefix, take


def attached_product(owner: nn.Module, name: str, x: Tensor, norm: RMSNorm | None = None, res: Tensor | None = None,
                     swiglu: bool = False) -> Tensor:
    """`row_products.row_product` with the weights `row_products.attach` hung on `owner` as
    `name`: of RMSNorm(x) by `norm` if given, of SwiGLU(x) with `swiglu`, plus `res` if given."""
    prologue = row_products.NORM if norm is not None else row_products.SWIGLU if swiglu else row_products.PLAIN
    return row_products.row_product(x, getattr(owner, f"rows_{name}"), getattr(owner, f"rows_{name}_scale"),
                                    None if norm is None else norm.weight, res, prologue,
                                    0.0 if norm is None else norm.eps, getattr(owner, "rows_ahead", {}).get(name))


class KVCache(nn.Module):
    """One row per sequence: row b of the batch being run is row `row + b` of the cache."""

    def __init__(self, batch: int, seq_len: int, n_heads: int, head_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        shape = (batch, n_heads, seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, live: int, row: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        """Write k/v [B, heads, S, head_dim] at `input_pos` ([S] shared, or [B, S] per row);
        return the first `live` slots of the B rows (everything attendable). `row`: the
        batch's first cache row (rows row..row+B-1), or a tensor [B] of any cache rows
        (with input_pos [B, S], or [1, S] shared: the rows need not be next to each other)."""
        self.write(input_pos, k, v, row)
        return self.read(live, row, k.shape[0])

    def write(self, input_pos: Tensor, k: Tensor, v: Tensor, row: int | Tensor = 0) -> None:
        if isinstance(row, Tensor):
            self.k[row[:, None], :, input_pos] = k.transpose(1, 2)
            self.v[row[:, None], :, input_pos] = v.transpose(1, 2)
            return
        kc, vc = self.k[row : row + k.shape[0]], self.v[row : row + k.shape[0]]
        if input_pos.dim() == 1:
            kc[:, :, input_pos] = k
            vc[:, :, input_pos] = v
        else:
            b = torch.arange(k.shape[0], device=k.device)[:, None]
            kc[b, :, input_pos] = k.transpose(1, 2)
            vc[b, :, input_pos] = v.transpose(1, 2)

    def read(self, live: int, row: int | Tensor, batch: int) -> tuple[Tensor, Tensor]:
        if isinstance(row, Tensor):
            return self.k[row, :, :live], self.v[row, :, :live]
        return self.k[row : row + batch, :, :live], self.v[row : row + batch, :, :live]


def cache_rows(caches: list[KVCache], row: int, length: int) -> list[Tensor]:
    """Row `row`'s first `length` slots of every cache, as views: k then v of each in turn.
    Copies between such lists go in one `torch._foreach_copy_` call: the batching loop moved a
    request with a copy a cache from Python, ~3 ms a move of 28 layers (H100)."""
    return [t.select(0, row).narrow(1, 0, length) for cache in caches for t in (cache.k, cache.v)]


def copy_cache_rows(caches: list[KVCache], dst: int, src: int, length: int) -> None:
    """Row `src`'s first `length` slots into row `dst` of every cache."""
    torch._foreach_copy_(cache_rows(caches, dst, length), cache_rows(caches, src, length))


class Attention(nn.Module):
    def __init__(self, dim, n_head, n_local_heads, head_dim, qkv_bias, o_bias, qk_norm, eps):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = n_head, n_local_heads, head_dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.kv_cache: KVCache | None = None

    def project(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as [B, heads, S, head_dim], normed and rotated."""
        return self.heads(self.wqkv(x), rope)

    def heads(self, qkv: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The projection `qkv` [B, S, (heads + 2 * kv_heads) * head_dim] as q, k, v."""
        bsz, seqlen, _ = qkv.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, live: int, mask: Tensor | None,
               row: int | Tensor = 0) -> Tensor:
        """Write k/v to the cache, attend over its first `live` slots; [B, S, heads * head_dim]."""
        if mask is None and q.shape[2] == live:
            # From position 0, the live slots are exactly the new k/v: attend over them as they
            # are, not over the cache read back (through indices, for rows named by a tensor).
            self.kv_cache.write(input_pos, k, v, row)
        else:
            k, v = self.kv_cache.update(input_pos, k, v, live, row)
        return self.over(q, k, v, input_pos, live, mask)

    def over(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, live: int, mask: Tensor | None) -> Tensor:
        """Attention over k/v already in the cache (its first `live` slots)."""
        bsz, _, seqlen, _ = q.shape
        gqa = self.n_head != self.n_local_heads
        if mask is not None and seqlen == 1 and decode_attention.usable(q, k, v):
            # A decode step over a bucket of slots: its mask is "slot <= position" (forward_slow's),
            # which the kernel applies itself, reading only each row's live slots.
            return decode_attention.decode_attention(q, k, v, input_pos)
        if mask is not None:
            backends = contextlib.nullcontext()
            if seqlen > 1:
                # Several query positions (prompts continuing a reused prefix): the efficient
                # kernel, which takes a mask but not grouped heads (with them SDPA fell back to
                # its float32 math path), so the heads are expanded; not cuDNN, which builds a
                # plan for every new shape, and prompt lengths vary.
                backends = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
                if gqa and q.is_cuda:
                    k, v = (t.repeat_interleave(self.n_head // self.n_local_heads, dim=1) for t in (k, v))
                    gqa = False
            with backends:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif seqlen == live:  # a prefill from position 0: plain causal attention (cuDNN's flash kernel on an H100)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif seqlen == 1:  # one new token sees every live key
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:  # a chunk continuing a prefix: a key is visible to a query at or after its position
            visible = torch.arange(live, device=q.device)[None, :] <= input_pos[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[None, None], enable_gqa=gqa)
        return y.transpose(1, 2).reshape(bsz, seqlen, self.n_head * self.head_dim)


class FeedForward(nn.Module):
    """SwiGLU. The gate (w1) and up (w3) projections are one matrix, w13, so a decode
    step reads them with one kernel; the checkpoint's w1/w3 are stacked at load time."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.gated(x))

    def gated(self, x: Tensor) -> Tensor:
        """w2's input: silu(gate) * up."""
        gate, up = self.w13(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_head, n_local_heads, head_dim, hidden, qkv_bias, o_bias, qk_norm, eps):
        super().__init__()
        self.attention = Attention(dim, n_head, n_local_heads, head_dim, qkv_bias, o_bias, qk_norm, eps)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None = None,
                row: int | Tensor = 0) -> Tensor:
        if self.compiled is not None and x.shape[1] == 1 and isinstance(row, int) and row == 0:
            return self.decode_step(x, rope, input_pos, live, mask)
        pre, post = TransformerBlock._pre_attention, TransformerBlock._post_attention
        if self.prefill_compiled is not None and x.shape[1] > 1:
            pre, post = self.prefill_compiled  # admissions of the batching engine
        q, k, v = pre(self, x, rope)
        return post(self, x, self.attention.attend(q, k, v, input_pos, live, mask, row))

    def decode_step(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None = None) -> Tensor:
        """S new positions (one; two for `DualARTransformer.forward_fast_pair`) of cache rows
        0..B-1 on the compiled halves (see DualARTransformer.compile_layers): the first also
        writes the step's k/v into the cache, attention runs between them."""
        if self.compiled is None:  # eager
            return self(x, rope, input_pos, live, mask)
        if self.compiled[x.shape[0] > 1] is None:  # one row on the row-product kernels
            return self._decode_row(x, rope, input_pos, live, mask)
        if x.shape[0] > 1:
            # The number of positions is part of each graph: dynamo, having seen one and then two,
            # would otherwise generalise the halves to any number (as it does the batch), and on
            # the CPU that code wrote wrong cache entries.
            for t, dim in ((x, 1), (rope, rope.dim() - 3), (input_pos, input_pos.dim() - 1)):
                torch._dynamo.mark_static(t, dim)
        pre, post = self.compiled[x.shape[0] > 1]
        q = pre(self, x, rope, input_pos)
        k, v = self.attention.kv_cache.read(live, 0, x.shape[0])
        return post(self, x, self.attention.over(q, k, v, input_pos, live, mask))

    def _pre_attention(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.attention.project(self.attention_norm(x), rope)

    def _pre_attention_writing(self, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
        """`_pre_attention`, then k/v into cache rows 0..B-1 at input_pos ([S], or [B, 1]).
        The rows are named by a tensor, so the write indexes the whole cache rather than a
        slice of it: inductor then writes in place (fused with RoPE) instead of copying the cache."""
        q, k, v = self._pre_attention(x, rope)
        rows = torch.arange(x.shape[0], device=x.device)
        self.attention.kv_cache.write(input_pos.view(-1, x.shape[1]), k, v, rows)
        return q

    def _post_attention(self, x: Tensor, y: Tensor) -> Tensor:
        h = x + self.attention.wo(y)
        return h + self.feed_forward(self.ffn_norm(h))

    def _post_attention_split(self, x: Tensor, y: Tensor) -> Tensor:
        """`_post_attention` of a step of several rows, wo and w2 with their residual adds as
        `split_products` kernels (the same arithmetic)."""
        h = split_products.split_product(y, self.attention.wo.weight, x, self.split_counts)
        gated = self.feed_forward.gated(self.ffn_norm(h))
        return split_products.split_product(gated, self.feed_forward.w2.weight, h, self.split_counts)

    def split_products_readable(self) -> bool:
        return split_products.readable(self.attention.wo) and split_products.readable(self.feed_forward.w2)

    # A decode step of one row on `row_products` kernels (norms, SwiGLU and residual adds fused
    # into the products); their weights are the buffers `attach_row_weights` sets.
    PRODUCTS = {"wqkv": ("attention", "wqkv"), "wo": ("attention", "wo"), "w13": ("feed_forward", "w13"),
                "w2": ("feed_forward", "w2")}

    def row_products_readable(self) -> bool:
        return all(row_products.readable(getattr(getattr(self, part), name)) for part, name in self.PRODUCTS.values())

    def attach_row_weights(self) -> None:
        for key, (part, name) in self.PRODUCTS.items():
            row_products.attach(self, key, getattr(getattr(self, part), name))

    def _decode_row(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None,
                    cache_only: bool = False) -> Tensor:
        """A decode step of one row (cache row 0) as five kernels of our own, each with the work
        around it fused: norm and wqkv; QK-norm, RoPE, the cache write and attention over the
        row's live slots (plus a kernel combining its pieces over long caches); wo and the
        residual; norm and w13; SwiGLU, w2 and the residual (not with `cache_only`). Where the
        kernels cannot run, the same arithmetic in torch."""
        a = self.attention
        qkv = attached_product(self, "wqkv", x, norm=self.attention_norm)
        cache = a.kv_cache
        k, v = cache.read(live, 0, 1)
        if row_products.usable(qkv) and decode_attention.usable(qkv.view(1, -1, 1, a.head_dim), k, v):
            q_norm, k_norm = (a.q_norm.weight, a.k_norm.weight) if a.q_norm is not None else (None, None)
            y = decode_attention.attend_new_token(qkv, a.n_head, a.n_local_heads, q_norm, k_norm,
                                                  a.q_norm.eps if a.q_norm is not None else 0.0, rope, cache.k, cache.v,
                                                  input_pos, live)
        else:
            q, k_new, v_new = a.heads(qkv, rope)
            y = a.attend(q, k_new, v_new, input_pos, live, mask)
        if cache_only:  # the caller needs only the cache's new entries
            return x
        return self._post_attention_rows(x, y)

    def _post_attention_rows(self, x: Tensor, y: Tensor) -> Tensor:
        h = attached_product(self, "wo", y, res=x)
        gate_up = attached_product(self, "w13", h, norm=self.ffn_norm)
        return attached_product(self, "w2", gate_up, res=h, swiglu=True)

    compiled: tuple | None = None  # ((pre, post) for one row, (pre, post) for several)
    prefill_compiled: tuple | None = None


# Inductor options for a decode step of one row. With coordinate-descent tuning, inductor
# turns a one-row matmul into a tuned Triton reduction (bf16, or int8 converted as it is
# read) and fuses into it the norm before it and the SwiGLU and residual add around it: on
# an H100 a frame runs 862 kernels instead of 1,066, 8% more frames/s (docs/benchmarks.md,
# fifth pass). Not the static launcher: torch 2.11 reloads its kernels from the compile
# cache without their tuned configs and tunes them again at every start (what it launches
# outside CUDA graphs is not on the decode path). Programmatic dependent launch (Hopper and
# later; ignored elsewhere): each kernel starts while the one before it drains and waits
# only where it reads that one's output: +6% and +14% frames/s in bf16 (A/Bs on two
# machines), where a frame's ~860 kernels' fixed costs are most of its time (ninth pass). Not
# with INT8 weights, whose dequantizing reductions it made slower (-3% and -7%).
ONE_ROW_OPTIONS = {"coordinate_descent_tuning": True, "use_static_cuda_launcher": False, "triton.enable_pdl": True}
NOT_WITH_INT8 = ("triton.enable_pdl",)
# Several rows (the batching engine): matmuls stay with cuBLAS, and tuning would be redone
# for every batch size at start. No PDL: with it, 32 and 64 streams were 2-7% slower.
MANY_ROWS_OPTIONS: dict = {}
# Several rows: wo and w2 (and their residual adds) as `split_products` kernels instead of cuBLAS.
SPLIT_PRODUCTS = True


def _has_option(config, name: str) -> bool:
    for part in name.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def compile_decode(fn, one_row: bool, tune: bool = True, int8: bool = False):
    """`torch.compile` as the decode step's functions use it: for one row, static shapes and
    `ONE_ROW_OPTIONS` (without the tuning if not `tune`, without `NOT_WITH_INT8` for a
    model with INT8 weights); for several, one graph for any number (specialised to the
    first batch size seen, then generalised) and `MANY_ROWS_OPTIONS`."""
    from torch._inductor import config

    options = dict(ONE_ROW_OPTIONS if one_row else MANY_ROWS_OPTIONS)
    if not tune:
        options.pop("coordinate_descent_tuning", None)
    if int8:
        options = {k: v for k, v in options.items() if k not in NOT_WITH_INT8}
    # An option this torch does not have is left out (torch.compile would refuse it): the
    # stock inference container's torch 2.6 has no static launcher to turn off.
    options = {k: v for k, v in options.items() if _has_option(config, k)}
    return torch.compile(fn, fullgraph=True, dynamic=False if one_row else None, options=options)


class DualARTransformer(nn.Module):
    def __init__(self, config: ModelConfig, semantic_begin_id: int, im_end_id: int):
        super().__init__()
        c = self.config = config
        self.semantic_begin_id = semantic_begin_id
        self.im_end_id = im_end_id
        self.embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.codebook_embeddings = nn.Embedding(c.codebook_size * c.num_codebooks, c.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(c.dim, c.n_head, c.n_local_heads, c.head_dim, c.intermediate_size,
                             c.attention_qkv_bias, c.attention_o_bias, c.attention_qk_norm, c.norm_eps)
            for _ in range(c.n_layer)
        )
        self.norm = RMSNorm(c.dim, c.norm_eps)
        # The slow head: row i scores semantic code i, the last row scores <|im_end|>.
        self.head = nn.Linear(c.dim, c.semantic_vocab + 1, bias=False)
        self.fast_project_in = nn.Linear(c.dim, c.fast_dim) if c.fast_dim != c.dim else nn.Identity()
        self.fast_embeddings = nn.Embedding(c.codebook_size, c.fast_dim)
        self.fast_layers = nn.ModuleList(
            TransformerBlock(c.fast_dim, c.fast_n_head, c.fast_n_local_heads, c.fast_head_dim, c.fast_intermediate_size,
                             c.fast_attention_qkv_bias, c.fast_attention_o_bias, c.fast_attention_qk_norm, c.norm_eps)
            for _ in range(c.n_fast_layer)
        )
        self.fast_norm = RMSNorm(c.fast_dim, c.norm_eps)
        # The fast head: only the rows of the residual codebooks' codes (its first 1,024), the
        # only ones sampled; the checkpoint's other rows are never read.
        self.fast_output = nn.Linear(c.fast_dim, RESIDUAL_CODEBOOK_SIZE, bias=False)
        self.register_buffer("rope", rope_table(c.max_seq_len, c.head_dim, c.rope_base), persistent=False)
        self.register_buffer("fast_rope", rope_table(c.num_codebooks, c.fast_head_dim, c.rope_base), persistent=False)
        self.register_buffer("codebook_offsets", torch.arange(c.num_codebooks) * c.codebook_size, persistent=False)
        self.max_seq_len = 0

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights: never quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def quantized(self) -> bool:
        """INT8 weights (torchao's tensors in place of the projections' weights)."""
        return type(self.layers[0].attention.wqkv.weight) is not nn.Parameter

    def uses_row_products(self) -> bool:
        """Decode steps of one row run their products as `row_products` kernels: where those run
        (CUDA with Triton, bf16) and every layer's projections and both heads are readable by them."""
        return (row_products.usable(self.norm.weight) and row_products.readable(self.head)
                and row_products.readable(self.fast_output)
                and all(b.row_products_readable() for b in [*self.layers, *self.fast_layers]))

    row_steps = False  # decode steps of one row on `row_products` kernels (set by compile_layers)

    def on_rows(self, batch: int) -> bool:
        """A decode step of `batch` rows runs on `row_products` kernels (one row, where set)."""
        return self.row_steps and batch == 1

    def head_logits(self, x: Tensor) -> Tensor:
        """The slow head's logits of x [B, dim]: its norm and product (one kernel for one row of
        a model on `row_products`)."""
        if self.on_rows(x.shape[0]):
            return attached_product(self, "head", x, norm=self.norm)
        return self.head(self.norm(x))

    def compile_layers(self, dynamic_batch: bool = False, rows: bool | None = None) -> None:
        """Compile the per-layer work of a decode step around attention (norms, projections,
        QK-norm, RoPE and the cache write before it; the rest after), once for all slow
        layers and once for all fast ones (same code, same shapes: the compiled graphs are
        shared), so no graph depends on the attention length and compilation stays short.
        Steps of one row and of several are compiled apart (see `compile_decode`).
        `dynamic_batch` (the batching engine): the slow layers' halves are also compiled for
        prompts of any batch and length (its admissions, which otherwise launch ~2,700
        kernels one by one from Python, ~90 ms of a decode loop that every active stream
        waits on). `rows`: steps of one row on `row_products` kernels instead (None: where
        `uses_row_products`), nothing compiled for them; INT8 weights are then read by
        those kernels, not torchao's."""
        # One cache entry per layer shape and weight type (bf16, int8), per engine in this process.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        rows = self.uses_row_products() if rows is None else rows
        halves = TransformerBlock._pre_attention_writing, TransformerBlock._post_attention
        one_row = None if rows else tuple(compile_decode(f, True, int8=self.quantized) for f in halves)
        blocks = [*self.layers, *self.fast_layers]
        # Steps of several rows: wo and w2 as `split_products` kernels where their weights are
        # plain (not torchao's INT8); on the CPU the same arithmetic in torch.
        split = SPLIT_PRODUCTS and all(b.split_products_readable() for b in blocks)
        many = (halves[0], TransformerBlock._post_attention_split if split else halves[1])
        compiled = (one_row, tuple(compile_decode(f, False, int8=self.quantized) for f in many))
        for block in blocks:
            if rows:
                block.attach_row_weights()
            if split:
                split_products.attach(block)
            block.compiled = compiled
        if rows:
            row_products.attach(self, "head", self.head)
            row_products.attach(self, "fast_head", self.fast_output)
            self._chain_row_weights(row_products.PREFETCH_AHEAD["int8" if self.quantized else "bf16"])
            self._step_inputs = compile_decode(DualARTransformer.step_inputs, True)
        self.row_steps = rows
        if dynamic_batch:
            prefill = (torch.compile(TransformerBlock._pre_attention, fullgraph=True, dynamic=True),
                       torch.compile(TransformerBlock._post_attention, fullgraph=True, dynamic=True))
            for block in self.layers:
                block.prefill_compiled = prefill

    def _chain_row_weights(self, ahead: int) -> None:
        """Tell each one-row product the weights of the product `ahead` after it in a frame (the
        slow layers, the head, then the fast layers and their head, in a loop), for its kernel
        to start streaming into L2."""
        for owner in (*self.layers, *self.fast_layers, self):
            owner.rows_ahead = {}
        if ahead <= 0:
            return
        names = list(TransformerBlock.PRODUCTS)
        slow = [(b, n) for b in self.layers for n in names] + [(self, "head")]
        fast = [(b, n) for b in self.fast_layers for n in names] + [(self, "fast_head")]
        for i, (owner, name) in enumerate(slow + fast):  # a frame: slow, then fast over and over
            k = i + ahead
            after, after_name = slow[k] if k < len(slow) else fast[(k - len(slow)) % len(fast)]
            owner.rows_ahead[name] = getattr(after, f"rows_{after_name}")

    def head_rows(self) -> Tensor:
        """Vocabulary ids of the slow head's rows: semantic tokens, then <|im_end|>."""
        sem = torch.arange(self.semantic_begin_id, self.semantic_begin_id + self.config.semantic_vocab)
        return torch.cat([sem, torch.tensor([self.im_end_id])])

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Static KV caches: `max_seq_len` slots for the slow transformer, one per codebook for the fast one."""
        c, p = self.config, self.norm.weight
        if max_seq_len > c.max_seq_len:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {c.max_seq_len}")
        self.max_seq_len = max_seq_len
        self.positions = torch.arange(max_seq_len, device=p.device)  # key positions, sliced per step
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_len, c.n_local_heads, c.head_dim, p.dtype, p.device)
        for b in self.fast_layers:
            b.attention.kv_cache = KVCache(max_batch_size, c.num_codebooks, c.fast_n_local_heads, c.fast_head_dim, p.dtype, p.device)

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [B, 1 + num_codebooks, T]: row 0 token ids, rows 1.. codebook ids (used on semantic positions)."""
        c = self.config
        ids = tokens[:, 0]
        is_semantic = (ids >= self.semantic_begin_id) & (ids < self.semantic_begin_id + c.semantic_vocab)
        codes = tokens[:, 1:] + self.codebook_offsets[None, :, None]
        vq = self.codebook_embeddings(codes).sum(dim=1)
        x = self.embeddings(ids) + vq * is_semantic[..., None]
        if c.scale_codebook_embeddings:
            x = torch.where(is_semantic[..., None], x / math.sqrt(c.num_codebooks + 1), x)
        return x

    def step_inputs(self, tokens: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The slow transformer's input embeddings and RoPE rows."""
        return self.embed(tokens), self.rope[input_pos]

    def forward_slow(self, tokens: Tensor, input_pos: Tensor, live: int, key_pos: Tensor | None = None,
                     row: int | Tensor = 0, last: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run the slow transformer over `tokens` [B, 1 + C, S] at `input_pos` — a contiguous
        range [S] shared by the batch, or [B, S] per row — attending over the first `live`
        cache slots (at least input_pos[-1] + 1) of cache rows row..row+B-1 (or the rows
        a tensor `row` names). With `live` equal to S (from position 0), attention is causal
        over the new positions' own k/v.

        `key_pos` (arange of a bucketed length: the compiled step, the batching engine)
        replaces `live`: attention then reads that many slots, masking those after each query.
        Returns the head's logits [B, semantic_vocab + 1] and the fast transformer's
        input [B, fast_dim], both for the last position only, or for position `last` [B]
        of each row (a batch of prompts padded to one length).
        """
        mask = None
        # A step on `_decode_row`'s kernels: their attention masks by position itself, and the
        # step's inputs are one compiled kernel.
        row_step = (key_pos is not None and self.on_rows(tokens.shape[0]) and tokens.shape[-1] == 1
                    and isinstance(row, int) and row == 0 and row_products.usable(self.norm.weight))
        if row_step:
            live = key_pos.shape[0]
        elif key_pos is not None:
            live = key_pos.shape[0]
            mask = key_pos <= input_pos[..., None]  # [S, live] or [B, S, live]
            mask = mask[None, None] if input_pos.dim() == 1 else mask[:, None]
            # As the additive bias attention turns a boolean mask into: once, not once a layer.
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
        x, rope = self._step_inputs(self, tokens, input_pos) if row_step else self.step_inputs(tokens, input_pos)
        for layer in self.layers:
            x = layer(x, rope, input_pos, live, mask, row)
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]
        return self.head_logits(x), self.fast_project_in(x)

    def forward_fast(self, x: Tensor, pos: int, cache_only: bool = False) -> Tensor:
        """One step of the fast transformer at codebook position `pos`; x [B, fast_dim] -> hidden [B, fast_dim].
        `cache_only`: only the cache's entries matter (position 0, from the slow hidden state):
        on `_decode_row`, the last layer stops once its k/v are written (three products fewer)."""
        input_pos = self.positions[pos : pos + 1]  # a slice, not a new tensor: no host copy inside a CUDA graph
        x = x[:, None]
        rope = self.fast_rope[pos : pos + 1]
        cache_only = cache_only and self.on_rows(x.shape[0])
        for layer in self.fast_layers[:-1] if cache_only else self.fast_layers:
            x = layer(x, rope, input_pos, pos + 1)
        if cache_only:
            self.fast_layers[-1]._decode_row(x, rope, input_pos, pos + 1, None, cache_only=True)
        return x[:, 0]

    def forward_fast_pair(self, hidden: Tensor, x: Tensor) -> Tensor:
        """The fast transformer's positions 0 (the slow hidden state, whose output is unused)
        and 1 (code 0's embedding, `x`) as one pass of two positions; hidden [B, fast_dim] ->
        position 1's output [B, fast_dim]. Both inputs are known once the head has picked,
        so a frame reads the fast layers' weights nine times instead of ten."""
        pair = torch.stack([hidden, x], dim=1)
        for layer in self.fast_layers:
            pair = layer.decode_step(pair, self.fast_rope[:2], self.positions[:2], 2)
        return pair[:, 1]

    def fast_logits(self, hidden: Tensor) -> Tensor:
        """Logits of the residual codebooks' 1,024 codes (as `head_logits`)."""
        if self.on_rows(hidden.shape[0]):
            return attached_product(self, "fast_head", hidden, norm=self.fast_norm)
        return self.fast_output(self.fast_norm(hidden))


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of `model.pth` (upstream names, fused wqkv) with its shape."""
    c = config
    out = {
        "embeddings.weight": (c.vocab_size, c.dim),
        "codebook_embeddings.weight": (c.codebook_size * c.num_codebooks, c.dim),
        "norm.weight": (c.dim,),
        "fast_embeddings.weight": (c.codebook_size, c.fast_dim),
        "fast_norm.weight": (c.fast_dim,),
        "fast_output.weight": (c.codebook_size, c.fast_dim),
    }
    if not c.tie_word_embeddings:
        out["output.weight"] = (c.vocab_size, c.dim)
    if c.fast_dim != c.dim:
        out["fast_project_in.weight"] = (c.fast_dim, c.dim)
        out["fast_project_in.bias"] = (c.fast_dim,)
    stacks = [("layers", c.n_layer, c.dim, c.n_head, c.n_local_heads, c.head_dim, c.intermediate_size,
               c.attention_qkv_bias, c.attention_o_bias, c.attention_qk_norm),
              ("fast_layers", c.n_fast_layer, c.fast_dim, c.fast_n_head, c.fast_n_local_heads, c.fast_head_dim,
               c.fast_intermediate_size, c.fast_attention_qkv_bias, c.fast_attention_o_bias, c.fast_attention_qk_norm)]
    for name, n, dim, nh, nkv, hd, hidden, qkv_bias, o_bias, qk_norm in stacks:
        for i in range(n):
            p = f"{name}.{i}."
            out[p + "attention.wqkv.weight"] = ((nh + 2 * nkv) * hd, dim)
            if qkv_bias:
                out[p + "attention.wqkv.bias"] = ((nh + 2 * nkv) * hd,)
            out[p + "attention.wo.weight"] = (dim, nh * hd)
            if o_bias:
                out[p + "attention.wo.bias"] = (dim,)
            if qk_norm:
                out[p + "attention.q_norm.weight"] = (hd,)
                out[p + "attention.k_norm.weight"] = (hd,)
            out[p + "feed_forward.w1.weight"] = (hidden, dim)
            out[p + "feed_forward.w3.weight"] = (hidden, dim)
            out[p + "feed_forward.w2.weight"] = (dim, hidden)
            out[p + "attention_norm.weight"] = (dim,)
            out[p + "ffn_norm.weight"] = (dim,)
    return out


def normalize_state_dict(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accept the layouts upstream accepts: a `model.` prefix, separate wq/wk/wv, extra `audio_*` keys."""
    weights = strip_prefix(weights, "model.")
    weights = {k: v for k, v in weights.items() if "audio_" not in k}
    for key in [k for k in weights if k.endswith(".attention.wq.weight")]:
        p = key[: -len("wq.weight")]
        parts = [weights.pop(p + n + ".weight", None) for n in ("wq", "wk", "wv")]
        if any(t is None for t in parts):
            raise CheckpointError(f"model.pth: {p}wq/wk/wv must all be present to fuse into {p}wqkv")
        weights[p + "wqkv.weight"] = torch.cat(parts)
    return weights


def checked_weights(path, config: ModelConfig) -> dict[str, Tensor]:
    """Every tensor `config` needs from `model.pth`, by upstream name, each shape checked
    (memory-mapped: nothing is read until used)."""
    weights = normalize_state_dict(read_state_dict(path))
    return {name: take(weights, name, shape, str(path)) for name, shape in expected_shapes(config).items()}


def load_dual_ar(path, config: ModelConfig, semantic_begin_id: int, im_end_id: int,
                 device="cpu", dtype=torch.float32) -> DualARTransformer:
    """Build the model from `model.pth` (or `.safetensors`), checking every tensor's name and shape."""
    source = str(path)
    if semantic_begin_id + config.semantic_vocab > config.vocab_size or im_end_id >= config.vocab_size:
        raise CheckpointError(f"{source}: the tokenizer's special tokens lie beyond vocab_size {config.vocab_size}")
    state = checked_weights(path, config)
    out_weight = state.pop("output.weight", state["embeddings.weight"])
    with torch.device("meta"):
        model = DualARTransformer(config, semantic_begin_id, im_end_id)
    state["head.weight"] = out_weight[model.head_rows()]
    state["fast_output.weight"] = state["fast_output.weight"][:RESIDUAL_CODEBOOK_SIZE]
    for name in [n for n in state if n.endswith("feed_forward.w1.weight")]:
        stem = name[: -len("w1.weight")]
        state[stem + "w13.weight"] = torch.cat([state.pop(stem + "w1.weight"), state.pop(stem + "w3.weight")])
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    # Buffers were built on `meta`; rebuild them for real.
    model.rope = rope_table(config.max_seq_len, config.head_dim, config.rope_base)
    model.fast_rope = rope_table(config.num_codebooks, config.fast_head_dim, config.rope_base)
    model.codebook_offsets = torch.arange(config.num_codebooks) * config.codebook_size
    return model.to(device).eval()

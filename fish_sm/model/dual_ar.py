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

Plain torch: the decode step's compiled and Triton paths are put in place from outside
(`fish_sm.kernels.install`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from fish_sm.errors import CheckpointError
from fish_sm.model.config import RESIDUAL_CODEBOOK_SIZE, ModelConfig
from fish_sm.model.layers import RMSNorm, apply_rope, rope_table, swiglu
from fish_sm.model.weights import read_state_dict, strip_prefix, take


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
    Copies between such lists go in one `torch._foreach_copy_` call, not one a cache from Python."""
    return [t.select(0, row).narrow(1, 0, length) for cache in caches for t in (cache.k, cache.v)]


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
        return swiglu(self.w13(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_head, n_local_heads, head_dim, hidden, qkv_bias, o_bias, qk_norm, eps):
        super().__init__()
        self.attention = Attention(dim, n_head, n_local_heads, head_dim, qkv_bias, o_bias, qk_norm, eps)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None = None,
                row: int | Tensor = 0) -> Tensor:
        """x [B, S, dim] at `input_pos` into cache rows `row` (see `Attention.attend`)."""
        q, k, v = self._pre_attention(x, rope)
        return self._post_attention(x, self.attention.attend(q, k, v, input_pos, live, mask, row))

    # The halves around attention, apart so that a decode step can compile them around it.
    def _pre_attention(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.attention.project(self.attention_norm(x), rope)

    def _post_attention(self, x: Tensor, y: Tensor) -> Tensor:
        h = x + self.attention.wo(y)
        return h + self.feed_forward(self.ffn_norm(h))


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

    def head_logits(self, x: Tensor) -> Tensor:
        """The slow head's logits of x [B, dim]."""
        return self.head(self.norm(x))

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
        if key_pos is not None:
            live = key_pos.shape[0]
            mask = key_pos <= input_pos[..., None]  # [S, live] or [B, S, live]
            mask = mask[None, None] if input_pos.dim() == 1 else mask[:, None]
            # As the additive bias attention turns a boolean mask into: once, not once a layer.
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
        x, rope = self.step_inputs(tokens, input_pos)
        return self.run_slow(x, rope, input_pos, live, mask, row, last)

    def run_slow(self, x: Tensor, rope: Tensor, input_pos: Tensor, live: int, mask: Tensor | None = None,
                 row: int | Tensor = 0, last: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`forward_slow` from its input embeddings x [B, S, dim] and RoPE rows."""
        for layer in self.layers:
            x = layer(x, rope, input_pos, live, mask, row)
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]
        return self.head_logits(x), self.fast_project_in(x)

    def forward_fast(self, x: Tensor, pos: int) -> Tensor:
        """One step of the fast transformer at codebook position `pos`; x [B, fast_dim] -> hidden [B, fast_dim]."""
        input_pos = self.positions[pos : pos + 1]  # a slice, not a new tensor: no host copy inside a CUDA graph
        x = x[:, None]
        rope = self.fast_rope[pos : pos + 1]
        for layer in self.fast_layers:
            x = layer(x, rope, input_pos, pos + 1)
        return x[:, 0]

    def prime_fast(self, hidden: Tensor) -> None:
        """The fast transformer's position 0, the slow hidden state [B, fast_dim]: only the cache
        entries it writes are used, never its output."""
        self.forward_fast(hidden, 0)

    def forward_fast_pair(self, hidden: Tensor, x: Tensor) -> Tensor:
        """The fast transformer's positions 0 (the slow hidden state, whose output is unused)
        and 1 (code 0's embedding, `x`) as one pass of two positions; hidden [B, fast_dim] ->
        position 1's output [B, fast_dim]. Both inputs are known once the head has picked,
        so a frame reads the fast layers' weights nine times instead of ten."""
        pair = torch.stack([hidden, x], dim=1)
        for layer in self.fast_layers:
            pair = layer(pair, self.fast_rope[:2], self.positions[:2], 2)
        return pair[:, 1]

    def fast_logits(self, hidden: Tensor) -> Tensor:
        """Logits of the residual codebooks' 1,024 codes."""
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

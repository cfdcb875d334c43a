"""The codec's layers, all causal (convs pad on the left, transposed convs are trimmed on the
right, attention only looks back), each taking an optional streaming state: the convs and
the residual unit, the window-limited transformer, and the vector quantizers."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fish_sm.model.codec.config import CodecConfig
from fish_sm.model.layers import RMSNorm, apply_rope, rope_table

State = Optional[dict]  # streaming state: {module: that module's carried context}; None = whole sequence


# ---------------------------------------------------------------------------------------------
# Convolutions


class Snake1d(nn.Module):
    """Periodic activation x + sin(alpha x)^2 / alpha, one alpha per channel (from DAC)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        alpha = self.alpha if x.dim() == 3 else self.alpha[..., None]  # [B, C, 1, T]: see `conv_2d`
        # Same op order as upstream so results round identically.
        return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def conv_2d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, dilation: int = 1, groups: int = 1) -> Tensor:
    """A streaming conv over [B, C, T], or over [B, C, 1, T] as a 2-D conv of height 1: in
    channels-last memory, cuDNN's kernels then read and write it as they are, where 1-D
    convs convert every input and output between layouts. `weight`: 1-D, or already 2-D (see
    `prepare_2d`); a dilated conv's 2-D weight with its taps along the height runs as
    `_dilated_as_phases`."""
    if x.dim() == 3:
        return F.conv1d(x, weight, bias, dilation=dilation, groups=groups)
    if weight.dim() == 3:
        weight = weight[:, :, None]
    if weight.shape[-2:] == (1, 1) and groups == 1:
        # A pointwise conv is a product over channels: over channels-last [B, C, 1, T] memory
        # ([B, T, C]) one GEMM (cuBLAS's: the back's batches 1-4% faster than with cuDNN's 1x1
        # convolutions, docs/benchmarks.md "Issue 43").
        return F.linear(x.permute(0, 2, 3, 1), weight.flatten(1), bias).permute(0, 3, 1, 2)
    if dilation > 1 and weight.shape[-1] == 1 and weight.shape[-2] > 1:
        return _dilated_as_phases(x, weight, bias, dilation, groups)
    return F.conv2d(x, weight, bias, dilation=(1, dilation), groups=groups)


def _dilated_as_phases(x: Tensor, weight: Tensor, bias: Optional[Tensor], dilation: int, groups: int) -> Tensor:
    """A conv of dilation d over [B, C, 1, T] as an undilated one over [B, C, T/d, d]: column r
    holds samples r, r + d, r + 2d..., so taps one row apart are d samples apart. In
    channels-last memory both shapes are views of the same [B, T, C] buffer (after padding T
    to a multiple of d; the outputs that read the padding are dropped). cuDNN has no NHWC
    kernel for dilated convs: it would run them through NCHW kernels and layout conversions.
    `weight` [C_out, C_in / groups, taps, 1]."""
    n = x.shape[-1]
    rows = (n + dilation - 1) // dilation
    x = F.pad(x, (0, rows * dilation - n)).flatten(2).unflatten(-1, (rows, dilation))
    y = F.conv2d(x, weight, bias, groups=groups).flatten(2)[:, :, None]
    return y[..., : n - (weight.shape[-2] - 1) * dilation]


def _with_context(owner: nn.Module, x: Tensor, state: dict, n: int) -> Tensor:
    """A streaming conv's input with the `n` inputs before it in front (zeros at a stream's
    start), its own last `n` kept in `state[owner]` for the next call."""
    if not n:
        return x
    context = state.get(owner)
    if context is None:
        context = x.new_zeros(*x.shape[:-1], n)
    x = torch.cat([context, x], dim=-1)
    # A copy, not a view: a view would keep this call's whole input alive as long as the
    # state (in a captured graph, for good).
    state[owner] = x[..., -n:].clone()
    return x


class CausalConv1d(nn.Module):
    """Conv padded only on the left, so output t sees inputs up to t (upstream `CausalConvNet`)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.left = (kernel - 1) * dilation + 1 - stride
        self.weight_2d: Optional[Tensor] = None  # see `prepare_2d`

    def prepare_2d(self) -> None:
        """Keep a channels-last copy of the weight for streaming over [B, C, 1, T] (a dilated
        conv's with its taps along the height: see `conv_2d`)."""
        w = self.conv.weight[:, :, None]
        if self.conv.dilation[0] > 1:
            w = w.transpose(2, 3)
        self.weight_2d = w.contiguous(memory_format=torch.channels_last)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        if state is None:
            # Upstream also pads on the right up to a whole number of strides.
            return self.conv(F.pad(x, (self.left, -x.shape[-1] % self.stride)))
        assert self.stride == 1, "streaming only runs stride-1 convs"
        x = _with_context(self, x, state, self.left)
        weight = self.weight_2d if x.dim() == 4 and self.weight_2d is not None else self.conv.weight
        return conv_2d(x, weight, self.conv.bias, self.conv.dilation[0], self.conv.groups)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv trimmed on the right, so output sample t only needs inputs up to t // stride."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.stride = stride
        self.taps = -(-kernel // stride)  # inputs each output sample sees
        self.phases_2d: Optional[Tensor] = None  # see `prepare_2d`

    def prepare_2d(self) -> None:
        """Keep `phases` as a channels-last 2-D weight for streaming over [B, C, 1, T]."""
        self.phases_2d = self.phases()[:, :, None].contiguous(memory_format=torch.channels_last)

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        n = x.shape[-1] * self.stride
        if state is None:
            return self.conv(x)[..., :n]
        # Streaming, as `stride` interleaved ordinary convs of `taps` inputs (the same sums):
        # output t * stride + r is sum_j x[t - j] W[:, :, r + j * stride]. cuDNN runs this as
        # a forward conv, where a transposed conv is its slower backward-data kernel (~6x the
        # time per FLOP in the batching codec's back), and the carried state is the last
        # taps - 1 inputs, like a causal conv's.
        x = _with_context(self, x, state, self.taps - 1)
        y = conv_2d(x, self.phases_2d if x.dim() == 4 and self.phases_2d is not None else self.phases())
        # Phase-major channels: over channels-last [B, C, 1, T] this interleave is a view, so
        # the block after it stays channels-last (cuDNN converts no layouts around its convs).
        y = y.unflatten(1, (self.stride, -1)).movedim(1, -1).flatten(-2)
        return y + self.conv.bias.view(-1, *[1] * (y.dim() - 2))

    def phases(self) -> Tensor:
        """The weight as an ordinary conv's, [stride * c_out, c_in, taps]: row r * c_out + c is
        output channel c's phase r, tap k reads the input taps - 1 - k steps back."""
        w = self.conv.weight  # [c_in, c_out, kernel]
        c_in, c_out, kernel = w.shape
        w = F.pad(w, (0, self.taps * self.stride - kernel)).view(c_in, c_out, self.taps, self.stride)
        return w.permute(3, 1, 0, 2).flip(-1).reshape(self.stride * c_out, c_in, self.taps)


def run_layers(layers: nn.ModuleList, x: Tensor, state: State) -> Tensor:
    for layer in layers:
        x = layer(x, state)
    return x


class ResidualUnit(nn.Module):
    """Snake, dilated k=7 conv, Snake, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.ModuleList([Snake1d(dim), CausalConv1d(dim, dim, 7, dilation=dilation), Snake1d(dim), CausalConv1d(dim, dim, 1)])

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        return x + run_layers(self.block, x, state)


# ---------------------------------------------------------------------------------------------
# Transformer (gpt-fast style, causal, optionally window-limited)


def window_mask(q_pos: Tensor, k_pos: Tensor, window: Optional[int]) -> Tensor:
    """[1, 1, Tq, Tk] bool (or [B, 1, Tq, Tk] for positions [B, Tq] and [B, Tk], one row each):
    a query sees keys at or before it, and only the last `window` of them."""
    seen = k_pos[..., None, :] <= q_pos[..., :, None]
    if window is not None:
        seen &= k_pos[..., None, :] > q_pos[..., :, None] - window
    return seen.unsqueeze(-3) if seen.dim() == 3 else seen[None, None]


class LayerScale(nn.Module):
    """Per-channel gain on a residual branch (a module only so the name matches `....gamma`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class KVCache:
    """Keys/values of positions already seen; a window-limited layer keeps only the last window-1."""

    def __init__(self, keep: Optional[int]):
        self.keep = keep
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        drop = 0 if self.keep is None else max(0, k.shape[2] - self.keep)
        self.k, self.v = k[:, :, drop:], v[:, :, drop:]
        return k, v


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, cache: Optional[KVCache]) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split(self.n_head * self.head_dim, dim=-1)
        q = apply_rope(q.view(b, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(b, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(k, v)
        # Contiguous k/v, as upstream's (no-op) head repeat leaves them: same kernels, same rounding.
        y = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(b, t, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, config: CodecConfig):
        super().__init__()
        self.attention = Attention(dim, dim // config.head_dim, config.head_dim)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, config.norm_eps)
        self.ffn_norm = RMSNorm(dim, config.norm_eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, cache: Optional[KVCache]) -> Tensor:
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), rope, mask, cache))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    """Causal transformer over [B, C, T] (channels first, like the convs around it).

    With a streaming state it keeps a KV cache per layer and the next position, so a chunk
    attends to the same keys it would in a whole-sequence pass.
    """

    def __init__(self, dim: int, n_layers: int, hidden: int, window: Optional[int], config: CodecConfig):
        super().__init__()
        self.window = window
        self.head_dim, self.rope_base = config.head_dim, config.rope_base
        self.layers = nn.ModuleList(TransformerBlock(dim, hidden, config) for _ in range(n_layers))
        self.norm = RMSNorm(dim, config.norm_eps)
        self.table: Optional[Tensor] = None  # RoPE rows, grown on demand, not a buffer (not in the state dict)

    def rope(self, start: int, length: int, device: torch.device) -> Tensor:
        end = start + length
        if self.table is None or self.table.shape[0] < end or self.table.device != device:
            self.table = rope_table(max(4096, 1 << (end - 1).bit_length()), self.head_dim, self.rope_base).to(device)
        return self.table[start:end]

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        # Contiguous: over a transposed view (and the residual stream, which keeps its
        # layout) each Linear runs as a batched product that reads its weight once per row.
        x = x.transpose(1, 2).contiguous()
        t = x.shape[1]
        if state is None:
            start, caches = 0, [None] * len(self.layers)
            k_pos = torch.arange(t, device=x.device)
        else:
            if self not in state:
                keep = None if self.window is None else self.window - 1
                state[self] = (0, [KVCache(keep) for _ in self.layers])
            start, caches = state[self]
            if isinstance(start, Tensor):
                return self._rows(x, start, caches, state)
            past = len(caches[0]) if caches else 0
            k_pos = torch.arange(start - past, start + t, device=x.device)
            state[self] = (start + t, caches)
        mask = window_mask(torch.arange(start, start + t, device=x.device), k_pos, self.window)
        rope = self.rope(start, t, x.device)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, mask, cache)
        return self.norm(x).transpose(1, 2)

    def _rows(self, x: Tensor, start: Tensor, caches: list[KVCache], state: State) -> Tensor:
        """Each row at its own position (`start` [B]), as one graph replays streams at any
        point of their utterances: RoPE rows gathered and the window mask built on the GPU.
        The caches hold `past` keys before each row's start; those before position 0 (a
        cache padded on the left) are masked out. The caller sizes the RoPE table first."""
        t, past = x.shape[1], len(caches[0])
        offsets = torch.arange(-past, t, device=x.device)
        k_pos = start[:, None] + offsets
        q_pos = k_pos[:, past:]
        mask = window_mask(q_pos, k_pos, self.window) & (k_pos >= 0)[:, None, None, :]
        rope = self.table[q_pos]
        state[self] = (start + t, caches)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, mask, cache)
        return self.norm(x).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Quantizers


class ConvNeXtBlock(nn.Module):
    """Depthwise causal k=7 conv, LayerNorm, 4x MLP with GELU, scaled residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, state: State = None) -> Tensor:
        y = self.dwconv(x, state).permute(0, 2, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 2, 1)


class VectorQuantizer(nn.Module):
    """One codebook: project to codebook_dim, pick the nearest entry by cosine, project back."""

    def __init__(self, dim: int, size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.codebook = nn.Embedding(size, codebook_dim)

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z [B, D, T] -> (codes [B, T], their reconstruction [B, D, T])."""
        z_e = self.in_proj(z)
        b, d, t = z_e.shape
        e = F.normalize(z_e.permute(0, 2, 1).reshape(b * t, d))
        c = F.normalize(self.codebook.weight)
        # Upstream's squared-distance form (not just e @ c.T) so near-ties resolve identically.
        dist = e.pow(2).sum(1, keepdim=True) - 2 * e @ c.t() + c.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(b, t)
        z_q = self.codebook(codes).transpose(1, 2)
        z_q = z_e + (z_q - z_e)  # upstream's straight-through arithmetic; kept for bit-identical residuals
        return codes, self.out_proj(z_q)

    def dequantize(self, codes: Tensor) -> Tensor:
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class ResidualQuantizer(nn.Module):
    """Codebooks applied in turn, each to what the previous ones left unexplained."""

    def __init__(self, dim: int, n_codebooks: int, size: int, codebook_dim: int):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantizer(dim, size, codebook_dim) for _ in range(n_codebooks))

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor]:
        residual, z_q, codes = z, 0, []
        for q in self.quantizers:
            c, z_i = q.quantize(residual)
            z_q = z_q + z_i
            residual = residual - z_i
            codes.append(c)
        return torch.stack(codes, dim=1), z_q

    def decode(self, codes: Tensor) -> Tensor:
        z = 0.0
        for i, q in enumerate(self.quantizers):
            z = z + q.dequantize(codes[:, i])
        return z

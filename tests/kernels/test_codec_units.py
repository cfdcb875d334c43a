"""The codec's residual units as one op each (`kernels.codec_units`): streamed piece by piece
they give the units' whole-sequence output and carry the units' state, in either layout; on
CUDA the kernel matches the torch arithmetic, alone and inside a compiled, captured function."""

import pytest
import torch
from torch import nn

from fish_sm.kernels import codec_units
from fish_sm.kernels.codec_units import FusedUnits, fuse_residual_units, unit_reference
from fish_sm.model.codec.layers import ResidualUnit, Snake1d, run_layers

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and codec_units.triton is not None), reason="needs CUDA and Triton")


def random_unit(channels: int, dilation: int, seed: int) -> ResidualUnit:
    """A unit with random weights and alphas away from 1 (a Snake of alpha 1 hides swapped alphas)."""
    torch.manual_seed(seed)
    unit = ResidualUnit(channels, dilation)
    for snake in (unit.block[0], unit.block[2]):
        snake.alpha.data = torch.rand_like(snake.alpha) * 2 + 0.2
    return unit.eval()


def streamed(module: nn.Module, x: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, dict]:
    """x run through `module` in pieces ending at `cuts`, one streaming state carried along."""
    state, out, at = {}, [], 0
    for end in cuts + [x.shape[-1]]:
        out.append(module(x[..., at:end], state))
        at = end
    return torch.cat(out, dim=-1), state


def three_units(channels: int, seed: int) -> nn.ModuleList:
    return nn.ModuleList(random_unit(channels, d, seed + d) for d in (1, 3, 9))


@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_units_streamed_in_pieces_give_the_units_whole_output_and_state(channels_last):
    units = three_units(32, seed=0)
    fused = FusedUnits(list(units), torch.float32)
    x = torch.randn(2, 32, 150)
    cuts = [5, 40, 41, 100]  # pieces shorter than the carried contexts among them
    with torch.inference_mode():
        whole = x
        for u in units:
            whole = u(whole)
        _, unfused_state = streamed(lambda x, state: run_layers(units, x, state), x, cuts)
        if channels_last:
            x = x[:, :, None].contiguous(memory_format=torch.channels_last)
        out, state = streamed(fused, x, cuts)
    if channels_last:
        assert out.shape == (2, 32, 1, 150)
        out = out[:, :, 0]
        state = {k: v[:, :, 0] for k, v in state.items()}
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    assert list(state) == [u.block[1] for u in units]  # each unit's conv, carrying its input after Snake
    for key, value in unfused_state.items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # whole sequences (no state) run the units themselves
        torch.testing.assert_close(fused(x if not channels_last else x[:, :, 0]), whole, atol=0, rtol=0)


def test_packed_weights_pad_the_channels_to_a_power_of_two_with_zeros():
    unit = random_unit(24, 1, seed=1)
    packed = codec_units.pack(unit, torch.float16)
    assert packed["w7"].shape == (7, 24, 32) and packed["w1"].shape == (32, 32)
    assert packed["w7"].dtype == packed["w1"].dtype == torch.float16 and packed["b7"].dtype == torch.float32
    assert not packed["w7"][..., 24:].any() and not packed["w1"][24:].any() and not packed["w1"][:, 24:].any()
    assert (packed["alpha1"][24:] == 1).all() and (packed["alpha2"][24:] == 1).all() and not packed["b1"][24:].any()
    assert torch.equal(packed["w7"][3, :, :24], unit.block[1].conv.weight[:, :, 3].t().half())
    torch.testing.assert_close(packed["alpha1"][:24], unit.block[0].alpha.flatten())


def test_fusing_replaces_each_run_of_units_the_kernel_takes_and_leaves_the_rest():
    snake = Snake1d(16)
    model = nn.ModuleList([snake, random_unit(16, 1, 0), random_unit(16, 3, 1),
                           nn.ModuleList([random_unit(32, 3, 1), random_unit(24, 9, 2), random_unit(64, 9, 2)])])
    assert fuse_residual_units(model, torch.float32, widest=32) == 3
    assert model[0] is snake and isinstance(model[1], FusedUnits) and len(model) == 2 + 1
    assert len(model[1].units) == 2
    inner = model[2]
    assert isinstance(inner[0], FusedUnits) and len(inner[0].units) == 1
    assert isinstance(inner[1], ResidualUnit) and isinstance(inner[2], ResidualUnit)  # 24: not a multiple of 16; 64: too wide
    assert fuse_residual_units(model, torch.float32, widest=32) == 0  # (fused units are not fused again)


def test_launch_configs_divide_the_channels():
    assert codec_units.launch_config(96)[1:3] == (32, 32)
    assert codec_units.launch_config(48)[1:3] == (16, 16)
    assert codec_units.launch_config(192)[1:3] == (64, 64)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("following", [False, True])
@pytest.mark.parametrize("channels, dilation, length", [(96, 1, 1000), (96, 9, 37), (192, 3, 4096), (48, 9, 300)])
def test_the_kernel_matches_the_torch_arithmetic_on_cuda(channels, dilation, length, following, dtype):
    unit = random_unit(channels, dilation, seed=channels + dilation).cuda()
    packed = codec_units.pack(unit, dtype)
    alpha1 = packed.pop("alpha1")

    def layout(*shape):
        return torch.randn(*shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)

    x, s = layout(3, channels, 1, length), layout(3, channels, 1, length + 6 * dilation)
    nxt = dict(next_alpha=alpha1 + 0.5, next_context=layout(3, channels, 1, 18)) if following else {}
    h, n = codec_units.launch(s, x, dilation=dilation, **packed, **nxt)
    # The reference from the same rounded inputs and weights, in float32.
    h_want, n_want = unit_reference(s.float(), x.float(), dilation=dilation, **{k: v.float() for k, v in packed.items()},
                                    **{k: v.float() for k, v in nxt.items()})
    assert h.dtype == dtype and h.stride() == x.stride()
    tolerance = 2e-2 if dtype == torch.float16 else 1e-1
    torch.testing.assert_close(h.float(), h_want, atol=tolerance, rtol=tolerance)
    if following:
        assert n.shape == (3, channels, 1, 18 + length)
        torch.testing.assert_close(n.float(), n_want, atol=tolerance, rtol=tolerance)
    else:
        assert n.numel() == 0


@gpu
@pytest.mark.gpu
def test_fused_units_compile_and_replay_in_a_cuda_graph():
    units = three_units(96, seed=5).cuda().half()
    fused = FusedUnits(list(units), torch.float16).cuda()
    keys = [u.block[1] for u in units]

    def step(x, contexts):
        state = dict(zip(keys, contexts))
        return fused(x, state) * 2, [state[k] for k in keys]

    compiled = torch.compile(step)
    x = torch.randn(2, 96, 1, 512, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    contexts = [torch.randn(2, 96, 1, 6 * d, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
                for d in (1, 3, 9)]
    with torch.inference_mode():
        eager = step(x, contexts)
        compiled(x, contexts)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x, contexts)
        graph.replay()
    torch.testing.assert_close(out[0], eager[0], atol=1e-2, rtol=1e-2)  # (inductor's first Snake rounds once less)
    for got, want in zip(out[1], eager[1]):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)

import pytest
import torch

from fish_sm.engine.sampling import SamplingParams, apply_repetition_penalty, head_penalty_indices, logits_to_probs, sample, sampling_tensors
from fish_sm.errors import InputError


def test_params_are_rounded_to_bf16_like_upstream():
    t, p, r = sampling_tensors(SamplingParams(temperature=0.8, top_p=0.8, repetition_penalty=1.1), "cpu")
    assert t.item() == 0.80078125 and p.item() == 0.80078125 and r.item() == 1.1015625


@pytest.mark.parametrize("field, value", [("temperature", 0.0), ("top_p", 1.5), ("repetition_penalty", 3),
                                          ("temperature", "hot"), ("max_new_tokens", 0), ("seed", 1.5),
                                          ("top_p", True)])
def test_out_of_range_params_are_rejected(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value})


def test_penalty_applies_once_per_index_and_ignores_out_of_range():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, torch.tensor([0, 0, 1, 9, -1]), torch.tensor(2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_top_p_keeps_the_best_token_even_when_it_alone_exceeds_p():
    probs = logits_to_probs(torch.tensor([10.0, 0.0, 0.0]), torch.tensor(1.0), torch.tensor(0.1), torch.tensor(1.0))
    assert probs.tolist() == [1.0, 0.0, 0.0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)


def test_head_penalty_maps_vocabulary_ids_to_head_rows():
    # semantic ids start at 100 (4 of them), <|im_end|> is 50; codes read as vocabulary ids drop out
    first = torch.tensor([102, 3, 100, 50, 104, 99])
    assert head_penalty_indices(first, 100, 4, 50).tolist() == [2, -1, 0, 4, -1, -1]


@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])
def test_top_p_without_a_sort_keeps_the_same_tokens_as_the_sort(scale):
    """Both nucleus computations, on rows with many ties (bf16-rounded logits) and without:
    they may differ only where a token's running probability is top_p to rounding (the two
    sum in different orders)."""
    from fish_sm.engine.sampling import _top_p_drop_pairwise, _top_p_drop_sorted

    g = torch.Generator().manual_seed(0)
    for bf16 in (False, True):
        logits = torch.randn(6, 1024, generator=g) * scale
        if bf16:
            logits = logits.bfloat16().float()
        for p in (0.1, 0.5, 0.80078125, 1.0):
            top_p = torch.full((6, 1), p)
            pairwise, sorted_ = _top_p_drop_pairwise(logits, top_p), _top_p_drop_sorted(logits, top_p)
            probs = torch.softmax(logits, -1)
            running = (probs[:, None, :] * (logits[:, None, :] >= logits[:, :, None])).sum(-1)
            differ = pairwise != sorted_
            assert ((running - p).abs()[differ] < 1e-5).all()

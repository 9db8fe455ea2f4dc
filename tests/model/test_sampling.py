"""Sampling is a pure function of (logits, seed, position)."""

import pytest
import torch

from model.sampling import SamplingParams, filter_logits, sample


def logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    x = logits()
    assert sample(x, SamplingParams(), 7) == int(x.argmax())


def test_pure_function_of_seed_and_position():
    x, p = logits(), SamplingParams(temperature=1.0, seed=42)
    first = [sample(x, p, pos) for pos in range(200)]
    assert first == [sample(x.clone(), p, pos) for pos in range(200)]  # no hidden state
    assert first != [sample(x, SamplingParams(temperature=1.0, seed=43), pos) for pos in range(200)]
    assert len(set(first)) > 5  # positions draw different noise


def test_frequencies_follow_softmax():
    x, p = logits(1, vocab=8), SamplingParams(temperature=0.7, seed=1)
    counts = torch.bincount(torch.tensor([sample(x, p, pos) for pos in range(6000)]), minlength=8).float()
    expected = (x / 0.7).softmax(-1) * 6000
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 5).all()


def test_top_k_and_top_p_restrict_support():
    x = logits(2)
    order = x.argsort(descending=True)
    picked = {sample(x, SamplingParams(temperature=5.0, top_k=3, seed=0), pos) for pos in range(300)}
    assert picked <= set(order[:3].tolist()) and len(picked) == 3
    probs = (x / 1.0).softmax(-1)[order]
    keep = int((probs.cumsum(-1) < 0.6).sum()) + 1
    kept = filter_logits(x, SamplingParams(temperature=1.0, top_p=0.6)) > float("-inf")
    assert set(kept.nonzero().flatten().tolist()) == set(order[:keep].tolist())


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_parameters_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)

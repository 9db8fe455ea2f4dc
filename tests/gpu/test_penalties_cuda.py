"""Penalties, logit_bias and min_tokens on the GPU draw what the CPU draws from the same logits
(elementwise per row, the same fp32 ops), and logprobs agree to float rounding."""

from __future__ import annotations

import random

import pytest
import torch

from model.logprobs import token_logprobs
from model.penalties import History
from model.sampling import SamplingParams, sample_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 129280  # V4's


def test_gpu_adjusts_and_draws_what_the_cpu_does():
    rng = random.Random(5)
    kinds = [{}, {"repetition_penalty": 1.3}, {"presence_penalty": 1.5, "frequency_penalty": 0.7},
             {"logit_bias": tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), 300))},
             {"min_tokens": 50, "repetition_penalty": 0.8}]
    params = [SamplingParams(temperature=0.9 * (i % 3 != 0), top_k=50 * (i % 2), seed=i, **kinds[i % len(kinds)])
              for i in range(40)]
    histories = [History(tuple(rng.randrange(VOCAB) for _ in range(300)), tuple(rng.randrange(2000) for _ in range(40)),
                     (1, 2, 3)) for _ in params]
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    positions = list(range(100, 140))
    on_cpu = sample_rows(logits, params, positions, histories=histories)
    on_gpu = sample_rows(logits.cuda(), params, positions, histories=histories)
    assert on_gpu == on_cpu
    cpu = token_logprobs(logits, on_cpu, [20] * 40)
    gpu = token_logprobs(logits.cuda(), on_gpu, [20] * 40)
    for a, b in zip(cpu, gpu):
        assert abs(a.logprob - b.logprob) < 1e-4
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4

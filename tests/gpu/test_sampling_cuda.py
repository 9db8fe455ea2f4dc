"""Sampling on the GPU draws the same tokens as on the CPU from the same logits: the noise is
exact integer hashing and every row is filtered on its own, so where a request's logits were
sampled (prefill worker, decode worker, host) does not change its tokens (invariant 1)."""

from __future__ import annotations

import pytest
import torch

from model.sampling import SamplingParams, sample_rows, support

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 129280  # V4's


def _mixed(rows: int) -> list[SamplingParams]:
    kinds = [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=40), dict(temperature=1.2, top_p=0.9),
             dict(temperature=0.6, top_k=200, top_p=0.8)]
    return [SamplingParams(**kinds[i % len(kinds)], seed=i * 7919) for i in range(rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_draws_what_the_cpu_draws(dtype):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(96, VOCAB, generator=gen) * 4).to(dtype)
    params, positions = _mixed(96), list(range(500, 596))
    on_cpu = sample_rows(logits, params, positions)
    on_gpu = sample_rows(logits.cuda(), params, positions)  # the Triton draw
    assert on_gpu == on_cpu
    assert sample_rows(logits.cuda(), params, positions, "torch") == on_gpu
    # the draws are not all the argmax: the filtered rows really sample
    assert sum(t != int(logits[i].argmax()) for i, t in enumerate(on_gpu)) > 30


def test_gpu_support_is_the_cpu_support():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(40, VOCAB, generator=gen) * 4
    logits[::4, 1000:1100] = float(logits.max()) + 1  # 100 exact ties on top: the cuts fall among them
    params = _mixed(40)
    on_gpu, on_cpu = support(logits.cuda(), params).cpu(), support(logits, params)
    differ = (on_gpu != on_cpu).any(-1).nonzero().flatten().tolist()
    assert not differ, [(r, params[r], int(on_gpu[r].sum()), int(on_cpu[r].sum())) for r in differ]


def test_a_row_draws_the_same_in_any_gpu_batch():
    gen = torch.Generator().manual_seed(13)
    logits = (torch.randn(256, VOCAB, generator=gen) * 4).cuda()
    params, positions = _mixed(256), list(range(256))
    whole = sample_rows(logits, params, positions)
    alone = [sample_rows(logits[i:i + 1], params[i:i + 1], positions[i:i + 1])[0] for i in range(0, 256, 17)]
    assert alone == whole[::17]

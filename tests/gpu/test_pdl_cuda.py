"""Programmatic dependent launch (kernels/common/pdl.py): kernels launched early wait for their predecessor.

A chain of decode products where each reads the previous one's output, launched with PDL in a
CUDA graph, must give the bits of the same chain launched plainly, replay after replay: a kernel
that read its input before its predecessor had flushed it would see stale or half-written rows
(the buffers are reused by every replay, so stale rows differ from the right ones)."""

from __future__ import annotations

import pytest
import torch

from model import low_precision
from model.kernels.common.pdl import launch_options
from model.kernels.gemm import fp8_gemm
from tests.model.kernel_cases import captured

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PLAIN = {"PDL": False, "launch_pdl": False}


def test_launch_options_follow_the_device():
    assert launch_options(torch.empty(1)) == {}
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert launch_options(torch.empty(1, device="cuda")) == ({"PDL": True, "launch_pdl": True} if hopper else {})


@pytest.mark.parametrize("act_fp8", [False, True], ids=["w8a16", "w8a8"])
def test_pdl_chain_matches_plain_launches(act_fp8):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(3)
    # N 1024 × K 4096 (wq_a-like) and back (N 4096 × K 1024), each product reading the last one's output
    shapes = [(1024, 4096), (4096, 1024), (1024, 4096), (4096, 1024)] * 3
    ops = []
    for n, k in shapes:
        q, s = low_precision.fp8_quantize_weight(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5)
        ops.append((q, s.float(), fp8_gemm.arrival_counters(n, "cuda")))
    x = torch.randn(1, 1, 4096, device="cuda", generator=g).bfloat16()

    def chain(extra: dict) -> torch.Tensor:
        y = x
        for i, (q, s, arrivals) in enumerate(ops):
            cfg = {**fp8_gemm.decode_config(1, q.shape[0], q.shape[1], 1, a8=act_fp8), **extra}
            y = fp8_gemm.decode_product(y, q, s, arrivals, cfg, out_dtype=torch.bfloat16, quantize_x=act_fp8)
            if i % 2:  # torch kernels between some products: a PDL launch after a kernel that never waits
                y = (y.float() * y.float().pow(2).mean().rsqrt()).bfloat16()
        return y

    want = chain(PLAIN)
    assert torch.equal(chain(launch_options(x)), want)
    torch.cuda.synchronize()
    graph, out = captured(lambda: chain(launch_options(x)))
    differ = 0
    for _ in range(200):
        graph.replay()
        differ += not torch.equal(out, want)
    assert differ == 0, f"{differ} of 200 replays differ"

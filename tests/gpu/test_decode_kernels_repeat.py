"""Decode-size kernels give the same bits call after call, at V4-Flash shapes.

A result that changes now and then on the same inputs is a race. One kind is known on this
toolchain: a pipelined wgmma whose A operand comes from registers (a weight or a probability
tile converted in registers) can read registers that the next K step has already overwritten
(triton-lang/triton#9433; ptxas before 13.3). The fused MoE's split gate/up kernel returned wrong
rows in ~1-2% of its calls that way (`test_moe_kernels_cuda.py`'s repeat test). The parity tests
call each kernel once or twice, which misses such rates. Here every decode-size product and
attention launch with a register operand runs `CALLS` times on one input and must return the first
call's bits every time; a 1% rate then shows with probability 1 - 0.99^CALLS > 99%."""

from __future__ import annotations

import copy

import pytest
import torch

from model import low_precision
from model.kernels.attention import sparse_attention
from model.kernels.gemm import fp8_gemm
from model.kernels.mhc import mhc
from model.kv_pool import KVPools
from model.rope import Rope
from model.tiny import flash_config
from tests.model.kernel_cases import block_weights, fill_random, mhc_inputs, random_batch, random_picks, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
CFG = flash_config(4)  # layers 0, 1: window only; 2: ratio 4; 3: ratio 128
CALLS = 500


def differing_calls(fn, first: torch.Tensor, calls: int = CALLS) -> int:
    """How many of `calls` further calls of fn() differ from `first` in any bit (50 in flight)."""
    differ = 0
    for _ in range(calls // 50):
        outs = [fn() for _ in range(50)]
        differ += sum(not torch.equal(out, first) for out in outs)
    return differ


# V4-Flash's decode products: wq_b (and | indexer.wq_b), wo_b, the grouped wo_a, fused wq_a | wkv
@pytest.mark.parametrize("N,K,G", [(32768, 1024, 1), (4096, 8192, 1), (1024, 4096, 8), (1536, 4096, 1)],
                         ids=["wq_b", "wo_b", "wo_a", "wq_a_wkv"])
@pytest.mark.parametrize("M", [1, 2, 4, 16, 64, 256])
@pytest.mark.parametrize("act_fp8", [False, True], ids=["w8a16", "w8a8"])
def test_fp8_products_repeat_bit_for_bit(M, N, K, G, act_fp8):
    g = torch.Generator(device=DEV).manual_seed(M * 7 + N)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g, DEV) / K ** 0.5)
    s = s.float()
    x = torch.randn(*((M, G, K) if G > 1 else (M, K)), device=DEV, generator=g).bfloat16()
    arrivals = fp8_gemm.arrival_counters(G * N, DEV)

    def call():
        return fp8_gemm.fp8_linear(x, q, s, "triton", G, arrivals, act_fp8)

    first = call()
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G, act_fp8=act_fp8)
    assert rel_err(first, ref) < 6e-3
    assert differing_calls(call, first) == 0
    assert not arrivals.any(), "split-K arrival counters left non-zero"


@pytest.fixture(scope="module")
def pools():
    p = KVPools(CFG, "fp8_pack", max_tokens=8192 + 256, max_seqs=70, device=DEV)
    fill_random(p, seed=1)
    return p


@pytest.mark.parametrize("rows", [1, 4, 64])
@pytest.mark.parametrize("layer,ratio", [(0, 0), (2, 4), (3, 128)])
def test_sparse_attention_decode_repeats_bit_for_bit(pools, rows, layer, ratio):
    """P·V takes the probabilities from registers; split KV for few rows merges partials."""
    pools_ = copy.deepcopy(pools)
    batch = random_batch(CFG, pools_, [(8191 - 37 * i, 1) for i in range(rows)], seed=rows, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(layer + rows)
    q = torch.randn(rows, 64, 512, device=DEV, generator=g).bfloat16()
    sink = torch.randn(64, device=DEV, generator=g)
    picks = random_picks(batch, 512, rows, DEV) if ratio == 4 else None
    args = (q, batch, pools_, layer, ratio, picks, sink, 128, Rope.for_layer(CFG, ratio > 0))

    def call():
        return sparse_attention.attend(*args, impl="triton")

    first = call()
    assert rel_err(first, sparse_attention.attend(*args, impl="torch")) < 1e-2
    assert differing_calls(call, first) == 0


@pytest.mark.parametrize("T", [1, 4, 64])
def test_mhc_pre_repeats_bit_for_bit(T):
    """The mixes' split-K partials are summed by the last program to arrive."""
    x, fn, base, scale = mhc_inputs(T, DEV)

    def call():
        return torch.cat([t.flatten().float() for t in mhc.hc_pre(x, fn, base, scale, 4, 20, 1e-6, 1e-6, "triton")])

    first = call()
    assert differing_calls(call, first) == 0

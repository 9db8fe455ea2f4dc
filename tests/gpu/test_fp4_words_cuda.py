"""The FP4 word conversion (kernels/common/fp4.py's `fp4_to_bf16`) on its own, on the GPU: a tile of
shuffled codes (random bytes, random scales) converted in one program and compared bit for bit
with the codes decoded in torch. Covers the explicit-words form (any register layout: the tiles
whose layout Triton does not make the wgmma operand's) with the inline PTX and without it; the
in-place form needs a wgmma operand and is covered by the MoE paths' tests.

Through the product (as the SWAP tiles use it) Triton 3.6 gets 16 code bytes (BK 32) at 16 or 32
rows wrong, with or without the inline PTX, while the conversion alone is right and the CPU
interpreter runs the same code right. Those cases are strict xfails: a Triton that fixes them
fails the test, and `moe_grouped.plan_kernels`' refusal of such tiles can then go."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from model import low_precision
from model.kernels.common.fp4 import fp4_scale_factor, fp4_to_bf16, mma_order, mma_order_pairs, shuffle_fp4_words
from model.kernels.moe import moe_grouped
from model.moe import MoE
from model.tiny import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@triton.jit
def _convert_kernel(codes_ptr, scale_ptr, even_ptr, odd_ptr, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)[None, :]
    packed = tl.load(codes_ptr + rows * C + cols)
    scale = fp4_scale_factor(tl.load(scale_ptr + rows * (C // 16) + tl.arange(0, C // 16)[None, :]))
    even, odd = fp4_to_bf16(packed, scale, ASM, False)
    tl.store(even_ptr + rows * C + cols, even)
    tl.store(odd_ptr + rows * C + cols, odd)


@pytest.mark.parametrize("asm", [True, False])
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("R, C", [(16, 16), (64, 16), (32, 32), (128, 64), (256, 64)])
def test_explicit_words_decode_every_code(R, C, num_warps, asm):
    g = torch.Generator().manual_seed(R + C + num_warps)
    codes = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 129, (R, C // 16), dtype=torch.uint8, generator=g)  # exact range: 1..128
    values = torch.tensor(low_precision.E2M1_VALUES, dtype=torch.float64)
    factor = torch.exp2(scales.double() - 127).repeat_interleave(16, dim=1)
    want_even = (values[(codes & 15).long()] * factor).bfloat16()
    want_odd = (values[(codes >> 4).long()] * factor).bfloat16()
    even = torch.full((R, C), float("nan"), dtype=torch.bfloat16, device="cuda")
    odd = torch.full_like(even, float("nan"))
    _convert_kernel[(1,)](shuffle_fp4_words(codes).cuda(), scales.cuda(), even, odd, R, C, asm, num_warps=num_warps)
    assert torch.equal(even.cpu(), want_even) and torch.equal(odd.cpu(), want_odd)


@triton.jit
def _product_kernel(codes_ptr, scale_ptr, x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, T: tl.constexpr,
                    ASM: tl.constexpr):
    """out [R, T] = W · xᵀ as the SWAP tiles form it (kernels/moe/moe_gemm.py): W's bytes and x's
    columns in `mma_order`, W converted as explicit words."""
    rows = tl.arange(0, R)[:, None]
    packed = tl.load(codes_ptr + rows * C + tl.arange(0, C)[None, :])
    scale = fp4_scale_factor(tl.load(scale_ptr + rows * (C // 16) + tl.arange(0, C // 16)[None, :]))
    x = tl.load(x_ptr + tl.arange(0, T)[:, None] * (2 * C) + tl.arange(0, 2 * C)[None, :])
    a, b = fp4_to_bf16(mma_order(packed), scale, ASM, False)
    x_even, x_odd = mma_order_pairs(x)
    acc = tl.dot(a, tl.trans(x_even))
    acc = tl.dot(b, tl.trans(x_odd), acc)
    tl.store(out_ptr + rows * T + tl.arange(0, T)[None, :], acc)


MISCOMPILED = pytest.mark.xfail(strict=True, reason="Triton 3.6: 16 code bytes (BK 32) at 16 or 32 rows; "
                                                    "moe_grouped.plan_kernels refuses those tiles")


@pytest.mark.parametrize("asm", [True, False])
@pytest.mark.parametrize("R, C, num_warps", [pytest.param(16, 16, 4, marks=MISCOMPILED),
                                             pytest.param(32, 16, 4, marks=MISCOMPILED),
                                             (16, 32, 4), (32, 32, 4), (64, 16, 4), (64, 16, 8), (64, 32, 4),
                                             (128, 16, 8), (128, 32, 8)])
def test_explicit_words_in_the_product(R, C, num_warps, asm):
    g = torch.Generator().manual_seed(R * C)
    codes = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 129, (R, C // 16), dtype=torch.uint8, generator=g)
    x = torch.randn(16, 2 * C, generator=g).bfloat16()
    w = low_precision.fp4_dequantize_weight(codes, scales, 32)  # [R, 2C]
    want = w.double() @ x.double().T
    out = torch.full((R, 16), float("nan"), device="cuda")
    _product_kernel[(1,)](shuffle_fp4_words(codes).cuda(), scales.cuda(), x.cuda(), out, R, C, 16, asm,
                          num_warps=num_warps)
    err = float((out.cpu().double() - want).norm() / want.norm())
    assert err < 1e-5, err


def test_plan_refuses_the_miscompiled_tiles():
    moe = MoE.random_packed(tiny_config(), layer=3, fmt="fp4", seed=3, device="cuda")
    x = torch.randn(4, 64, device="cuda")
    weights, ids = moe.gate(x, torch.arange(4, device="cuda"))
    gateup = moe_grouped.Tiles(BT=16, BN=32, BK=64, swap_ab=True)  # I = 32 rows, K = 64
    bad = moe_grouped.Tiles(BT=16, BN=32, BK=32, swap_ab=True)  # D = 64 rows, K = 32
    ok = moe_grouped.Tiles(BT=16, BN=64, BK=32, swap_ab=True)
    with pytest.raises(ValueError, match="BK=32 need BN >= 64"):
        moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0, gateup, bad,
                                 fuse_combine=True)
    moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0, gateup, ok, fuse_combine=True)

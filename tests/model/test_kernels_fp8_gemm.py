"""FP8 block-scaled GEMM against the dequantise-then-matmul reference: plain and grouped, shapes
not multiple of the tiles, decode-size M (split K, partials summed in order) and prefill-size M."""

import pytest
import torch

from model import low_precision
from model.kernels.gemm import act_quant, fp8_gemm
from model.quantized import Fp8Linear
from tests.model.kernel_cases import block_weights, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"



@pytest.mark.parametrize("M,G,N,K", [(1, 1, 96, 200), (3, 1, 64, 1024), (20, 1, 130, 256), (130, 1, 130, 128),
                                     (5, 2, 32, 128), (17, 4, 64, 300), (5, 4, 64, 1024), (200, 1, 64, 1024)])
def test_fp8_linear_matches_reference(M, G, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g))
    assert s.numel() == 1 or s.float().unique().numel() > 1
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    shape = (M, G, K) if G > 1 else (M, K)
    x = torch.randn(*shape, generator=g).to(DEVICE, torch.bfloat16)
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G)  # fp32 reference of the same product
    out = fp8_gemm.fp8_linear(x, q, s, "triton", G)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < 6e-3  # one bf16 rounding of the output
    # split K: the last program of a tile sums the partials in split order, whoever arrives last
    assert torch.equal(fp8_gemm.fp8_linear(x, q, s, "triton", G), out)


def test_decode_sizes_split_k_when_output_tiles_are_few():
    """Up to `KERNEL_MAX_M` rows the kernels spread K over programs when the output has too few
    tiles to fill the GPU (V4-Flash wq_a: N 1024, K 4096), and not when it has plenty (wq_b)."""
    for M in (1, 64, 256):
        assert fp8_gemm.decode_config(M, 1024, 4096, 1)["SPLIT_K"] > 1
        assert fp8_gemm.decode_config(M, 32768, 1024, 1)["SPLIT_K"] == 1
    assert fp8_gemm.decode_config(200, 64, 1024, 1)["SPLIT_K"] > 1  # the (200, 1, 64, 1024) case above
    assert fp8_gemm.decode_config(5, 64, 1024, 4)["SPLIT_K"] > 1  # and the grouped (5, 4, 64, 1024) one


def test_one_token_w8a8_programs_take_at_most_eight_k_blocks():
    """W8A8 products of one token tile split K until each program has at most 8 blocks of 128
    (V4-Flash wo_b: K 8192 → 8 splits, the grouped wo_a: K 4096 → 4); larger token counts and
    W8A16 keep the two-wave rule (wo_b at 64 tokens: 4 splits)."""
    assert fp8_gemm.decode_config(1, 4096, 8192, 1, a8=True)["SPLIT_K"] == 8
    assert fp8_gemm.decode_config(16, 1024, 4096, 8, a8=True)["SPLIT_K"] == 4
    assert fp8_gemm.decode_config(64, 4096, 8192, 1, a8=True)["SPLIT_K"] == 4
    assert fp8_gemm.decode_config(1, 4096, 8192, 1)["SPLIT_K"] == 4
    assert fp8_gemm.decode_config(1, 32768, 1024, 1, a8=True)["SPLIT_K"] == 1  # wq_b: 8 blocks already


def test_decode_kernel_by_row_count():
    """Up to 16 rows the tokens are the MMA's M side; above, the weights are (`_fp8_swap_kernel`),
    in 128-row tiles only when a product has plenty of them (V4-Flash wq_b at 64 tokens, not wo_b)."""
    assert "BLOCK_M" in fp8_gemm.decode_config(16, 4096, 8192, 1)
    assert fp8_gemm.decode_config(17, 4096, 8192, 1)["BLOCK_T"] == 32
    assert fp8_gemm.decode_config(64, 32768, 1024, 1)["BLOCK_N"] == 128
    assert fp8_gemm.decode_config(64, 4096, 8192, 1)["BLOCK_N"] == 64
    assert fp8_gemm.decode_config(256, 1024, 4096, 8)["BLOCK_N"] == 128  # grouped wo_a: 8 × 1024 rows


def test_fp8_linear_leading_dims():
    q, s = low_precision.fp8_quantize_weight(torch.randn(64, 128))
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    out = fp8_gemm.fp8_linear(x.to(DEVICE), q.to(DEVICE), s.float().to(DEVICE), "triton")
    assert out.shape == (2, 3, 64)


@pytest.mark.parametrize("rows,K", [(130, 300), (256, 128)])
def test_dequantize_is_the_reference_bit_for_bit(rows, K):
    """The prefill path's one-pass dequantisation: rows and K not multiples of the tiles."""
    g = torch.Generator().manual_seed(rows + K)
    q, s = low_precision.fp8_quantize_weight(torch.randn(rows, K, generator=g) * 3)
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    want = fp8_gemm.reference_dequantize(q, s, torch.bfloat16)
    assert torch.equal(fp8_gemm.dequantize(q, s, torch.bfloat16), want)


def test_prefill_size_m_uses_the_dequantised_weight():
    """Prefill-size M: cuBLAS on the dequantised weight; the grouped output's flatten(1) is a view
    (the next projection reads it without a copy)."""
    g = torch.Generator().manual_seed(3)
    q, s = low_precision.fp8_quantize_weight(torch.randn(2 * 64, 256, generator=g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    M = fp8_gemm.KERNEL_MAX_M + 1
    x = torch.randn(M, 2, 256, generator=g).to(DEVICE, torch.bfloat16)
    out = fp8_gemm.fp8_linear(x, q, s, "triton", 2)
    assert out.shape == (M, 2, 64) and out.dtype == torch.bfloat16
    assert rel_err(out, fp8_gemm.fp8_linear(x.float(), q, s, "torch", 2)) < 6e-3
    assert out.flatten(1).data_ptr() == out.data_ptr()
    plain = fp8_gemm.fp8_linear(x[:, 0], q, s, "triton")
    assert torch.equal(plain, torch.nn.functional.linear(x[:, 0], fp8_gemm.reference_dequantize(q, s, torch.bfloat16)))


@pytest.mark.parametrize("M,G,N,K", [(3, 1, 64, 1024), (5, 4, 64, 1024), (200, 1, 64, 1024)])
def test_reused_arrival_counters_are_left_zeroed(M, G, N, K):
    """Split-K products on one `arrival_counters` buffer (as `Fp8Linear` holds it): the last
    program of each tile sets its counter back to zero, so the next product on the buffer, with no
    fill before it, is bit-identical."""
    g = torch.Generator().manual_seed(M + G)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = torch.randn(*((M, G, K) if G > 1 else (M, K)), generator=g).to(DEVICE, torch.bfloat16)
    assert fp8_gemm.decode_config(M, N, K, G)["SPLIT_K"] > 1
    arrivals = fp8_gemm.arrival_counters(G * N, DEVICE)
    first = fp8_gemm.fp8_linear(x, q, s, "triton", G, arrivals)
    assert not arrivals.any()
    assert torch.equal(fp8_gemm.fp8_linear(x, q, s, "triton", G, arrivals), first)
    assert rel_err(first, fp8_gemm.fp8_linear(x.float(), q, s, "torch", G)) < 6e-3


def test_fp8_linear_module_keeps_its_counters_out_of_the_state_dict():
    """`Fp8Linear` owns a counter buffer (not a checkpoint tensor) that its split-K products reuse."""
    g = torch.Generator().manual_seed(4)
    lin = Fp8Linear(*low_precision.fp8_quantize_weight(torch.randn(4 * 64, 1024, generator=g)), "triton").to(DEVICE)
    assert "arrivals" not in lin.state_dict() and not lin.arrivals.any()
    x = torch.randn(5, 4, 1024, generator=g).to(DEVICE, torch.bfloat16)
    assert fp8_gemm.decode_config(5, 64, 1024, 4)["SPLIT_K"] > 1
    out = lin.grouped(x)
    assert torch.equal(lin.grouped(x), out) and not lin.arrivals.any()
    assert rel_err(out, fp8_gemm.fp8_linear(x.float(), lin.weight, lin.scale, "torch", 4)) < 6e-3


@pytest.mark.parametrize("M", [5, 40])  # the tokens-as-M kernel and the swap kernel
def test_decode_product_reads_ue8m0_bytes_and_writes_fp32(M):
    """Scales as `PackedExperts` stores them (UE8M0 bytes) give the product of their float values bit
    for bit, and an fp32 output keeps the accumulator unrounded (the dense shared expert's gate/up)."""
    g = torch.Generator().manual_seed(M)
    q, s = low_precision.fp8_quantize_weight(block_weights(256, 384, g))
    q, floats, scale_bytes = q.to(DEVICE), s.float().to(DEVICE), s.view(torch.uint8).to(DEVICE)
    x3 = torch.randn(M, 1, 384, generator=g).to(DEVICE, torch.bfloat16)
    out = fp8_gemm.decode_product(x3, q, scale_bytes, None, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, fp8_gemm.decode_product(x3, q, floats, None, out_dtype=torch.float32))
    assert rel_err(out, fp8_gemm.reference(x3[:, 0].float(), q, floats)[:, None]) < 1e-5


@pytest.mark.parametrize("M,G,N,K", [(20, 1, 96, 512), (64, 2, 40, 384), (256, 1, 200, 256)])
def test_w8a8_tma_tiles_are_the_plain_loads_bit_for_bit(M, G, N, K):
    """Above one token tile the W8A8 kernel takes its weight tiles by TMA (`decode_config`): the
    same product as the plain loads, rows past a group's end or the weight's read as zeros."""
    g = torch.Generator().manual_seed(M + N)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = torch.randn(M, G, K, generator=g).to(DEVICE, torch.bfloat16)
    codes, x_scale = act_quant.quantize(x, "triton")
    cfg = fp8_gemm.decode_config(M, N, K, G, a8=True)
    assert cfg["TMA"]
    tma = fp8_gemm.decode_product(codes, q, s, None, cfg, out_dtype=x.dtype, x_scale=x_scale)
    plain = fp8_gemm.decode_product(codes, q, s, None, {**cfg, "TMA": False}, out_dtype=x.dtype, x_scale=x_scale)
    assert torch.equal(tma, plain)
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G, act_fp8=True)
    assert rel_err(tma.view(ref.shape), ref) < 6e-3


@pytest.mark.parametrize("M,G,N,K", [(20, 1, 128, 512), (64, 2, 192, 384), (3, 3, 64, 1024)])
def test_w8a8_promotion_by_token_factor_is_the_outer_product_bit_for_bit(M, G, N, K):
    """Where a tile's rows share one weight scale block (`uniform_weight_scale`) the W8A8 kernel
    scales each K step's product by one factor a token; the same product as the per-row outer
    product of weight and token scales, bit for bit."""
    g = torch.Generator().manual_seed(M * 7 + N)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g))
    assert s.float().unique().numel() > 1
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = torch.randn(M, G, K, generator=g).to(DEVICE, torch.bfloat16)
    codes, x_scale = act_quant.quantize(x, "triton")
    cfg = fp8_gemm.decode_config(M, N, K, G, a8=True)
    assert fp8_gemm.uniform_weight_scale(N, cfg["BLOCK_N"])
    fast = fp8_gemm.decode_product(codes, q, s, None, {**cfg, "UNIFORM_SW": True}, out_dtype=x.dtype, x_scale=x_scale)
    outer = fp8_gemm.decode_product(codes, q, s, None, {**cfg, "UNIFORM_SW": False}, out_dtype=x.dtype, x_scale=x_scale)
    assert torch.equal(fast, outer)
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G, act_fp8=True)
    assert rel_err(fast.view(ref.shape), ref) < 6e-3


def test_uniform_weight_scale_needs_tiles_inside_scale_blocks():
    assert fp8_gemm.uniform_weight_scale(32768, 128) and fp8_gemm.uniform_weight_scale(192, 64)
    assert not fp8_gemm.uniform_weight_scale(192, 128)  # group 1's rows 192-319 cross 256
    assert not fp8_gemm.uniform_weight_scale(200, 64)  # a tile at row 192 crosses 256
    assert not fp8_gemm.uniform_weight_scale(1024, 256)  # a tile spans two blocks


def test_w8a8_weights_a_descriptor_cannot_hold_take_plain_loads():
    """A weight whose rows are not 16-byte aligned (K = 200 e4m3) falls back to the plain loads."""
    g = torch.Generator().manual_seed(5)
    q, s = low_precision.fp8_quantize_weight(block_weights(64, 200, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = torch.randn(40, 200, generator=g).to(DEVICE, torch.bfloat16)
    out = fp8_gemm.fp8_linear(x, q, s, "triton", act_fp8=True)
    assert rel_err(out, fp8_gemm.fp8_linear(x.float(), q, s, "torch", act_fp8=True)) < 6e-3

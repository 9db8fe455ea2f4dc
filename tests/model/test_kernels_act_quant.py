"""Dynamic FP8 activations (W8A8): the quantisation kernel against its reference bit for bit, the
UE8M0 scale's rounding at powers of two, and the W8A8 products (decode kernel and the prefill
path) against the reference's dequantise-then-matmul of the same codes."""

import pytest
import torch

from model import low_precision
from model.kernels.gemm import act_quant, fp8_cublas, fp8_gemm
from model.quantized import Fp8Linear
from tests.model.kernel_cases import block_weights, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def spread_rows(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bf16 values whose 128-blocks span many scales (each block its own magnitude)."""
    x = torch.randn(*shape, generator=g)
    k = shape[-1]
    blocks = torch.exp2(torch.randint(-12, 12, (*shape[:-1], -(-k // 128)), generator=g).float())
    return (x * blocks.repeat_interleave(128, -1)[..., :k]).to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 4096), (3, 256), (5, 2, 300), (7, 100), (33, 1024)])
def test_quantize_is_the_reference_bit_for_bit(shape):
    """Codes and scales, K a multiple of 128 or not (the short last block has its own scale)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = spread_rows(shape, g)
    q, s = act_quant.quantize(x, "triton")
    rq, rs = act_quant.reference(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.shape == (*shape[:-1], -(-shape[-1] // 128))
    assert s.unique().numel() >= min(s.numel() // 2, 8)  # the data really spans scales
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    # every block uses the code range: its largest code lies in [224, 448] (rounded from (224, 448])
    top = act_quant.dequantize(q, torch.ones_like(s), torch.float32).abs()
    top = torch.nn.functional.pad(top, (0, -shape[-1] % 128)).unflatten(-1, (-1, 128)).amax(-1)
    assert ((top >= 224) & (top <= 448)).all()


def test_quantize_zero_block_and_strided_input():
    """An all-zero block takes the floor's scale and zero codes; a strided view quantises as its copy."""
    g = torch.Generator().manual_seed(1)
    x = spread_rows((4, 512), g)
    x[1, 128:256] = 0
    q, s = act_quant.quantize(x, "triton")
    assert s[1, 1].item() == low_precision.ue8m0_scale(torch.tensor(0.0), low_precision.FP8_MAX).item()
    assert not q[1, 128:256].float().any()
    view = spread_rows((4, 2, 384), g)[:, 1]
    assert torch.equal(act_quant.quantize(view, "triton")[0].view(torch.uint8),
                       act_quant.quantize(view.contiguous(), "triton")[0].view(torch.uint8))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_quantize_scales_by_column_are_the_same_scales_transposed_in_memory(impl):
    """`scales_by_column`: the codes and scale values of the default layout, the scales stored
    column by column (strides (1, M)), as cuBLAS's blockwise GEMM reads them."""
    g = torch.Generator().manual_seed(11)
    x = spread_rows((6, 640), g)
    q, s = act_quant.quantize(x, impl)
    qc, sc = act_quant.quantize(x, impl, scales_by_column=True)
    assert torch.equal(qc.view(torch.uint8), q.view(torch.uint8))
    assert sc.shape == s.shape == (6, 5) and sc.stride() == (1, 6)
    assert torch.equal(sc, s)


def test_scaled_mm_route_takes_large_batches_of_large_products_and_prefill(monkeypatch):
    """Which W8A8 products go to cuBLAS's blockwise GEMM: sm_90 only, plain products of decode
    batches from `fp8_cublas.MIN_M` rows with `MIN_N` outputs, every product of prefill
    size (grouped too), whole 128-row blocks, K in groups of four 128-blocks; never on the CPU."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_cublas, "BUILD_SUPPORTS", True)
    m, n = fp8_cublas.MIN_M, fp8_cublas.MIN_N
    big = fp8_gemm.KERNEL_MAX_M + 4

    def applies(M, N, K, device, groups=1):
        return fp8_cublas.applies(M, N, K, device, groups, prefill=M > fp8_gemm.KERNEL_MAX_M)

    assert applies(m, n, 1024, cuda) and applies(fp8_gemm.KERNEL_MAX_M, 40960, 8192, cuda)
    assert not applies(m - 4, n, 1024, cuda)  # below the batch size
    assert not applies(fp8_gemm.KERNEL_MAX_M, n - 128, 1024, cuda)  # a decode batch's small product
    assert applies(big, 512, 4096, cuda)  # prefill: every product
    assert applies(big, 1024, 4096, cuda, groups=8)
    assert not applies(fp8_gemm.KERNEL_MAX_M, n, 4096, cuda, groups=8)  # a decode batch: a call a group
    assert applies(8191, 512, 4096, cuda) and applies(m + 1, n, 1024, cuda)  # rows padded to a multiple of 4
    assert not applies(m, n - 128, 1024, cuda) and not applies(m, n + 64, 1024, cuda)
    assert not applies(m, n, 1024 + 128, cuda)  # K blocks not a multiple of 4
    assert not applies(m, n, 1024, torch.device("cpu"))
    monkeypatch.setattr(fp8_cublas, "BUILD_SUPPORTS", False)  # a CUDA build without the recipe
    assert not applies(m, n, 1024, cuda)
    monkeypatch.setattr(fp8_cublas, "BUILD_SUPPORTS", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not applies(m, n, 1024, cuda)


def test_ue8m0_scale_rounds_up_just_above_a_power_of_two():
    """amax / 448 one ulp above 2^k needs 2^(k+1) (else the largest value overflows the code
    range); a float log2 rounds that quotient's log down to k for large k."""
    for k in (-20, -3, 0, 5, 30):
        exact = torch.tensor(2.0 ** k, dtype=torch.float32)
        above = torch.nextafter(exact, torch.tensor(float("inf")))
        assert low_precision.ue8m0_scale(exact * 448, 448.0).item() == 2.0 ** k
        assert low_precision.ue8m0_scale(above * 448, 448.0).item() == 2.0 ** (k + 1)
        x = torch.zeros(1, 128)
        x[0, 0] = above * 448
        q, s = act_quant.quantize(x.to(DEVICE), "triton")
        assert s.item() == 2.0 ** (k + 1) and q.float().abs().max().item() <= 448


@pytest.mark.parametrize("shape", [(3, 256), (5, 2, 300), (9, 1024)])
def test_fake_quantize_is_the_reference_bit_for_bit(shape):
    """The prefill path's one-pass quantise-dequantise equals the reference's, in bf16 and fp32."""
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = spread_rows(shape, g)
    for t in (x, x.float()):
        got = act_quant.fake_quantize(t, "triton")
        assert got.dtype == t.dtype and torch.equal(got, act_quant.fake_quantize(t, "torch"))
    assert not torch.equal(act_quant.fake_quantize(x, "triton"), x)


def test_dequantize_is_exact_in_bf16():
    g = torch.Generator().manual_seed(2)
    q, s = act_quant.quantize(spread_rows((6, 640), g), "triton")
    assert torch.equal(act_quant.dequantize(q, s, torch.bfloat16).float(), act_quant.dequantize(q, s, torch.float32))


@pytest.mark.parametrize("M,G,N,K", [(1, 1, 96, 200), (3, 1, 64, 1024), (20, 1, 130, 256), (70, 1, 130, 384),
                                     (5, 2, 32, 128), (17, 4, 64, 300), (200, 1, 64, 1024),
                                     (fp8_gemm.KERNEL_MAX_M + 1, 2, 64, 256)])
def test_w8a8_linear_matches_reference(M, G, N, K):
    """The W8A8 product (decode kernel, split K or not; prefill size through cuBLAS on the
    dequantised codes) against the reference of the same codes. The tolerance is far below the
    W8A8-to-W8A16 gap, so a path that skipped the activations' quantisation fails."""
    g = torch.Generator().manual_seed(M * 1000 + N + G)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = spread_rows((M, G, K) if G > 1 else (M, K), g)
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G, act_fp8=True)
    out = fp8_gemm.fp8_linear(x, q, s, "triton", G, act_fp8=True)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < 6e-3  # one bf16 rounding of the output
    assert rel_err(fp8_gemm.fp8_linear(x.float(), q, s, "torch", G), ref) > 1.5e-2
    assert torch.equal(fp8_gemm.fp8_linear(x, q, s, "triton", G, act_fp8=True), out)  # split order fixed


@pytest.mark.parametrize("M,G,N,K", [(1, 1, 96, 200), (3, 1, 256, 1024), (16, 2, 64, 300), (5, 4, 64, 128)])
def test_w8a8_product_quantising_its_own_input_equals_two_launches(M, G, N, K):
    """Up to `INLINE_QUANT_MAX_M` rows `fp8_linear` hands the W8A8 kernel bf16 rows and the
    kernel quantises each K tile itself: bit for bit the product of `act_quant`'s codes and
    scales (short last K block included; 1024 splits K)."""
    assert M <= fp8_gemm.INLINE_QUANT_MAX_M
    g = torch.Generator().manual_seed(M * 100 + K)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = spread_rows((M, G, K), g)
    codes, x_scale = act_quant.quantize(x, "triton")
    two = fp8_gemm.decode_product(codes, q, s, None, out_dtype=torch.bfloat16, x_scale=x_scale)
    one = fp8_gemm.decode_product(x, q, s, None, out_dtype=torch.bfloat16, quantize_x=True)
    assert torch.equal(one, two)
    out = fp8_gemm.fp8_linear(x if G > 1 else x[:, 0], q, s, "triton", G, act_fp8=True)
    assert torch.equal(out.reshape(one.shape), one)
    ref = fp8_gemm.fp8_linear(x.float() if G > 1 else x[:, 0].float(), q, s, "torch", G, act_fp8=True)
    assert rel_err(out, ref) < 6e-3


def test_w8a8_decode_product_reads_ue8m0_bytes():
    """Weight scales as UE8M0 bytes give the float scales' product bit for bit."""
    g = torch.Generator().manual_seed(5)
    q, s = low_precision.fp8_quantize_weight(block_weights(256, 384, g))
    x8, xs = act_quant.quantize(spread_rows((9, 1, 384), g), "triton")
    q = q.to(DEVICE)
    out = fp8_gemm.decode_product(x8, q, s.view(torch.uint8).to(DEVICE), None, out_dtype=torch.float32, x_scale=xs)
    assert torch.equal(out, fp8_gemm.decode_product(x8, q, s.float().to(DEVICE), None, out_dtype=torch.float32,
                                                    x_scale=xs))
    want = fp8_gemm.reference(act_quant.dequantize(x8, xs, torch.float32)[:, 0], q, s.float().to(DEVICE))
    # exact products; Hopper's FP8 MMA adds them at reduced precision within each 128-wide K step
    # (hence the promotion to fp32 between steps), the interpreter in fp32
    assert rel_err(out[:, 0], want) < (1e-3 if out.is_cuda else 1e-5)


def test_fp8_linear_module_with_fp8_activations():
    """`Fp8Linear(act_fp8=True)`: plain and grouped products are W8A8 on both impls."""
    g = torch.Generator().manual_seed(6)
    w = Fp8Linear(*low_precision.fp8_quantize_weight(torch.randn(4 * 64, 1024, generator=g)), "triton", act_fp8=True)
    w = w.to(DEVICE)
    x = spread_rows((5, 4, 1024), g)
    ref = fp8_gemm.fp8_linear(x.float(), w.weight, w.scale, "torch", 4, act_fp8=True)
    assert rel_err(w.grouped(x), ref) < 6e-3
    w.impl = "torch"
    assert rel_err(w.grouped(x), ref) < 6e-3
    flat = x.flatten(1)
    plain = Fp8Linear(*low_precision.fp8_quantize_weight(torch.randn(64, 4096, generator=g)), "triton", act_fp8=True)
    plain = plain.to(DEVICE)
    assert rel_err(plain(flat), fp8_gemm.fp8_linear(flat.float(), plain.weight, plain.scale, "torch",
                                                    act_fp8=True)) < 6e-3

"""Dynamic FP8 activations: x → e4m3 codes with a UE8M0 (power-of-two) scale per 128 along K.

The official checkpoint declares `"activation_scheme": "dynamic"` for its FP8 projections: the
inference code quantises each projection's input on the fly (`act_quant(x, 128, "ue8m0")`) and
multiplies FP8 by FP8 (W8A8). The scale of a block is `2^ceil(log2(amax / 448))` (amax floored at
1e-4), so every code times its scale is exact in bf16: `fake_quantize` (the dequantised values)
multiplied by bf16 weights gives the W8A8 product up to the order of the fp32 sums, which is how
prefill-size products that cuBLAS's FP8 GEMM does not take run it (`fp8_cublas.applies`).

K need not be a multiple of 128: the last block is shorter (its scale from its own values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model import low_precision
from model.kernels import check_impl
from model.kernels.common.pdl import launch_options, wait

BLOCK = 128  # activation scale block along K (the weights' block)
COLS = 2048  # columns per program: 16 blocks, ~4 KB of bf16 read


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (e4m3 [..., K], fp32 scales [..., ⌈K/128⌉])."""
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -k % BLOCK))
    q, s = low_precision.fp8_quantize_rows(padded, BLOCK)
    return q[..., :k], s


def quantize(x: torch.Tensor, impl: str, scales_by_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (unit stride along K) → (e4m3 [..., K] contiguous, fp32 scales [..., ⌈K/128⌉]).
    `scales_by_column` (x 2-D): the scales [M, ⌈K/128⌉] stored column by column (strides (1, M)),
    the layout cuBLAS's blockwise FP8 GEMM reads (`fp8_cublas.product`)."""
    if check_impl(impl) == "torch":
        q, s = reference(x)
        return q, (s.t().contiguous().t() if scales_by_column else s)
    q, s = _launch(x, fake=False, scales_by_column=scales_by_column)
    return q.view(x.shape), (s if scales_by_column else s.view(*x.shape[:-1], s.shape[-1]))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize` (exact in bf16 and fp32): [..., K] in `dtype`."""
    k = q.shape[-1]
    s = scale.repeat_interleave(BLOCK, -1)[..., :k]
    return (q.float() * s).to(dtype)


def fake_quantize(x: torch.Tensor, impl: str) -> torch.Tensor:
    """x [..., K] → what its W8A8 product sees, in x's dtype: `dequantize(quantize(x))`, in one
    pass on the GPU (2 bytes read and written per value: the prefill products' inputs are up to
    8192 × 32768)."""
    if check_impl(impl) == "torch":
        return dequantize(*reference(x), x.dtype)
    return _launch(x, fake=True)[0].view(x.shape)


def _launch(x: torch.Tensor, fake: bool, scales_by_column: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_quantize_kernel` over x's rows: (e4m3 codes [rows, K], fp32 scales [rows, ⌈K/128⌉], strides
    (1, rows) with `scales_by_column`), or with `fake` (code × scale [rows, K] in x's dtype, None)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    blocks = triton.cdiv(k, BLOCK)
    out = torch.empty(x2.shape, dtype=x.dtype if fake else torch.float8_e4m3fn, device=x.device)
    rows = x2.shape[0]
    scale = None
    if not fake:
        scale = (torch.empty(blocks, rows, dtype=torch.float32, device=x.device).t() if scales_by_column
                 else torch.empty(rows, blocks, dtype=torch.float32, device=x.device))
    cols = min(COLS, triton.next_power_of_2(blocks * BLOCK))
    if rows:
        _quantize_kernel[(rows, triton.cdiv(k, cols))](x2, out, out if fake else scale, k, x2.stride(0), blocks,
                                                       1 if fake else scale.stride(0),
                                                       1 if fake else scale.stride(1),
                                                       COLS=cols, BLOCK=BLOCK, FAKE=fake, **launch_options(x2))
    return out, scale


@triton.jit
def quantize_blocks(blocks):
    """blocks [R, BLOCK] float32 (zeros past K) → (e4m3 codes [R, BLOCK], fp32 scales [R]): one
    block's quantisation, shared by `_quantize_kernel` and the W8A8 decode kernel that quantises
    its own input tiles (`fp8_gemm._fp8_a8_kernel`), so both give the same codes bit for bit."""
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=1), 1e-4)  # low_precision.AMAX_FLOOR
    # low_precision.ue8m0_scale from the quotient's bits (IEEE division: the GPU's default is approximate)
    bits = tl.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # exact: a power of two
    return tl.clamp(blocks * inverse[:, None], -448.0, 448.0).to(tl.float8e4nv), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, n_blocks, stride_sr, stride_sb, COLS: tl.constexpr,
                     BLOCK: tl.constexpr, FAKE: tl.constexpr, PDL: tl.constexpr = False):
    """Codes to q_ptr and scales to s_ptr, or (FAKE) code × scale in x's dtype to q_ptr."""
    wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    codes, scale = quantize_blocks(tl.reshape(x, (COLS // BLOCK, BLOCK)))
    if FAKE:
        values = (codes.to(tl.float32) * scale[:, None]).to(q_ptr.dtype.element_ty)  # exact in bf16
        tl.store(q_ptr + row * K + cols, tl.reshape(values, (COLS,)), mask=mask)
    else:
        tl.store(q_ptr + row * K + cols, tl.reshape(codes, (COLS,)), mask=mask)
        b = tl.program_id(1) * (COLS // BLOCK) + tl.arange(0, COLS // BLOCK)
        tl.store(s_ptr + row * stride_sr + b * stride_sb, scale, mask=b < n_blocks)

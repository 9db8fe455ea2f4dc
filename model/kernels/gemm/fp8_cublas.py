"""W8A8 products on cuBLAS's blockwise FP8 GEMM: the checkpoint's recipe (activations quantised
per 1×128, weights scaled per 128×128) as `torch._scaled_mm` runs it on sm_90.

`fp8_gemm.fp8_linear` sends a W8A8 product here where cuBLAS beats `_fp8_a8_kernel`, whose
per-block promotion waits on each 128-wide K block's products (`applies`; compared by
`benchmarks/research/fp8_gemm_bench.py --variants a8,a8_scaled_mm`, docs/journal/):

* decode batches from `MIN_M` rows, for products of at least `MIN_N` outputs;
* not smaller batches, nor products of fewer outputs: there the kernel wins, since cuBLAS has a
  floor of its own for any small product (and the grouped wo_a makes a call a group);
* prefill-size products of every shape, in place of the bf16 GEMM on dequantised operands.

The codes are `act_quant`'s, the same as the kernel's; the sums are fp32 over scaled 128-blocks
in cuBLAS's order, so the two paths differ by summation order only.
"""

from __future__ import annotations

import torch

from model.kernels.gemm import act_quant

BLOCK = act_quant.BLOCK  # activation scales per 128 along K; weight scales per 128 × 128
MIN_M = 128  # a decode batch's products from this many rows ...
MIN_N = 4096  # ... with at least this many outputs
# cuBLAS has the blockwise recipe from CUDA 12.9 (torch calls it from 2.9, the floor pyproject.toml sets)
BUILD_SUPPORTS = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]) >= (12, 9)


def applies(M: int, N: int, K: int, device: torch.device, groups: int = 1, prefill: bool = False) -> bool:
    """Whether a W8A8 product of M rows and a weight of `groups` × [N, K] runs on `product`: every
    prefill-size product, or a plain product of a decode batch from `MIN_M` rows with at least
    `MIN_N` outputs; whole 128-row scale blocks, K in whole groups of four 128-blocks (cuBLAS reads
    the weight scales with their K blocks padded to a multiple of 4); sm_90, where cuBLAS
    implements the recipe, under a CUDA build that has it (`BUILD_SUPPORTS`)."""
    decode_batch = groups == 1 and M >= MIN_M and N >= MIN_N
    return ((prefill or decode_batch) and N % BLOCK == 0 and K % (4 * BLOCK) == 0 and BUILD_SUPPORTS
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [M, G·K] bf16 · weight e4m3 [G·N, K] (fp32 128×128 scales [G·N/128, K/128]) → [M, N] bf16
    ([M, G, N] grouped: group g's K columns times rows [g·N, (g+1)·N)): x quantised per 128 along
    K in one launch (128-blocks never straddle groups), its scales stored column by column as
    cuBLAS reads them, then a GEMM per group. cuBLASLt takes rows in multiples of 4 only: up to 3
    zero rows are added and their outputs dropped."""
    M = x.shape[0]
    if M % 4:
        x = torch.nn.functional.pad(x, (0, 0, 0, -M % 4))
    codes, x_scale = act_quant.quantize(x, "triton", scales_by_column=True)
    return gemm(codes, x_scale, weight, scale, groups, x.dtype)[:M]


def gemm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
         out_dtype: torch.dtype) -> torch.Tensor:
    """`product` on quantised rows: codes e4m3 [M, G·K] (M a multiple of 4) with their scales
    [M, G·K/128] stored column by column (`act_quant.quantize(..., scales_by_column=True)`) →
    [M, N] (grouped [M, G, N]) in `out_dtype`, a cuBLAS call a group."""
    K = weight.shape[1]
    N = weight.shape[0] // groups
    kb, nb = K // BLOCK, N // BLOCK
    scale = scale.float()
    outs = [torch._scaled_mm(codes[:, g * K:(g + 1) * K], weight[g * N:(g + 1) * N].t(),
                             x_scale[:, g * kb:(g + 1) * kb], scale[g * nb:(g + 1) * nb].t(), out_dtype=out_dtype)
            for g in range(groups)]
    return outs[0] if groups == 1 else torch.stack(outs, 1)

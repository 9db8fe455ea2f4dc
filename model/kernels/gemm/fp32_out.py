"""Dense products accumulated and returned in fp32: the compressor's, the gate's and the shared
expert's, whose outputs feed softmax-like or gated steps that want fp32."""

from __future__ import annotations

import torch

from model.kernels.common import invariant
from model.kernels.gemm import fixed_matmul


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ accumulated and returned in fp32. bf16 operands stay bf16 on the
    GPU: their products are exact in fp32, so this equals the fp32 GEMM of the upcast operands up
    to the order of the sums, at the tensor cores' bf16 rate and without the fp32 copies.
    `deterministic`: on the GPU the fixed-tile kernel (`fixed_matmul`), not cuBLAS, so a row's
    bits do not depend on M."""
    if x.is_cuda and deterministic:
        if x.dtype != weight.dtype:
            x, weight = x.float(), weight.float()
        return fixed_matmul.linear(x, weight, torch.float32)
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return invariant.linear(x.float(), weight.float())  # the CPU's: rows independent of the batch

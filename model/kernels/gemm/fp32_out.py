"""Dense products accumulated and returned in fp32: the compressor's, the gate's and the shared
expert's, whose outputs feed softmax-like or gated steps that want fp32."""

from __future__ import annotations

import torch

from model.kernels.common import invariant


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ accumulated and returned in fp32. bf16 operands stay bf16 on the
    GPU: their products are exact in fp32, so this equals the fp32 GEMM of the upcast operands up
    to the order of the sums, at the tensor cores' bf16 rate and without the fp32 copies."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return invariant.linear(x.float(), weight.float())  # the CPU's: rows independent of the batch

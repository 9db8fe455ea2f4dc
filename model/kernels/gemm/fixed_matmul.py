"""Dense products whose rows do not depend on the batch: y = x · wᵀ with one tile shape for every M.

cuBLAS picks its algorithm, tile and K split by the matrix shape, so the bits of one row of
`F.linear(x, w)` change with the number of rows M. Under `--deterministic` the model's dense
float products on a GPU (the LM head, the gate, the compressors' and the indexer's bf16 products,
`invariant.Linear`, `linear_fp32_out`) run this kernel instead: tiles of `BLOCK_M` rows × a
weight-row count set by the weight alone (`config`), K walked in `BLOCK_K` steps from 0 in one
accumulator, no split. Every row is then computed by the same instructions in the same order
whatever M is, and which tile or tile row it lands in changes nothing (the MMA's sums per output
element do not depend on the element's place in the tile). Slower than cuBLAS for prefill-size products; the mode's cost is
measured by benchmarks/research/deterministic_cost_bench.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.common.pdl import launch_options, wait

BLOCK_M = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3
# weight rows a tile: 128 for wide products (the LM head), 32 below `WIDE_N` rows, so that a
# narrow product (the gate's 256 rows) still spreads over several programs at one token
WIDE_N = 4096


def config(N: int) -> dict:
    """The launch configuration of every product with N weight rows, whatever its M."""
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": 128 if N >= WIDE_N else 32, "BLOCK_K": BLOCK_K, "num_warps": NUM_WARPS,
            "num_stages": NUM_STAGES}


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ → [..., N] in `out_dtype` (default x's), fp32 accumulation.
    Operands of one float dtype (bf16 on the GPU; fp32 is multiplied in full fp32, not TF32)."""
    if x.dtype != weight.dtype:
        raise ValueError(f"fixed_matmul.linear needs operands of one dtype, got {x.dtype} and {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fixed_matmul.linear: x has K = {x.shape[-1]}, weight [N, K] = {tuple(weight.shape)}")
    lead, K, N = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        cfg = config(N)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
        _matmul_kernel[grid](x2, weight, out, M, N, K, x2.stride(0), weight.stride(0), out.stride(0),
                             IEEE=x.dtype == torch.float32, **cfg, **launch_options(x2))
    return out.view(*lead, N)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Output tile (program 1: rows, program 0: weight rows; a weight tile's row tiles run side by
    side) of y = x · wᵀ, K from 0 up in one fp32 accumulator."""
    wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])

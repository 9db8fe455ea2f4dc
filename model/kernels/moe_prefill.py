"""Prefill-sized MoE on FP4 experts: the routed experts in the SWAP orientation with pre-ordered
activations, the shared expert as dense GEMMs.

Why: with tokens on the MMA's M side (the grouped path's prefill tiles), every K step writes the
dequantised weight tile to shared memory for the tensor cores, and that round trip, not the MMA,
bounds the kernel. With the weights on the M side (SWAP, as the decode path) they stay in
registers as wgmma's A operand; the activations become the B operand, which must come from shared
memory in `fp4.mma_order` pairs. `moe_grouped.preorder` lays x out in that order once per layer
(one copy of [T, D] bf16), and the gate/up kernel writes h in it directly, so both kernels'
activation tiles go from global to shared memory untouched (the fused decode path does the same).

Layout (`moe_grouped.preorder`): row t of x [T, K] becomes [x[t, 0::2] | x[t, 1::2]], each half permuted
within every 16 columns by `mma_order` (column 16i + 4q + 2h + r → 16i + 8h + 2q + r).

The shared expert (FP8, one per token) runs as dense cuBLAS GEMMs on its dequantised weights: a
[T, D] × [D, 2I] product has nothing grouped about it (the fused decode path runs it in the
kernels, on x in natural order). Semantics are `moe_grouped.reference`'s (h in bf16, fp32 sums): the shared
expert's products return fp32 (cuBLAS with an fp32 output on the GPU; fp32 math elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from model import quant
from model.kernels import fp8_gemm
from model.kernels.fp4 import FP8_BLOCK
from model.kernels.moe_grouped import Tiles, fit, run_kernels
from model.quantized import linear_fp32_out

if TYPE_CHECKING:
    from model.moe import PackedExperts

# 128 tokens per program on the MMA's N side: a V4-Flash expert gets ~190 rows of an 8K prefill
# (T·k/E), so 128 covers most of it in one pass over the weights; two warpgroups of 64 (gate/up)
# or 128 (down) weight rows (benchmarks/moe_bench.py's sweep, H100, T = 8192: 8.8 ms for the
# layer's experts against 9.6 with 64-row down tiles and 11.1 for the grouped path's best).
PREFILL_GATEUP = Tiles(BT=128, BN=128, BK=128, num_warps=8, num_stages=3, swap_ab=True)
PREFILL_DOWN = Tiles(BT=128, BN=256, BK=128, num_warps=8, num_stages=3, swap_ab=True)
# From here on `MoE` takes this path for FP4 experts (below: the fused decode path or, on hash
# layers, the grouped one); the fused path's ceiling is 256 tokens.
MIN_TOKENS = 512


def _bf16_weights(shared: "PackedExperts") -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 shared expert → (w13 [2I, D], w2 [D, I]) bf16, exact (e4m3 times a power of two), in
    one pass per matrix."""
    if shared.fmt != "fp8":
        w1, w3, w2 = (w.to(torch.bfloat16) for w in shared.dequantize(0))
        return torch.cat([w1, w3]), w2
    I, ib = shared.inter, -(-shared.inter // FP8_BLOCK)

    def dq(w: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
        return fp8_gemm.dequantize(w, quant.ue8m0_byte_to_scale(scale_bytes), torch.bfloat16)

    w1, w3 = dq(shared.w13[0, :I], shared.w13_scale[0, :ib]), dq(shared.w13[0, I:], shared.w13_scale[0, ib:])
    return torch.cat([w1, w3]), dq(shared.w2[0], shared.w2_scale[0])


def shared_expert(x: torch.Tensor, shared: "PackedExperts", limit: float) -> torch.Tensor:
    """x [T, D] → the shared expert's output [T, D] float32 (x and h rounded to bf16, as the kernels)."""
    w13, w2 = _bf16_weights(shared)
    return linear_fp32_out(swiglu_bf16(linear_fp32_out(x.to(torch.bfloat16), w13), limit), w2)


def swiglu_bf16(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [T, 2I] float32 (gate | up) → h = silu(min(gate, L)) · clamp(up, ±L) [T, I] bf16, one
    pass (torch's clamps, silu, product and cast took five over the fp32 [T, 2I])."""
    T, two_i = gate_up.shape
    h = torch.empty(T, two_i // 2, dtype=torch.bfloat16, device=gate_up.device)
    if T:
        bi = min(1024, triton.next_power_of_2(two_i // 2))
        _swiglu_kernel[(T, triton.cdiv(two_i // 2, bi))](gate_up, gate_up.stride(0), h, two_i // 2, float(limit),
                                                         CLAMP=limit > 0, BI=bi, num_warps=4)
    return h


@triton.jit
def _swiglu_kernel(gu_ptr, stride_gu, h_ptr, I, limit, CLAMP: tl.constexpr, BI: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = offs < I
    gate = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
    up = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(h_ptr + t * I + offs, (gate * tl.sigmoid(gate) * up).to(tl.bfloat16), mask=mask)


def prefill_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
                shared: "PackedExperts | None", limit: float, gateup: Tiles = PREFILL_GATEUP,
                down: Tiles = PREFILL_DOWN) -> torch.Tensor:
    """x [T, D], routing weights/ids [T, k] → [T, D] in x.dtype (FP4 routed experts)."""
    s = shared_expert(x, shared, limit) if shared is not None else None
    return run_kernels(x, weights, ids, experts, None, limit,
                       fit(gateup, experts.inter, experts.dim), fit(down, experts.dim, experts.inter),
                       fuse_combine=False, preordered=True, add=s)  # Σ over slots + s, rounded once

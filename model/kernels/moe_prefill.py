"""Prefill-sized MoE on FP4 experts: the routed experts in the SWAP orientation with pre-ordered
activations, the shared expert as dense GEMMs.

Why: with tokens on the MMA's M side (the grouped path's prefill tiles), every K step writes the
dequantised weight tile to shared memory for the tensor cores, and that round trip, not the MMA,
bounds the kernel. With the weights on the M side (SWAP, as the decode path) they stay in
registers as wgmma's A operand; the activations become the B operand, which must come from shared
memory in `fp4.mma_order` pairs. `preorder` lays x out in that order once per layer (one copy of
[T, D] bf16), and the gate/up kernel writes h in it directly, so both kernels' activation tiles
go from global to shared memory untouched.

Layout (`preorder`): row t of x [T, K] becomes [x[t, 0::2] | x[t, 1::2]], each half permuted
within every 16 columns by `mma_order` (column 16i + 4q + 2h + r → 16i + 8h + 2q + r).

The shared expert (FP8, one per token) runs as dense cuBLAS GEMMs on its dequantised weights: a
[T, D] × [D, 2I] product has nothing grouped about it, and the kernels' SWAP FP8 path would need
x in a second order. Semantics are `moe_grouped.reference`'s (h in bf16, fp32 sums): the shared
expert's products return fp32 (cuBLAS with an fp32 output on the GPU; fp32 math elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from model.kernels.moe_grouped import Tiles, fit, run_kernels

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


def preorder(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K % 32 == 0) → [T, K] in the layout above (a contiguous copy)."""
    T, K = x.shape
    if K % 32:
        raise ValueError(f"preorder needs K divisible by 32, got {K}")
    # (t, i, q, h, r, parity) with column 32i + 8q + 4h + 2r + parity → (t, parity, i, h, q, r)
    return x.reshape(T, K // 32, 4, 2, 2, 2).permute(0, 5, 1, 3, 2, 4).reshape(T, K)


def _mm_f32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] · w [N, K]ᵀ → [M, N] float32 from bf16 operands (products exact, fp32 sums)."""
    if a.is_cuda:
        return torch.mm(a, w.t(), out_dtype=torch.float32)
    return F.linear(a.float(), w.float())


def shared_expert(x: torch.Tensor, shared: "PackedExperts", limit: float) -> torch.Tensor:
    """x [T, D] → the shared expert's output [T, D] float32 (x and h rounded to bf16, as the kernels)."""
    w1, w3, w2 = (w.to(torch.bfloat16) for w in shared.dequantize(0))  # FP8 values: exact in bf16
    gate, up = _mm_f32(x.to(torch.bfloat16), torch.cat([w1, w3])).chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return _mm_f32((F.silu(gate) * up).to(torch.bfloat16), w2)


def prefill_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
                shared: "PackedExperts | None", limit: float, gateup: Tiles = PREFILL_GATEUP,
                down: Tiles = PREFILL_DOWN) -> torch.Tensor:
    """x [T, D], routing weights/ids [T, k] → [T, D] in x.dtype (FP4 routed experts)."""
    T, k = ids.shape
    y = run_kernels(preorder(x.contiguous()), weights, ids, experts, None, limit,
                    fit(gateup, experts.inter, experts.dim), fit(down, experts.dim, experts.inter),
                    fuse_combine=False, preordered=True)  # Σ over slots, x.dtype
    if shared is None:
        return y
    return (y.float() + shared_expert(x, shared, limit)).to(x.dtype)

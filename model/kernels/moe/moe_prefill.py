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

The shared expert (FP8, one per token) runs as dense cuBLAS GEMMs on its dequantised weights
(kernels/moe/moe_shared.py), its fp32 output added to the routed sum before the one rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model.kernels.moe.moe_grouped import Tiles, fit, run_kernels
from model.kernels.moe.moe_shared import shared_expert

if TYPE_CHECKING:
    from model.kernels.moe.packed_experts import PackedExperts

# 128 tokens per program on the MMA's N side: a V4-Flash expert gets ~190 rows of an 8K prefill
# (T·k/E), so 128 covers most of it in one pass over the weights; two warpgroups of 64 (gate/up)
# or 128 (down) weight rows, the fastest in benchmarks/moe_bench.py's sweep (docs/results.md, prefill).
# Not settled, unlike the decode tiles (kernels/moe/moe_fused.py says why those are): with 128 tokens a
# step the products' overlap with the next step's conversion is worth more than settling.
PREFILL_GATEUP = Tiles(BT=128, BN=128, BK=128, num_warps=8, num_stages=3, swap_ab=True)
PREFILL_DOWN = Tiles(BT=128, BN=256, BK=128, num_warps=8, num_stages=3, swap_ab=True)
# From here on `MoE` takes this path for FP4 experts (below: the fused decode path or, on hash
# layers, the grouped one); the fused path's ceiling is 256 tokens.
MIN_TOKENS = 512


def prefill_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
                shared: "PackedExperts | None", limit: float, gateup: Tiles = PREFILL_GATEUP,
                down: Tiles = PREFILL_DOWN) -> torch.Tensor:
    """x [T, D], routing weights/ids [T, k] → [T, D] in x.dtype (FP4 routed experts)."""
    s = shared_expert(x, shared, limit) if shared is not None else None
    return run_kernels(x, weights, ids, experts, None, limit,
                       fit(gateup, experts.inter, experts.dim), fit(down, experts.dim, experts.inter),
                       fuse_combine=False, preordered=True, add=s)  # Σ over slots + s, rounded once

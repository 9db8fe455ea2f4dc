"""MegaMoE-style fused decode MoE: routed and shared experts of a small batch in three launches.

For T tokens (decode, up to `MoE.fused_max_tokens`), after the routing (gate GEMM, score, top-k:
torch, no host sync), the T·k routed assignments and T shared ones (a virtual expert E in FP8)
go through

1. `_count_sort_kernel`: per-expert counts and the assignments grouped by expert (one program),
   and with FP4 experts x copied into `preorder`'s layout by its other programs.
2. `_gateup_kernel`: every (expert token tile, 64 columns of I) program streams its expert's w1/w3
   rows once, dequantising FP4 (or FP8) in registers, and applies the clamped SwiGLU in the
   epilogue → h [A, I] bf16. Its programs also zero the arrival counters of launch 3.
3. `_down_kernel`: every (token tile, 128 columns of D) program streams w2 rows, multiplies by the
   routing weights and publishes per-(token, slot) rows; the program completing a token's k + 1
   contributions sums them in slot order into `out` (the combine; deterministic).

Why not fewer: the down product of an expert needs all I columns of its h rows, written by I/BN
different programs of launch 2, and those need the sort's counts to know their expert. Merging
across either boundary needs a grid-wide wait (programs spinning on flags), which deadlocks
unless every program of the grid is resident at once; a launch boundary is that barrier for
free. The combine rides on launch 3 through the arrival counters instead of a fourth kernel, and
the counters are zeroed by launch 2 instead of a memset. From `moe_shared.DENSE_MIN_TOKENS`
tokens the shared expert is not among the assignments: it runs as dense FP8 products (three
more launches; on a side stream when given, beside launches 1-2), and launch 3, which waits for
them, adds its fp32 row after the routed slots in its combine. All
grids are functions of T only and nothing reads device values on the host, so a decode step is
capturable in a CUDA graph.

Every weight byte of a hit expert is read once per token tile; with up to 16 tokens per tile (BT)
a decode step reads each hit expert about once — the bandwidth floor benchmarks/moe_bench.py
compares against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from model.kernels.moe import moe_shared
from model.kernels.moe.moe_grouped import Tiles, fit, plan_kernels

if TYPE_CHECKING:
    from model.kernels.moe.packed_experts import PackedExperts

# Decode tiles: 16 tokens (tl.dot's minimum) against 64 or 128 weight rows (one or two wgmma M
# tiles of a 4-warp warpgroup), 128 K (one FP8 scale block; 64 bytes of FP4 per row and step).
# 3 stages: a gate/up program's buffers stay under 40 KB of shared memory.
#
# Every decode tile settles (`Tiles.settle`): each K step's products finish before the next step
# converts weights into registers, so no wgmma group is pending at the loop's back edge
# (tests/model/test_moe_hopper_build.py checks the PTX). Triton 3.6 miscompiles a pending one: the
# next step may overwrite registers it still reads (triton-lang/triton#9433, fixed after 3.6).
# Settled, the decode kernels also need fewer registers and are no slower; the prefill tiles do
# not settle (kernels/moe/moe_prefill.py says why).
DECODE_GATEUP = Tiles(BT=16, BN=64, BK=128, num_warps=4, num_stages=3, swap_ab=True, settle=True)
DECODE_DOWN = Tiles(BT=16, BN=128, BK=128, num_warps=4, num_stages=3, swap_ab=True, settle=True)
# A step of a few tokens hits ~7 experts: its programs are latency-bound, so a deeper pipeline and
# twice the down programs pay there; from 8 tokens on the tiles above are as fast or faster
# (docs/results.md, fused MoE).
# The K loops are split too (`Tiles.split_k`): a step of one token has 7 token tiles, so 224
# gate/up programs of 32 K steps each for 132 SMs, and each program's steps wait on the last.
SMALL_T = 4
SMALL_GATEUP = Tiles(BT=16, BN=64, BK=128, num_warps=4, num_stages=3, swap_ab=True, split_k=4, settle=True)
# The down programs are capped at 80 registers so that five fit an SM instead of four (uncapped,
# they spill anyway).
SMALL_DOWN = Tiles(BT=16, BN=64, BK=128, num_warps=4, num_stages=4, swap_ab=True, split_k=2, maxnreg=80,
                   settle=True)
# Two to four tokens hit up to 24 tiles: half the gate/up split and the down unsplit fill the GPU
# as well with fewer, longer programs (docs/journal/, decode MoE tiles).
FEW_GATEUP = replace(SMALL_GATEUP, split_k=2)
FEW_DOWN = replace(SMALL_DOWN, split_k=1)
# Up to here the decode tiles beat the grouped path's 128-token tiles (docs/results.md, fused
# MoE); the grouped path takes them too at these sizes.
DECODE_MAX_TOKENS = 256


# `--deterministic` (`deterministic_moe`): a token's sums run in one order at every step size. Up
# to `SMALL_T` tokens on the one-token tiles, whose K is split over programs in a fixed count of
# ranges, summed in split order; above, on the decode tiles walking the same ranges in one program
# (`Tiles.k_ranges`), which gives the same bits: a row's sums do not depend on the tile's other
# rows or its shape, only on its K order. So the steps of a few tokens keep the split that fills
# the GPU there and larger ones the tiles that fill it without.
DETERMINISTIC_GATEUP = replace(DECODE_GATEUP, k_ranges=SMALL_GATEUP.split_k)
DETERMINISTIC_DOWN = replace(DECODE_DOWN, k_ranges=SMALL_DOWN.split_k)


def decode_tiles(tokens: int, deterministic: bool = False) -> tuple[Tiles, Tiles]:
    """(gate/up, down) tiles for a step of `tokens` tokens (a graph captures one size, so the
    choice is fixed per captured step); `deterministic`: tiles of one K order for every size."""
    if deterministic:
        return (SMALL_GATEUP, SMALL_DOWN) if tokens <= SMALL_T else (DETERMINISTIC_GATEUP, DETERMINISTIC_DOWN)
    if tokens <= 1:
        return SMALL_GATEUP, SMALL_DOWN
    return (FEW_GATEUP, FEW_DOWN) if tokens <= SMALL_T else (DECODE_GATEUP, DECODE_DOWN)


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
              shared: "PackedExperts | None", limit: float, gateup: Tiles | None = None,
              down: Tiles | None = None, shared_dense: bool | None = None,
              side: "torch.cuda.Stream | None" = None, deterministic: bool = False) -> torch.Tensor:
    """x [T, D], routing weights/ids [T, k] → [T, D] in x.dtype; semantics of `moe_grouped.reference`.
    Tiles default to `decode_tiles(T)`; the shared expert runs as dense products outside the
    kernels (`shared_dense`) from `moe_shared.DENSE_MIN_TOKENS` tokens by default, on stream
    `side` when given, beside the sort and gate/up kernels (the down kernel waits for it);
    `deterministic`: those products at one configuration for every T."""
    default_gateup, default_down = decode_tiles(x.shape[0])
    gateup, down = gateup or default_gateup, down or default_down
    # FP4 on SWAP tiles: the routed experts read a `preorder` copy of x (activation tiles without
    # in-register permutes, which cost more than the copy)
    preordered = experts.fmt == "fp4" and gateup.swap_ab and down.swap_ab
    shared, add, join = moe_shared.split_shared(x, shared, limit, shared_dense, side, deterministic)
    launches, result = plan_kernels(x, weights, ids, experts, shared, limit, fit(gateup, experts.inter, experts.dim),
                                    fit(down, experts.dim, experts.inter), fuse_combine=True,
                                    preordered=preordered, add=add)
    for launch in launches[:-1]:
        launch()
    join()  # the down kernel's combine adds the shared expert's rows
    for launch in launches[-1:]:
        launch()
    return result()


def deterministic_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: PackedExperts,
                      shared: PackedExperts | None, limit: float,
                      side: "torch.cuda.Stream | None" = None) -> torch.Tensor:
    """`fused_moe` under `--deterministic`, for every step size and layer kind: tiles of one K order
    for every T (`decode_tiles(T, deterministic=True)`; a token tile's rows are computed
    independently, so a token's products do not depend on which others share its expert), the
    shared expert always as dense products at one configuration for every T (on `side` when
    given, as `fused_moe` runs it), the combine in slot order. Steps above `DECODE_MAX_TOKENS` run
    in slices of that many tokens (the counting sort's one program holds a step's assignments)."""
    gateup, down = decode_tiles(x.shape[0], deterministic=True)
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return fused_moe(x, weights, ids, experts, shared, limit, gateup, down, shared_dense=True, side=side,
                         deterministic=True)
    out = torch.empty_like(x)
    for lo in range(0, x.shape[0], DECODE_MAX_TOKENS):
        rows = slice(lo, lo + DECODE_MAX_TOKENS)
        out[rows] = fused_moe(x[rows], weights[rows], ids[rows], experts, shared, limit, gateup, down,
                              shared_dense=True, side=side, deterministic=True)
    return out

"""Routed + shared experts on packed weights: the torch reference and the grouped Triton path.

Semantics (`reference`, impl "torch"; every kernel matches it): for each token t and slot j,
y[t, j] = expert_{ids[t, j]}(x[t]) with expert(x) = w2 · (silu(min(w1 x, L)) · clamp(w3 x, ±L)),
weights dequantised exactly (model/low_precision.py) and the products in fp32; then
out[t] = Σ_j weights[t, j] · y[t, j] + shared(x[t]), summed over the slots (`invariant.sum`),
cast to x.dtype.

Triton path. Assignments (t, j) and, with a shared expert, one shared assignment per token (a
virtual expert E in FP8, weight 1) are sorted by expert (`sort_by_expert`: fixed-size torch ops, no
host sync). A "token tile" is up to BT sorted rows of one expert; expert e owns ⌈count_e/BT⌉ tiles,
laid out expert after expert, and each program finds its expert from the counts itself (`_tile`),
so the grid (`max_tiles` × weight tiles) depends on shapes only and tiles past the end exit at once.
The kernels are in kernels/moe/moe_tile_kernels.py; their per-tile products and the in-register
dequantisation are kernels/moe/moe_gemm.py's `w_xt`.

* `_gateup_kernel`: per (token tile, BN columns of I): gate and up accumulators over K = D,
  clamped SwiGLU in the epilogue → h [A, I] bf16 in sorted row order.
* `_down_kernel`: per (token tile, BN columns of D): h · w2ᵀ times the routing weight, written to
  its (token, slot) row of y [T, k(+1), D]. With FUSE_COMBINE (the decode path, kernels/moe/moe_fused.py)
  each program then counts arrivals per (token, column tile) and the program that brings the
  count to k(+1) sums that token's rows in slot order (deterministic) into `out`.

`grouped_moe` (prefill sizes, and the fallback of the fused path) runs the two kernels with
prefill tiles and sums y in torch: the sort, 2 kernels, the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import triton

from model.kernels.common import invariant
from model.kernels.common.fp4 import FP4_K_BLOCK, check_fp4_block, check_fp8_block, reads_wgmma_operand
from model.kernels.common.pdl import launch_options
from model.kernels.moe import moe_combine, moe_shared
from model.kernels.moe.moe_tile_kernels import _count_sort_kernel, _down_kernel, _gateup_kernel

if TYPE_CHECKING:
    from model.kernels.moe.packed_experts import PackedExperts


# ---------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------

def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """x [n, D], w1/w3 [I, D], w2 [D, I] → [n, D]; clamping as the checkpoint was trained (limit 0: none).
    `invariant`'s products and SiLU: a row's output is the same bits whichever rows share its expert."""
    gate, up = invariant.linear(x, w1), invariant.linear(x, w3)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return invariant.linear(invariant.silu(gate) * up, w2)


def expert_outputs(x: torch.Tensor, ids: torch.Tensor, expert: Callable[[int, torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """x [T, D], ids [T, k] → y [T, k, D]: y[t, j] = expert(ids[t, j], rows)[t]; one call per hit expert."""
    y = x.new_zeros(*ids.shape, x.shape[-1])
    for e in ids.unique().tolist():  # host sync: the reference, not a decode path
        token, slot = torch.where(ids == e)
        y[token, slot] = expert(e, x[token])
    return y


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """y [T, k, D], weights [T, k] → Σ_j weights · y (`invariant.sum` over the slots) + shared [T, D]:
    fp32 sums, y.dtype out."""
    out = invariant.sum(y.float() * weights.float().unsqueeze(-1), 1)
    return (out if shared is None else out + shared.float()).to(y.dtype)


def reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
              shared: "PackedExperts | None", limit: float) -> torch.Tensor:
    """x [T, D], weights [T, k] float32, ids [T, k] → [T, D] in x.dtype (fp32 inside)."""
    xf = x.float()
    y = expert_outputs(xf, ids, lambda e, rows: swiglu(rows, *experts.dequantize(e), limit))
    s = swiglu(xf, *shared.dequantize(0), limit) if shared is not None else None
    return combine(y, weights, s).to(x.dtype)


# ---------------------------------------------------------------------------------------
# host side: sorting and launching
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiles:
    """One kernel's tile sizes: BT tokens × BN weight rows, BK along K; Triton launch options.
    `swap_ab`: weight rows on the MMA's M side (decode), else tokens (prefill). `split_k`: K split
    over that many programs whose partial sums the last one to finish adds up in split order
    (deterministic; for steps of a few tokens whose programs are too few to keep the memory
    system busy: the fused path's two products, the grouped path's gate/up where the counting sort
    zeroes its arrival counters). `k_ranges`: K walked in one program as that many ranges, each
    summed from zero and added in order, which gives the bits of `split_k` = k_ranges (the
    deterministic mode's tiles for steps that fill the GPU unsplit; a down product's on the fused
    path only, whose combine sums a row per range)."""

    BT: int
    BN: int
    BK: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    split_k: int = 1
    k_ranges: int = 1
    maxnreg: int | None = None  # a cap on registers per thread (ptxas), for more programs per SM
    settle: bool = False  # wgmma tiles: each K step's products finish before the next step (`moe_gemm._settled`)


# Up to this many assignments (a decode step of 256 tokens has 7 a token) the experts are sorted by
# `_count_sort_kernel`, one program, else by `sort_by_expert`'s torch ops: five launches, several
# times the one program's time in a small step's chain
COUNT_SORT_MAX = 2048


def counting_sort_runs(assignments: int, fuse_combine: bool = False) -> bool:
    """Whether `plan_kernels` sorts `assignments` (T·k, + T with the shared expert in the kernels)
    with the counting-sort launch, which also zeroes the split gate/up's arrival counters."""
    return fuse_combine or assignments <= COUNT_SORT_MAX


# Prefill-sized T: large tiles amortise the in-register dequantisation over 128 tokens.
GROUPED_GATEUP = Tiles(BT=128, BN=64, BK=64, num_warps=8, num_stages=3)
GROUPED_DOWN = Tiles(BT=128, BN=128, BK=64, num_warps=8, num_stages=3)


def sort_by_expert(ids: torch.Tensor, n_experts: int, with_shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] → (perm int32 [A]: assignment indices sorted by expert, counts int32 [E(+1)]).

    Assignment a < T·k is (token a // k, slot a % k); with a shared expert, a = T·k + t is token t's
    shared assignment, expert n_experts. Fixed-size ops only (a stable argsort, a scatter-add)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    if with_shared:
        flat = torch.cat([flat, flat.new_full((T,), n_experts)])
    perm = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(n_experts + with_shared, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return perm, counts


def max_tiles(assignments: int, groups: int, bt: int) -> int:
    """Upper bound of Σ_e ⌈count_e / bt⌉ over any routing: at most one partial tile per hit group."""
    return triton.cdiv(assignments, bt) + min(groups, assignments)


def check_inputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
                 shared: "PackedExperts | None") -> None:
    if x.dim() != 2 or x.shape[1] != experts.dim:
        raise ValueError(f"x must be [T, {experts.dim}], got {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"ids and weights must both be [T={x.shape[0]}, k], got {tuple(ids.shape)} "
                         f"and {tuple(weights.shape)}")
    if shared is not None and (shared.fmt != "fp8" or shared.n_experts != 1 or shared.dim != experts.dim
                               or shared.inter != experts.inter):
        raise ValueError("the shared expert must be one FP8 expert of the routed experts' shape")
    devices = {t.device for t in (x, weights, ids, experts.w13)}
    if len(devices) != 1:
        raise ValueError(f"MoE inputs and weights must be on one device, got {sorted(map(str, devices))}")


def check_tiles(t: Tiles, n: int, k: int, fmt: str, what: str) -> None:
    for name, v in (("BT", t.BT), ("BN", t.BN)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{what}: {name}={v} must be a power of two >= 16 (tl.dot)")
    if n % t.BN:
        raise ValueError(f"{what}: BN={t.BN} must divide the {n} weight rows")
    if k % t.BK:
        raise ValueError(f"{what}: BK={t.BK} must divide K={k}")
    if t.split_k < 1 or k % (t.split_k * t.BK):
        raise ValueError(f"{what}: split_k={t.split_k} K ranges of whole BK={t.BK} steps must cover K={k}")
    if t.k_ranges < 1 or k % (t.k_ranges * t.BK) or (t.k_ranges > 1 and t.split_k > 1):
        raise ValueError(f"{what}: k_ranges={t.k_ranges} K ranges of whole BK={t.BK} steps must cover K={k}, "
                         f"with split_k 1 (got {t.split_k})")
    (check_fp4_block if fmt == "fp4" else check_fp8_block)(t.BK)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **meta)` (meta: constexprs and launch options)."""

    kernel: Any
    grid: tuple[int, int]
    args: tuple
    meta: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)


def plan_kernels(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
                 shared: "PackedExperts | None", limit: float, gateup: Tiles, down: Tiles, fuse_combine: bool,
                 asm: bool | None = None, preordered: bool = False,
                 add: torch.Tensor | None = None) -> tuple[list[Launch], Callable[[], torch.Tensor]]:
    """Sort the assignments and allocate the outputs; → (the launches: a counting sort (with
    `fuse_combine` or up to `COUNT_SORT_MAX` assignments, else a torch sort before) and the two
    kernels; and what returns out [T, D] in x.dtype once they ran: `out` itself with
    `fuse_combine`, else the sum over slots; either way plus `add` [T, D] fp32 (an output computed
    outside the kernels, such as the dense shared expert of kernels/moe/moe_shared.py) before the one
    rounding).
    `asm`: the PTX dequantisation (default: on CUDA tensors; the interpreter cannot run it).
    `preordered`: the routed experts read x as a `preorder` copy and write h in that layout too
    (FP4, SWAP tiles); the shared expert reads x and writes its rows of h in natural order."""
    check_inputs(x, weights, ids, experts, shared)
    if preordered and (experts.fmt != "fp4" or not (gateup.swap_ab and down.swap_ab)):
        raise ValueError("preordered activations need FP4 experts and SWAP tiles")
    if add is not None and (add.shape != x.shape or add.dtype != torch.float32 or add.device != x.device):
        raise ValueError(f"add must be float32 {tuple(x.shape)} on {x.device}, got {add.dtype} "
                         f"{tuple(add.shape)} on {add.device}")
    T, k = ids.shape
    count_sort = counting_sort_runs(T * (k + (shared is not None)), fuse_combine)
    if not fuse_combine and (down.split_k > 1 or down.k_ranges > 1):
        raise ValueError("a down product in K ranges needs the fused path's arrival counters (fuse_combine)")
    if not count_sort and gateup.split_k > 1:
        raise ValueError(f"a split gate/up product needs the arrival counters the counting sort zeroes (up to "
                         f"{COUNT_SORT_MAX} assignments)")
    D, I, E = experts.dim, experts.inter, experts.n_experts
    for t, n, kk, kb, what in ((gateup, I, D, experts.kb13, "gate/up tiles"), (down, D, I, experts.kb2, "down tiles")):
        check_tiles(t, n, kk, experts.fmt, what)
        if experts.fmt == "fp4" and kb % (t.BK // 2):
            raise ValueError(f"{what}: BK={t.BK} reads {t.BK // 2} code bytes a row per step, more than the "
                             f"{kb} of one K block of the packed experts (`fit` picks a BK that fits)")
        if x.is_cuda and experts.fmt == "fp4" and t.swap_ab and t.BK == 32 and t.BN < 64:
            raise ValueError(f"{what}: FP4 SWAP tiles with BK=32 need BN >= 64 on the GPU: Triton 3.6 compiles "
                             f"the word conversion of BN={t.BN} wrong (tests/gpu/test_fp4_words_cuda.py)")
        if shared is not None:  # the shared expert (FP8) runs in the same programs (BK, or half of it:
            check_fp8_block(t.BK)  # `_shared_bk` halves only BK >= 64, which then still divides 128)
    if T == 0:
        return [], lambda: x.new_zeros(0, D)
    has_shared = shared is not None
    kp1 = k + has_shared
    A = T * kp1
    launches = []
    tiles13 = max_tiles(A, E + has_shared, gateup.BT)
    ks13, ks2 = gateup.split_k, down.split_k
    ranges2 = ks2 * down.k_ranges  # a slot's rows in the fused combine: one per K range
    # split gate/up: partial sums [KS, A, 2I] and an arrival counter per program tile, zeroed by the sort
    part13 = torch.empty(ks13 * A * 2 * I if ks13 > 1 else 1, dtype=torch.float32, device=x.device)
    cnt13 = torch.empty(tiles13 * (I // gateup.BN) if ks13 > 1 else 1, dtype=torch.int32, device=x.device)
    x = x.contiguous()
    if count_sort:  # one counting-sort program instead of the torch sort's launches
        ids = ids.contiguous()
        perm = torch.empty(A, dtype=torch.int32, device=x.device)
        e_pad = triton.next_power_of_2(E + has_shared + 1)  # + a bin for padding
        counts = torch.empty(e_pad, dtype=torch.int32, device=x.device)
        cursor = torch.empty(e_pad, dtype=torch.int32, device=x.device)
        # the `preorder` copy the routed experts read, by the sort's launch: programs 1.. a tile each
        xr = torch.empty_like(x) if preordered else x
        copy_tiles = triton.cdiv(T, PREORDER_TILE[0]) * triton.cdiv(D, PREORDER_TILE[1]) if preordered else 0
        if preordered:
            check_preorder(D)
        # 8 warps from 512 assignments: faster for large steps' sort and copy, equal below
        launches.append(Launch(_count_sort_kernel, (1 + copy_tiles,),
                               (ids, perm, counts, cursor, T * k, A, cnt13, cnt13.numel(), x, xr, T, D),
                               dict(A_PAD=triton.next_power_of_2(A), E_PAD=e_pad, E=E, ZERO13=ks13 > 1,
                                    BT=PREORDER_TILE[0], BC=PREORDER_TILE[1], num_warps=4 if A <= 512 else 8,
                                    num_stages=1, **launch_options(x))))
    else:
        perm, counts = sort_by_expert(ids, E, has_shared)
        xr = preorder(x) if preordered else x  # what the routed experts read
    weights = weights.float().contiguous()
    sw = shared if has_shared else experts  # placeholder pointers when there is no shared expert
    h = torch.empty(A, I, dtype=torch.bfloat16, device=x.device)
    n_cnt = D // down.BN
    if fuse_combine:
        y = torch.empty(T * kp1 * ranges2, D, dtype=torch.float32, device=x.device)
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
        cnt = torch.empty(T, n_cnt, dtype=torch.int32, device=x.device)  # zeroed by _gateup_kernel
    else:
        y = torch.empty(T * kp1, D, dtype=x.dtype, device=x.device)
        out = cnt = y
    fused_add = fuse_combine and add is not None  # else `add` joins the torch sum over slots
    asm = x.is_cuda if asm is None else asm
    # a CPU x with asm: a build for sm_90 (the compile checks)
    hopper = asm and (not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] == 9)
    common = dict(TOPK=k, E=E, E_PAD=triton.next_power_of_2(E + has_shared), FP4=experts.fmt == "fp4",
                  HAS_SHARED=has_shared, ASM=asm, D=D, I=I, XPRE=preordered, **launch_options(x))
    launches += [
        Launch(_gateup_kernel, (tiles13, I // gateup.BN, ks13),
               (xr, x, perm, counts, experts.w13, experts.w13_scale, sw.w13, sw.w13_scale, h, cnt, part13, cnt13,
                T, n_cnt, float(limit), experts.w13.stride(0), experts.w13_scale.stride(0)),
               dict(ZERO_CNT=fuse_combine, CNT_PAD=triton.next_power_of_2(n_cnt), CLAMP=limit > 0,
                    SBK=_shared_bk(gateup, experts.fmt), WKB=experts.kb13, **_tile_meta(gateup, hopper), **common)),
        Launch(_down_kernel, (max_tiles(A, E + has_shared, down.BT), D // down.BN, ks2),
               (h, perm, counts, weights, experts.w2, experts.w2_scale, sw.w2, sw.w2_scale, y, out, cnt,
                add.contiguous() if fused_add else y, T, n_cnt, experts.w2.stride(0), experts.w2_scale.stride(0)),
               dict(FUSE_COMBINE=fuse_combine, ADD=fused_add, WKB=experts.kb2, **_tile_meta(down, hopper), **common)),
    ]
    if x.is_cuda:
        launches = [_operand_checked(launch, experts.operand_checks) for launch in launches]
    if fuse_combine:
        return launches, lambda: out
    return launches, lambda: moe_combine.sum_slots(y.view(T, kp1, D), add, x.dtype)


# Tile [rows, columns] of the `preorder` copy made by the counting sort's extra programs (decode)
PREORDER_TILE = (16, 512)


def check_preorder(K: int) -> None:
    """`preorder`'s layout permutes within every 32 columns: K must be a multiple."""
    if K % 32:
        raise ValueError(f"preorder needs K divisible by 32, got {K}")


def preorder(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K % 32 == 0) → [T, K] as the SWAP tiles' FP4 products read activations: row t
    becomes [x[t, 0::2] | x[t, 1::2]], each half permuted within every 16 columns by `fp4.mma_order`
    (column 16i + 4q + 2h + r → 16i + 8h + 2q + r); a contiguous copy. Activation tiles then go
    from global to shared memory untouched (kernels/moe/moe_prefill.py's docstring)."""
    T, K = x.shape
    check_preorder(K)
    # (t, i, q, h, r, parity) with column 32i + 8q + 4h + 2r + parity → (t, parity, i, h, q, r)
    return x.reshape(T, K // 32, 4, 2, 2, 2).permute(0, 5, 1, 3, 2, 4).reshape(T, K)


def _shared_bk(t: Tiles, fmt: str) -> int:
    """K step of the FP8 shared expert inside gate/up programs tiled for FP4 experts: half of BK on
    SWAP tiles, so that a step moves as many weight bytes as an FP4 one. With the full step its
    buffers would double a decode gate/up program's shared memory at V4-Flash shapes and fit two
    programs per SM instead of five, too few to keep DRAM busy. The down kernel keeps BK: halved
    there, it needs more registers and fits fewer programs, not more."""
    return t.BK // 2 if t.swap_ab and fmt == "fp4" and t.BK >= 64 else t.BK


def _tile_meta(t: Tiles, hopper: bool) -> dict:
    """MMA: the weight tile is a wgmma register operand (Hopper, SWAP, 64 rows per warpgroup), whose
    register order the FP4 conversion reads its words in (kernels/common/fp4.py); smaller tiles run
    mma.sync, which `_operand_checked` does not vouch for, and convert through explicit words."""
    wgmma = hopper and t.swap_ab and t.BN % (16 * t.num_warps) == 0
    cap = {} if t.maxnreg is None else {"maxnreg": t.maxnreg}
    return dict(SWAP=t.swap_ab, MMA=wgmma, BT=t.BT, BN=t.BN, BK=t.BK, KS=t.split_k, KR=t.k_ranges, SETTLE=t.settle,
                num_warps=t.num_warps, num_stages=t.num_stages, **cap)


def _operand_checked(launch: Launch, checks: dict) -> Launch:
    """`launch`, with MMA off where Triton compiled its FP4 conversion on another layout than the
    wgmma operand (kernels/common/fp4.py's `reads_wgmma_operand`): the conversion then assembles its words
    explicitly. Each configuration is compiled and checked once; `checks` keeps the verdicts."""
    if not launch.meta.get("MMA") or not launch.meta.get("FP4"):
        return launch
    key = (launch.kernel.__name__, tuple(sorted(launch.meta.items())))
    if key not in checks:
        compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
        checks[key] = reads_wgmma_operand(compiled.asm["ttgir"])
    return launch if checks[key] else replace(launch, meta={**launch.meta, "MMA": False})


def run_kernels(*args, **kwargs) -> torch.Tensor:
    """`plan_kernels`, launched: out [T, D] in x.dtype."""
    launches, result = plan_kernels(*args, **kwargs)
    for launch in launches:
        launch()
    return result()


def grouped_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: "PackedExperts",
                shared: "PackedExperts | None", limit: float, impl: str,
                gateup: Tiles = GROUPED_GATEUP, down: Tiles = GROUPED_DOWN, shared_dense: bool | None = None,
                side: "torch.cuda.Stream | None" = None) -> torch.Tensor:
    """x [T, D], routing weights/ids [T, k] → [T, D] (x.dtype); impl "torch" is `reference`. The
    shared expert runs as in `moe_fused.fused_moe` (`moe_shared.split_shared`; with `side`, beside
    the expert kernels, joined before the sum over slots)."""
    if impl == "torch":
        return reference(x, weights, ids, experts, shared, limit)
    shared, add, join = moe_shared.split_shared(x, shared, limit, shared_dense, side)
    # (no split down product here: its partial sums need the fused path's combine; gate/up keeps its
    # split where the counting sort runs, which zeroes its arrival counters)
    if not counting_sort_runs(x.shape[0] * (ids.shape[1] + (shared is not None))):
        gateup = replace(gateup, split_k=1)
    down = replace(down, split_k=1)
    # FP4 on SWAP (decode) tiles: x read as the `preorder` copy, as the fused path reads it (natural
    # order costs in-register permutes that are slower than the copy)
    preordered = experts.fmt == "fp4" and gateup.swap_ab and down.swap_ab
    launches, result = plan_kernels(x, weights, ids, experts, shared, limit, fit(gateup, experts.inter, experts.dim),
                                    fit(down, experts.dim, experts.inter), fuse_combine=False,
                                    preordered=preordered, add=add)
    for launch in launches:
        launch()
    join()
    return result()


def fit(t: Tiles, n: int, k: int) -> Tiles:
    """The tile for n weight rows and K = k: BN halved until it divides n (down to 16), BK at most
    the largest power of two up to 128 dividing k (within one K block of packed FP4 experts, one
    FP8 scale block), so that small test models run the same table (V4-Flash shapes keep it)."""
    bn = t.BN
    while n % bn and bn > 16:
        bn //= 2
    bk = min(t.BK, math.gcd(k, 2 * FP4_K_BLOCK))
    ks, kr = t.split_k, t.k_ranges  # cut down alike, so that walked ranges keep the split's bits
    while ks > 1 and k % (ks * bk):
        ks //= 2
    while kr > 1 and k % (kr * bk):
        kr //= 2
    return replace(t, BN=bn, BK=bk, split_k=ks, k_ranges=kr)

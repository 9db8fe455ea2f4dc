"""The Triton kernels of the grouped and fused MoE paths (launched by kernels/moe/moe_grouped.py's
`plan_kernels`, which documents their semantics): the one-program counting sort of the fused
path, the token-tile lookup, the gate/up + clamped SwiGLU kernel and the down + combine kernel.
Their per-tile products are kernels/moe/moe_gemm.py's `w_xt`."""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels.common.fp4 import FP8_BLOCK
from model.kernels.common.pdl import wait
from model.kernels.moe.moe_gemm import w_xt

B8 = tl.constexpr(FP8_BLOCK)  # kernels may only read constexpr globals


@triton.jit
def _count_sort_kernel(ids_ptr, perm_ptr, counts_ptr, cursor_ptr, TK, A, cnt13_ptr, n_cnt13, x_ptr, xr_ptr, T, K,
                       A_PAD: tl.constexpr, E_PAD: tl.constexpr, E: tl.constexpr, ZERO13: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    """Program 0: per-expert counts (shared assignments a >= TK are expert E) and `perm`, the
    assignments grouped by expert. Within an expert the order is whatever the atomics give: a
    tile's rows are computed independently, so it changes no result. ZERO13: also zero the split
    gate/up kernel's arrival counters (a launch before their first use, without a memset).
    Programs 1.. (a grid of more than one): x [T, K] copied into xr in `moe_grouped.preorder`'s
    layout, a [BT, BC] tile each (the launch the copy would have taken on its own)."""
    wait(PDL)
    if tl.program_id(0) > 0:
        tile = tl.program_id(0) - 1
        col_tiles = tl.cdiv(K, BC)
        t = (tile // col_tiles) * BT + tl.arange(0, BT)
        c = (tile % col_tiles) * BC + tl.arange(0, BC)
        rows = t.to(tl.int64)[:, None] * K
        v = tl.load(x_ptr + rows + c[None, :], mask=(t < T)[:, None] & (c < K)[None, :])
        # column 32i + 8q + 4h + 2r + parity → parity·K/2 + 16i + 8h + 2q + r (preorder's permute),
        # done in registers: each parity's BC/2 columns of the tile are then one contiguous store
        # (stored element by element at their scattered places, the copy dominates the launch)
        v = tl.permute(tl.reshape(v, [BT, BC // 32, 4, 2, 2, 2]), [0, 1, 3, 2, 4, 5])  # [.., i, h, q, r, parity]
        even, odd = tl.split(tl.reshape(v, [BT, BC // 2, 2]))
        d = (tile % col_tiles) * (BC // 2) + tl.arange(0, BC // 2)
        m = (t < T)[:, None] & (d < K // 2)[None, :]  # K % 32 == 0: column c < K exactly where d < K/2
        tl.store(xr_ptr + rows + d[None, :], even, mask=m)
        tl.store(xr_ptr + rows + K // 2 + d[None, :], odd, mask=m)
        return
    if ZERO13:
        for i in range(0, n_cnt13, A_PAD):
            z = i + tl.arange(0, A_PAD)
            tl.store(cnt13_ptr + z, tl.zeros([A_PAD], tl.int32), mask=z < n_cnt13)
    a = tl.arange(0, A_PAD)
    e = tl.load(ids_ptr + a, mask=a < TK, other=E).to(tl.int32)
    e = tl.where(a < A, e, E_PAD - 1)  # padding lanes count in a spare bin
    counts = tl.histogram(e, E_PAD)
    idx = tl.arange(0, E_PAD)
    tl.store(counts_ptr + idx, counts)
    tl.store(cursor_ptr + idx, tl.cumsum(counts, 0) - counts)
    tl.debug_barrier()  # cursors stored before any lane takes a position
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=a < A)
    tl.store(perm_ptr + pos, a, mask=a < A)


@triton.jit
def _tile(pid, counts_ptr, n_groups, BT: tl.constexpr, E_PAD: tl.constexpr):
    """Token tile `pid` → (expert, its first sorted row, the expert's end row); first >= end past the last."""
    idx = tl.arange(0, E_PAD)
    c = tl.load(counts_ptr + idx, mask=idx < n_groups, other=0)
    tiles = (c + BT - 1) // BT
    tile_end = tl.cumsum(tiles, 0)
    e = tl.sum((tile_end <= pid).to(tl.int32), 0)
    seg_end = tl.cumsum(c, 0)
    sel = idx == e
    first = tl.sum(tl.where(sel, seg_end - c + (pid - tile_end + tiles) * BT, 0), 0)
    end = tl.sum(tl.where(sel, seg_end, 0), 0)
    return e, first, end


@triton.jit
def _gateup_products(x_ptr, xs_ptr, tok, rmask, e, is_shared, w_ptr, ws_ptr, sw_ptr, sws_ptr, n, stride_we,
                     stride_se, D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr, SWAP: tl.constexpr,
                     ASM: tl.constexpr, MMA: tl.constexpr, XPRE: tl.constexpr, WKB: tl.constexpr, BT: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, SBK: tl.constexpr, NR: tl.constexpr, ks,
                     SETTLE: tl.constexpr):
    """A gate/up tile's (gate, up) sums [BN, BT] over the ks-th of NR K ranges (all of K: NR = 1)."""
    up_blocks: tl.constexpr = (I + B8 - 1) // B8  # FP8 scale rows of w1 before w3's
    if is_shared:
        g, u = w_xt(xs_ptr, tok, rmask, sw_ptr, sws_ptr, n, n // B8, n + I, up_blocks + n // B8,
                     D, False, True, SWAP, ASM, MMA, BN, BT, SBK, KS=NR, ks=ks, SETTLE=SETTLE)
    else:
        w = w_ptr + e.to(tl.int64) * stride_we
        s = ws_ptr + e.to(tl.int64) * stride_se
        if FP4:
            g, u = w_xt(x_ptr, tok, rmask, w, s, n, n, n + I, n + I, D, True, True, SWAP, ASM, MMA, BN, BT, BK,
                        XPRE, 2 * I, WKB, NR, ks, SETTLE)
        else:
            g, u = w_xt(x_ptr, tok, rmask, w, s, n, n // B8, n + I, up_blocks + n // B8,
                         D, False, True, SWAP, ASM, MMA, BN, BT, BK, KS=NR, ks=ks, SETTLE=SETTLE)
    return g, u


@triton.jit
def _gateup_kernel(x_ptr, xs_ptr, perm_ptr, counts_ptr, w_ptr, ws_ptr, sw_ptr, sws_ptr, h_ptr, cnt_ptr, part_ptr, cnt13_ptr,
                   T, n_cnt, limit, stride_we, stride_se,
                   D: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                   FP4: tl.constexpr, HAS_SHARED: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
                   MMA: tl.constexpr, ZERO_CNT: tl.constexpr, CNT_PAD: tl.constexpr, CLAMP: tl.constexpr,
                   XPRE: tl.constexpr, WKB: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SBK: tl.constexpr, KS: tl.constexpr, KR: tl.constexpr = 1, SETTLE: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    wait(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = 0  # compile-time without a split
    if KS > 1:
        pid_k = tl.program_id(2)
    if ZERO_CNT:  # the fused down kernel's arrival counters, zeroed here to save a memset launch
        if (pid_n == 0) & (pid_k == 0):
            t = pid_t * BT + tl.arange(0, BT)
            c = tl.arange(0, CNT_PAD)
            tl.store(cnt_ptr + t[:, None] * n_cnt + c[None, :], tl.zeros([BT, CNT_PAD], tl.int32),
                     mask=(t < T)[:, None] & (c < n_cnt)[None, :])
    e, first, end = _tile(pid_t, counts_ptr, E + HAS_SHARED, BT, E_PAD)
    if first >= end:
        return
    rows = first + tl.arange(0, BT)
    rmask = rows < end
    a = tl.load(perm_ptr + rows, mask=rmask, other=0)
    tok = tl.where(a < T * TOPK, a // TOPK, a - T * TOPK)
    n = pid_n * BN + tl.arange(0, BN)
    is_shared = False  # stays a compile-time False without a shared expert: one branch compiled
    if HAS_SHARED:
        is_shared = e == E
    if KR > 1:  # K walked as KR ranges, each summed from zero, added in order: the split's sums
        g = tl.zeros([BN, BT], dtype=tl.float32)
        u = tl.zeros([BN, BT], dtype=tl.float32)
        for j in tl.static_range(KR):
            gj, uj = _gateup_products(x_ptr, xs_ptr, tok, rmask, e, is_shared, w_ptr, ws_ptr, sw_ptr, sws_ptr, n,
                                      stride_we, stride_se, D, I, FP4, SWAP, ASM, MMA, XPRE, WKB, BT, BN, BK, SBK,
                                      KR, j, SETTLE)
            g += gj
            u += uj
    else:
        g, u = _gateup_products(x_ptr, xs_ptr, tok, rmask, e, is_shared, w_ptr, ws_ptr, sw_ptr, sws_ptr, n,
                                stride_we, stride_se, D, I, FP4, SWAP, ASM, MMA, XPRE, WKB, BT, BN, BK, SBK,
                                KS, pid_k, SETTLE)
    if KS > 1:
        # publish this K range's sums; the program that completes the tile adds all KS in split
        # order (barrier and acq_rel as in the down kernel's combine)
        A = T * (TOPK + HAS_SHARED)
        slot = part_ptr + (pid_k * A + rows[None, :]).to(tl.int64) * (2 * I) + n[:, None]
        tl.store(slot, g, mask=rmask[None, :], cache_modifier=".cg")
        tl.store(slot + I, u, mask=rmask[None, :], cache_modifier=".cg")
        tl.debug_barrier()
        old = tl.atomic_add(cnt13_ptr + pid_t * tl.num_programs(1) + pid_n, 1, sem="acq_rel", scope="gpu")
        if old != KS - 1:
            return
        tl.debug_barrier()
        g = tl.zeros([BN, BT], dtype=tl.float32)
        u = tl.zeros([BN, BT], dtype=tl.float32)
        for j in tl.static_range(KS):
            slot = part_ptr + (j * A + rows[None, :]).to(tl.int64) * (2 * I) + n[:, None]
            g += tl.load(slot, mask=rmask[None, :], other=0.0, cache_modifier=".cg")
            u += tl.load(slot + I, mask=rmask[None, :], other=0.0, cache_modifier=".cg")
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    col = n
    if XPRE:  # a routed row's column n in `preorder`'s layout (the down product's K order); the
        m = n // 2  # shared expert's rows stay in natural order, as its down product reads them
        pre = (n % 2) * (I // 2) + (m // 16) * 16 + ((m // 2) % 2) * 8 + ((m % 16) // 4) * 2 + m % 2
        col = tl.where(is_shared, n, pre)
    tl.store(h_ptr + rows[None, :] * I + col[:, None], h.to(tl.bfloat16), mask=rmask[None, :])


@triton.jit
def _down_kernel(h_ptr, perm_ptr, counts_ptr, wgt_ptr, w_ptr, ws_ptr, sw_ptr, sws_ptr, y_ptr, out_ptr, cnt_ptr,
                 add_ptr, T, n_cnt, stride_we, stride_se,
                 D: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                 FP4: tl.constexpr, HAS_SHARED: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
                 MMA: tl.constexpr, FUSE_COMBINE: tl.constexpr, ADD: tl.constexpr, XPRE: tl.constexpr, WKB: tl.constexpr,
                 BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, KR: tl.constexpr = 1,
                 SETTLE: tl.constexpr = False, PDL: tl.constexpr = False):
    wait(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = 0  # compile-time without a split
    if KS > 1:
        pid_k = tl.program_id(2)
    e, first, end = _tile(pid_t, counts_ptr, E + HAS_SHARED, BT, E_PAD)
    if first >= end:
        return
    KP1: tl.constexpr = TOPK + HAS_SHARED
    rows = first + tl.arange(0, BT)
    rmask = rows < end
    a = tl.load(perm_ptr + rows, mask=rmask, other=0)
    routed = a < T * TOPK
    tok = tl.where(routed, a // TOPK, a - T * TOPK)
    slot = tok * KP1 + tl.where(routed, a % TOPK, TOPK)
    wgt = tl.load(wgt_ptr + a, mask=rmask & routed, other=1.0)
    d = pid_n * BN + tl.arange(0, BN)
    is_shared = False
    if HAS_SHARED:
        is_shared = e == E
    # a slot holds NR K ranges' rows: KS programs' or KR walked here (one of the two is 1)
    NR: tl.constexpr = KS * KR
    for j in tl.static_range(KR):
        acc = _down_products(h_ptr, rows, rmask, e, is_shared, w_ptr, ws_ptr, sw_ptr, sws_ptr, d, stride_we,
                             stride_se, D, I, FP4, SWAP, ASM, MMA, XPRE, WKB, BT, BN, BK, NR, pid_k + j, SETTLE)
        y = acc * wgt[None, :]
        y_ptrs = y_ptr + (slot * NR + pid_k + j)[None, :] * D + d[:, None]
        if FUSE_COMBINE:
            tl.store(y_ptrs, y, mask=rmask[None, :], cache_modifier=".cg")
        else:
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=rmask[None, :])
    if FUSE_COMBINE:
        # Deterministic combine without a third launch: publish this tile's rows (L2, bypassing
        # L1, above), then count arrivals per (token, column tile); the program completing a
        # token's k(+1) contributions (times NR K ranges) sums them in slot order, then ADD's row
        # (an output computed outside the kernels: the dense shared expert). The barrier orders
        # every thread's stores before the release of the counter update; the acquire orders the
        # loads after it.
        tl.debug_barrier()
        old = tl.atomic_add(cnt_ptr + tok * n_cnt + pid_n, KR, mask=rmask, sem="acq_rel", scope="gpu")
        last = rmask & (old == KP1 * NR - KR)
        tl.debug_barrier()
        total = tl.zeros([BN, BT], dtype=tl.float32)
        for j in tl.static_range(KP1 * NR):
            total += tl.load(y_ptr + (tok * KP1 * NR + j)[None, :] * D + d[:, None], mask=last[None, :], other=0.0,
                             cache_modifier=".cg")
        if ADD:
            total += tl.load(add_ptr + tok[None, :] * D + d[:, None], mask=last[None, :], other=0.0)
        tl.store(out_ptr + tok[None, :] * D + d[:, None], total.to(out_ptr.dtype.element_ty), mask=last[None, :])


@triton.jit
def _down_products(h_ptr, rows, rmask, e, is_shared, w_ptr, ws_ptr, sw_ptr, sws_ptr, d, stride_we, stride_se,
                   D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
                   MMA: tl.constexpr, XPRE: tl.constexpr, WKB: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, NR: tl.constexpr, ks, SETTLE: tl.constexpr):
    """A down tile's sums [BN, BT] over the ks-th of NR K ranges (all of K: NR = 1)."""
    if is_shared:
        acc, _ = w_xt(h_ptr, rows, rmask, sw_ptr, sws_ptr, d, d // B8, d, d, I, False, False, SWAP, ASM, MMA,
                      BN, BT, BK, KS=NR, ks=ks, SETTLE=SETTLE)
    else:
        w = w_ptr + e.to(tl.int64) * stride_we
        s = ws_ptr + e.to(tl.int64) * stride_se
        if FP4:
            acc, _ = w_xt(h_ptr, rows, rmask, w, s, d, d, d, d, I, True, False, SWAP, ASM, MMA, BN, BT, BK,
                          XPRE, D, WKB, NR, ks, SETTLE)
        else:
            acc, _ = w_xt(h_ptr, rows, rmask, w, s, d, d // B8, d, d, I, False, False, SWAP, ASM, MMA, BN, BT, BK,
                          KS=NR, ks=ks, SETTLE=SETTLE)
    return acc

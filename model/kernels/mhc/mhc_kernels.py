"""The Triton kernels of mHC (launched and documented by kernels/mhc/mhc.py).

`_entry_small_kernel` is a whole sub-block entry of a few tokens in one launch: the previous
sub-block's pending `hc_post`, the mixes, pre / post / Sinkhorn comb, the collapse and its RMSNorm.
A decode batch's entry is `_settle_mix_kernel` (hc_post and the mixes, split over token blocks and
D columns) and `_collapse_kernel` (a program a token: the collapse, its RMSNorm, post and comb).
From more tokens the entry is `_post_kernel` (hc_post), `_mix_kernel` (the mixes on the tensor
cores, K split over programs when there are few token blocks) and `_pre_kernel` (pre / post /
Sinkhorn comb and the collapse), then the RMSNorm (kernels/common/rmsnorm.py). The Sinkhorn chain is
kernels/mhc/sinkhorn.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels.common.pdl import wait
from model.kernels.mhc.sinkhorn import entry, sinkhorn


@triton.jit
def _split(v):
    """fp32 → bf16 hi + lo with hi + lo ≈ v to ~16 mantissa bits."""
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _rounded(v, ROUND_BF16: tl.constexpr):
    """v (fp32) rounded through bf16 where the reference (hc_post in the activations' dtype) rounds."""
    if ROUND_BF16:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _fn_dot(acc, x_hi, x_lo, fn_ptr, row0, n_rows, offs_k, K, NP: tl.constexpr, X_FP32: tl.constexpr):
    """acc [BT, NP] += x [BT, BK] · fn[row0 : row0+n_rows, offs_k]ᵀ (rows past n_rows are zero).

    fn is fp32; it is split into bf16 hi + lo parts and both go through the tensor cores: with x
    exact in bf16 (the GPU's streams) the sum carries ~16 mantissa bits of fn, where one bf16
    product would carry 8. fp32 streams are split the same way (three products)."""
    r = tl.arange(0, NP)
    w = tl.load(fn_ptr + (row0 + r)[:, None] * K + offs_k[None, :], mask=(r < n_rows)[:, None] & (offs_k < K)[None, :],
                other=0.0)
    hi, lo = _split(w)
    acc += tl.dot(x_hi, tl.trans(hi)) + tl.dot(x_hi, tl.trans(lo))
    if X_FP32:
        acc += tl.dot(x_lo, tl.trans(hi))
    return acc


@triton.jit
def _mix_kernel(x_ptr, fn_ptr, out_ptr, T, D, HC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                NP: tl.constexpr, SPLIT: tl.constexpr, HEAD: tl.constexpr, X_FP32: tl.constexpr,
                PDL: tl.constexpr = False):
    """Partial mixes x · fnᵀ (three row groups of fn, each padded to NP) and Σ x² over this
    program's share of K (steps split, split + SPLIT, ...) → out[split, t] = [pre | post | comb | Σx²]."""
    wait(PDL)
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    split = tl.program_id(1)
    tmask = tok < T
    K = HC * D
    a_pre = tl.zeros((BT, NP), tl.float32)
    a_post = tl.zeros((BT, NP), tl.float32)
    a_comb = tl.zeros((BT, NP), tl.float32)
    sq = tl.zeros((BT,), tl.float32)
    for k0 in range(split * BK, K, SPLIT * BK):
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=tmask[:, None] & (offs_k < K)[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        x_hi, x_lo = _split(xf)
        a_pre = _fn_dot(a_pre, x_hi, x_lo, fn_ptr, 0, HC, offs_k, K, NP, X_FP32)
        if not HEAD:
            a_post = _fn_dot(a_post, x_hi, x_lo, fn_ptr, HC, HC, offs_k, K, NP, X_FP32)
            a_comb = _fn_dot(a_comb, x_hi, x_lo, fn_ptr, 2 * HC, HC * HC, offs_k, K, NP, X_FP32)
    cols = tl.arange(0, NP)
    row = out_ptr + (split * T + tok)[:, None].to(tl.int64) * (3 * NP + 1)
    m = tmask[:, None]
    tl.store(row + cols[None, :], a_pre, mask=m)
    tl.store(row + NP + cols[None, :], a_post, mask=m)
    tl.store(row + 2 * NP + cols[None, :], a_comb, mask=m)
    tl.store(row + 3 * NP + cols[None, :] * 0, sq[:, None], mask=m & (cols == 0)[None, :])


@triton.jit
def _settle(o_ptr, xp_ptr, postp_ptr, combp_ptr, t, tmask, d, D, HC: tl.constexpr, BT: tl.constexpr,
            CD: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Columns d [CD] of every stream of tokens t [BT], the pending hc_post applied (fp32 [BT, HC, CD],
    rounded where the reference rounds): post ⊗ out + combᵀ · x."""
    t64 = t.to(tl.int64)
    s = tl.arange(0, HC)
    K = HC * D
    dm = tmask[:, None] & (d < D)[None, :]
    o = tl.load(o_ptr + t64[:, None] * D + d[None, :], mask=dm, other=0.0).to(tl.float32)
    pst = _rounded(tl.load(postp_ptr + t[:, None] * HC + s[None, :], mask=tmask[:, None], other=0.0), ROUND_BF16)
    mixed = tl.zeros((BT, HC, CD), tl.float32)
    for j in tl.static_range(HC):  # Σⱼ comb[j, i]·xⱼ
        xj = tl.load(xp_ptr + t64[:, None] * K + j * D + d[None, :], mask=dm, other=0.0).to(tl.float32)
        cj = tl.load(combp_ptr + t[:, None] * (HC * HC) + j * HC + s[None, :], mask=tmask[:, None], other=0.0)
        mixed += _rounded(cj, ROUND_BF16)[:, :, None] * xj[:, None, :]
    scaled = pst[:, :, None] * o[:, None, :]
    return _rounded(scaled, ROUND_BF16) + _rounded(mixed, ROUND_BF16)


@triton.jit
def _column_share(x_ptr, xp_ptr, o_ptr, postp_ptr, combp_ptr, fn_ptr, t, tmask, p, D, HC: tl.constexpr,
                  BT: tl.constexpr, CD: tl.constexpr, NR: tl.constexpr, HEAD: tl.constexpr, POST: tl.constexpr,
                  ROUND_BF16: tl.constexpr):
    """A program's share of an entry, D columns [p·CD, (p+1)·CD) of every stream: fn's columns there
    (rows padded to NR, [NR, HC·CD] fp32; the largest load, issued first: independent of the
    streams) and those columns of tokens t, settled (POST, and written to x) or read ([BT, HC·CD]
    fp32, stream-major like fn's columns)."""
    t64 = t.to(tl.int64)
    K = HC * D
    s = tl.arange(0, HC)
    d = p * CD + tl.arange(0, CD)
    c = tl.arange(0, HC * CD)
    r = tl.arange(0, NR)
    n_rows = HC if HEAD else (2 + HC) * HC
    f = tl.load(fn_ptr + r[:, None] * K + (c // CD * D + p * CD + c % CD)[None, :],
                mask=(r < n_rows)[:, None] & ((p * CD + c % CD) < D)[None, :], other=0.0)
    ptrs = x_ptr + t64[:, None, None] * K + s[None, :, None] * D + d[None, None, :]  # [BT, HC, CD]
    m3 = tmask[:, None, None] & (d < D)[None, None, :]
    if POST:
        xs = _settle(o_ptr, xp_ptr, postp_ptr, combp_ptr, t, tmask, d, D, HC, BT, CD, ROUND_BF16)
        xs = xs.to(x_ptr.dtype.element_ty)
        tl.store(ptrs, xs, mask=m3)
    else:
        xs = tl.load(ptrs, mask=m3, other=0.0)
    return f, tl.reshape(xs.to(tl.float32), (BT, HC * CD))


@triton.jit
def _collapse(total, r, t64, tmask, x_ptr, w_ptr, out_ptr, base_ptr, scale_ptr, D, hc_eps, rms_eps, norm_eps,
              HC: tl.constexpr, BT: tl.constexpr, NR: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr,
              NORM: tl.constexpr):
    """From the full mixes total [BT, NR] (Σx² in column NR - 1) of tokens t64: pre, and the collapse
    Σᵢ preᵢ·xᵢ of the settled streams x, rounded to x's dtype and RMSNormed with w (NORM) → out
    [T, D]; BD >= D, whole rows: four independent stream loads in flight, the norm from registers.
    The loads bypass L1: in a one-launch entry other programs wrote x (published before their
    release)."""
    K = HC * D
    cols = tl.arange(0, NP)
    a_pre = _group(total, r, cols, 0, HC)
    sq = tl.sum(tl.where(r[None, :] == NR - 1, total, 0.0), axis=1)
    pre, _ = _pre_weights(a_pre, sq, K, base_ptr, scale_ptr, hc_eps, rms_eps, HC, NP)
    dd = tl.arange(0, BD)
    dm = tmask[:, None] & (dd < D)[None, :]
    acc = tl.zeros((BT, BD), tl.float32)
    for i in tl.static_range(HC):
        xi = tl.load(x_ptr + t64[:, None] * K + i * D + dd[None, :], mask=dm, other=0.0, cache_modifier=".cg")
        acc += entry(pre, cols, i)[:, None] * xi.to(tl.float32)
    col = acc.to(out_ptr.dtype.element_ty)
    if NORM:
        cf = col.to(tl.float32)
        w = tl.load(w_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(cf * cf, axis=1) / D + norm_eps)
        col = (w[None, :] * cf * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t64[:, None] * D + dd[None, :], col, mask=dm)


@triton.jit
def _entry_small_kernel(x_ptr, xp_ptr, o_ptr, postp_ptr, combp_ptr, fn_ptr, part_ptr, cnt_ptr, base_ptr, scale_ptr,
                        w_ptr, out_ptr, mix_ptr, T, D, hc_eps, rms_eps, norm_eps,
                        HC: tl.constexpr, BT: tl.constexpr, CD: tl.constexpr, NR: tl.constexpr, NP: tl.constexpr,
                        BD: tl.constexpr, SPLIT_PAD: tl.constexpr, HEAD: tl.constexpr, POST: tl.constexpr,
                        ROUND_BF16: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """A whole sub-block entry of a few tokens (all T in one block) in one launch.

    Program p owns D columns [p·CD, (p+1)·CD) of every stream: it settles them (POST) and writes
    them to x, and takes their share of the mixes on the CUDA cores in fp32 (fn rows padded to
    NR, Σx² in column NR - 1) into `part` row p: a few tokens make the tensor cores' 16-row tiles
    mostly padding, and one wide load of the program's fn columns replaces a chain of K steps.
    The last program to arrive (the counter, zeroed again by it) adds the partials (a fixed tree:
    deterministic), derives pre, and writes the collapse Σᵢ preᵢ·xᵢ, rounded to x's dtype and
    RMSNormed with w (NORM) into out [T, D]: BD >= D, whole rows. Unless HEAD it also stores the
    full mixes [BT, NR] at mix_ptr, from which `_post_comb_kernel` derives post and the Sinkhorn
    comb: the longest serial chain of the entry, which the sub-block's input does not need."""
    wait(PDL)
    p = tl.program_id(0)
    SPLIT = tl.num_programs(0)
    t = tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    r = tl.arange(0, NR)
    f, xf = _column_share(x_ptr, xp_ptr, o_ptr, postp_ptr, combp_ptr, fn_ptr, t, tmask, p, D, HC, BT, CD, NR, HEAD,
                          POST, ROUND_BF16)
    mixes = tl.sum(xf[:, None, :] * f[None, :, :], axis=2)  # [BT, NR]
    mixes = tl.where(r[None, :] == NR - 1, tl.sum(xf * xf, axis=1)[:, None], mixes)
    tl.store(part_ptr + p * BT * NR + t64[:, None] * NR + r[None, :], mixes, cache_modifier=".cg")  # [SPLIT, BT, NR]
    tl.debug_barrier()  # every thread's stores (x and part) before the release below
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if old != SPLIT - 1:
        return
    tl.debug_barrier()
    tl.store(cnt_ptr, 0)
    # every partial in one load (a fixed-shape sum: deterministic)
    j = tl.arange(0, SPLIT_PAD)
    rows = part_ptr + (j * BT * NR)[:, None, None] + (t64[:, None] * NR + r[None, :])[None, :, :]
    total = tl.sum(tl.load(rows, mask=(j < SPLIT)[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
    if not HEAD:
        tl.store(mix_ptr + t64[:, None] * NR + r[None, :], total)
    _collapse(total, r, t64, tmask, x_ptr, w_ptr, out_ptr, base_ptr, scale_ptr, D, hc_eps, rms_eps, norm_eps,
              HC, BT, NR, NP, BD, NORM)


@triton.jit
def _settle_mix_kernel(x_ptr, xp_ptr, o_ptr, postp_ptr, combp_ptr, fn_ptr, part_ptr, T, D,
                       HC: tl.constexpr, BT: tl.constexpr, CD: tl.constexpr, NR: tl.constexpr, HEAD: tl.constexpr,
                       POST: tl.constexpr, ROUND_BF16: tl.constexpr, X_FP32: tl.constexpr, PDL: tl.constexpr = False):
    """The first launch of a decode batch's entry. Program (b, p) owns tokens [b·BT, (b+1)·BT) and
    D columns [p·CD, (p+1)·CD) of every stream: it settles them (POST) and writes them to x, and
    takes their share of the mixes on the tensor cores (fn split into bf16 hi + lo as `_fn_dot`
    does, fn rows padded to NR, Σx² in column NR - 1) → part[p, t] [NR]. One K step a program:
    the K split is over programs, so a batch of 64 tokens has 4096 / CD of them, where a chain of
    K steps in `_mix_kernel` keeps the GPU a quarter busy."""
    wait(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    p = tl.program_id(1)
    tmask = t < T
    t64 = t.to(tl.int64)
    r = tl.arange(0, NR)
    f, xf = _column_share(x_ptr, xp_ptr, o_ptr, postp_ptr, combp_ptr, fn_ptr, t, tmask, p, D, HC, BT, CD, NR, HEAD,
                          POST, ROUND_BF16)
    x_hi, x_lo = _split(xf)
    f_hi, f_lo = _split(f)
    mixes = tl.dot(x_hi, tl.trans(f_hi)) + tl.dot(x_hi, tl.trans(f_lo))  # [BT, NR]
    if X_FP32:
        mixes += tl.dot(x_lo, tl.trans(f_hi))
    mixes = tl.where(r[None, :] == NR - 1, tl.sum(xf * xf, axis=1)[:, None], mixes)
    tl.store(part_ptr + (p * T + t64)[:, None] * NR + r[None, :], mixes, mask=tmask[:, None])


@triton.jit
def _collapse_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, w_ptr, out_ptr, post_ptr, comb_ptr, T, D, iters, hc_eps,
                     rms_eps, norm_eps, HC: tl.constexpr, NR: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr,
                     SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr,
                     PDL: tl.constexpr = False):
    """The second launch of a decode batch's entry, a program a token: the SPLIT partial mixes of
    `_settle_mix_kernel` added in one fixed-shape sum (deterministic), the collapse and its
    RMSNorm (`_collapse`), then (unless HEAD) post and the Sinkhorn comb."""
    wait(PDL)
    t = tl.program_id(0) + tl.arange(0, 1)
    t64 = t.to(tl.int64)
    tmask = t < T
    r = tl.arange(0, NR)
    j = tl.arange(0, SPLIT_PAD)
    rows = part_ptr + ((j * T)[:, None, None] + t64[None, :, None]) * NR + r[None, None, :]  # [SPLIT_PAD, 1, NR]
    total = tl.sum(tl.load(rows, mask=(j < SPLIT)[:, None, None], other=0.0), axis=0)
    _collapse(total, r, t64, tmask, x_ptr, w_ptr, out_ptr, base_ptr, scale_ptr, D, hc_eps, rms_eps, norm_eps,
              HC, 1, NR, NP, BD, NORM)
    if not HEAD:
        _mixes_post_comb(total, r, t, tmask, HC * D, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, hc_eps, rms_eps,
                         HC, NR, NP)


@triton.jit
def _post_comb_kernel(mix_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, T, K, iters, hc_eps, rms_eps,
                      HC: tl.constexpr, BT: tl.constexpr, NR: tl.constexpr, NP: tl.constexpr,
                      PDL: tl.constexpr = False):
    """post = 2σ(·) [T, HC] and the Sinkhorn comb [T, HC, HC] from the full mixes [BT, NR] (Σx² in
    column NR - 1) that `_entry_small_kernel` stored: one program, launched beside the sub-block
    the entry feeds (only the next entry reads post and comb)."""
    wait(PDL)
    t = tl.arange(0, BT)
    r = tl.arange(0, NR)
    total = tl.load(mix_ptr + t[:, None] * NR + r[None, :])
    _mixes_post_comb(total, r, t, t < T, K, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, hc_eps, rms_eps, HC, NR,
                     NP)


@triton.jit
def _mixes_post_comb(total, r, tok, tmask, K, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, hc_eps, rms_eps,
                     HC: tl.constexpr, NR: tl.constexpr, NP: tl.constexpr):
    """`_store_post_comb` from the full mixes total [BT, NR] (Σx² in column NR - 1) of tokens tok."""
    cols = tl.arange(0, NP)
    sq = tl.sum(tl.where(r[None, :] == NR - 1, total, 0.0), axis=1)
    _store_post_comb(_group(total, r, cols, HC, HC), _group(total, r, cols, 2 * HC, HC * HC),
                     _rms_factor(sq, K, rms_eps), tok, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, hc_eps,
                     HC, NP)


@triton.jit
def _group(total, r, cols, first, n):
    """Columns first .. first + n of total [BT, NR] as the leading columns of a [BT, NP] tensor
    (zero past n): a register shuffle, where a store and a reload would cost an L2 round trip."""
    pick = (r[None, None, :] == (cols + first)[None, :, None]) & (cols < n)[None, :, None]
    return tl.sum(tl.where(pick, total[:, None, :], 0.0), axis=2)


@triton.jit
def _rms_factor(sq, K, rms_eps):
    """The mixes' RMS factor [BT, 1] from Σx² [BT] over K stream values."""
    return tl.rsqrt(sq / K + rms_eps)[:, None]


@triton.jit
def _pre_weights(a_pre, sq, K, base_ptr, scale_ptr, hc_eps, rms_eps, HC: tl.constexpr, NP: tl.constexpr):
    """From the full mixes of pre [BT, NP] and Σx² [BT]: (pre = σ(·) + eps [BT, NP], zero past HC
    columns; the RMS factor r [BT, 1])."""
    cols = tl.arange(0, NP)
    r = _rms_factor(sq, K, rms_eps)
    pre = tl.sigmoid(a_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + cols, mask=cols < HC, other=0.0)) + hc_eps
    return tl.where((cols < HC)[None, :], pre, 0.0), r


@triton.jit
def _store_post_comb(a_post, a_comb, r, tok, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, hc_eps,
                     HC: tl.constexpr, NP: tl.constexpr):
    """post = 2σ(·) [T, HC] and the Sinkhorn comb [T, HC, HC] from their full mixes [BT, NP]."""
    cols = tl.arange(0, NP)
    post = 2 * tl.sigmoid(a_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + cols, mask=cols < HC,
                                                                          other=0.0))
    tl.store(post_ptr + tok[:, None] * HC + cols[None, :], post, mask=tmask[:, None] & (cols < HC)[None, :])
    logit = a_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + cols, mask=cols < HC * HC, other=0.0)
    tl.store(comb_ptr + tok[:, None] * (HC * HC) + cols[None, :], sinkhorn(logit, cols, iters, hc_eps),
             mask=tmask[:, None])


@triton.jit
def _pre_kernel(x_ptr, mix_ptr, base_ptr, scale_ptr, col_ptr, post_ptr, comb_ptr, T, D, D_CHUNK, iters, hc_eps,
                rms_eps, HC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr,
                HEAD: tl.constexpr, PDL: tl.constexpr = False):
    """From the mixes (`_mix_kernel`'s SPLIT partial sums, added here in split order: deterministic):
    pre, post, Sinkhorn comb, and the collapse Σᵢ preᵢ · xᵢ over the D columns
    [pid1 · D_CHUNK, (pid1 + 1) · D_CHUNK); every D chunk's program derives pre, the first also
    stores post and comb."""
    wait(PDL)
    d_first = tl.program_id(1) * D_CHUNK
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = tok < T
    K = HC * D
    cols = tl.arange(0, NP)
    a_pre = tl.zeros((BT, NP), tl.float32)
    a_post = tl.zeros((BT, NP), tl.float32)
    a_comb = tl.zeros((BT, NP), tl.float32)
    sq = tl.zeros((BT,), tl.float32)
    for part in tl.static_range(SPLIT):
        row = mix_ptr + (part * T + tok[:, None]).to(tl.int64) * (3 * NP + 1)
        a_pre += tl.load(row + cols[None, :], mask=tmask[:, None], other=0.0)
        a_post += tl.load(row + NP + cols[None, :], mask=tmask[:, None], other=0.0)
        a_comb += tl.load(row + 2 * NP + cols[None, :], mask=tmask[:, None], other=0.0)
        sq += tl.load(mix_ptr + (part * T + tok).to(tl.int64) * (3 * NP + 1) + 3 * NP, mask=tmask, other=0.0)
    pre, r = _pre_weights(a_pre, sq, K, base_ptr, scale_ptr, hc_eps, rms_eps, HC, NP)
    if not HEAD and d_first == 0:
        _store_post_comb(a_post, a_comb, r, tok, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, hc_eps, HC, NP)
    # collapsed = Σᵢ preᵢ · xᵢ
    streams = tl.arange(0, HC)
    pre_s = tl.sum(tl.where(cols[None, None, :] == streams[None, :, None], pre[:, None, :], 0.0), axis=2)  # [BT, HC]
    for d0 in range(d_first, tl.minimum(d_first + D_CHUNK, D), BD):
        offs_d = d0 + tl.arange(0, BD)
        ptr = x_ptr + tok[:, None, None].to(tl.int64) * K + streams[None, :, None] * D + offs_d[None, None, :]
        xs = tl.load(ptr, mask=tmask[:, None, None] & (offs_d < D)[None, None, :], other=0.0).to(tl.float32)
        tl.store(col_ptr + tok[:, None].to(tl.int64) * D + offs_d[None, :],
                 tl.sum(pre_s[:, :, None] * xs, axis=1).to(col_ptr.dtype.element_ty),
                 mask=tmask[:, None] & (offs_d < D)[None, :])


@triton.jit
def _post_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, new_ptr, D, HC: tl.constexpr, BD: tl.constexpr,
                 ROUND_BF16: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = offs < D
    s = tl.arange(0, HC)
    o = tl.load(out_ptr + t.to(tl.int64) * D + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t.to(tl.int64) * HC * D + s[:, None] * D + offs[None, :], mask=mask[None, :],
                other=0.0).to(tl.float32)  # [HC(j), BD]
    post = tl.load(post_ptr + t * HC + s)
    comb = tl.load(comb_ptr + t * HC * HC + s[:, None] * HC + s[None, :])  # [j, i]
    post, comb = _rounded(post, ROUND_BF16), _rounded(comb, ROUND_BF16)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [i, BD] = Σ_j comb[j, i] x_j
    scaled = post[:, None] * o[None, :]
    tl.store(new_ptr + t.to(tl.int64) * HC * D + s[:, None] * D + offs[None, :],
             (_rounded(scaled, ROUND_BF16) + _rounded(mixed, ROUND_BF16)).to(new_ptr.dtype.element_ty),
             mask=mask[None, :])

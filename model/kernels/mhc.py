"""Manifold-constrained hyper-connections (mHC): the residual stream is hc parallel streams
x [T, hc, D]. Around each sub-block:

* `hc_pre`: mixes = rms(x.flatten) · fnᵀ (fn [(2+hc)·hc, hc·D]) split into pre [hc], post [hc],
  comb [hc, hc]; pre = σ(·) + eps, post = 2σ(·), comb = Sinkhorn-Knopp(softmax(·) + eps) (columns
  first, then rows / columns alternately, `hc_sinkhorn_iters` in all); collapsed = Σᵢ preᵢ·xᵢ;
* `hc_post`: new streams = post ⊗ out + combᵀ · x (in the activations' dtype);
* `hc_head`: the final collapse with pre only.

The mixes GEMM runs on the tensor cores with fn split into bf16 hi + lo parts (the streams are
bf16 on the GPU, exact there), which keeps fp32-level accuracy at bf16 speed.

Kernels: `hc_pre` is two launches where the reference takes ~50 small torch ops. `_mix_kernel`
does the skinny mixes GEMM on the tensor cores with Σx² for the RMS factor, its K split over
programs when there are few tokens (decode: one block of tokens would otherwise run the whole
16K-long dot alone); the partial sums are added in a fixed order, so results are deterministic.
`_pre_kernel` takes the mixes to pre/post, runs every Sinkhorn iteration in registers and writes
the weighted collapse. `_post_kernel` fuses the mixing of `hc_post`, rounding where the
reference rounds.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from model.kernels import check_impl


# ---------------------------------------------------------------------------------------
# references (the model's definition)
# ---------------------------------------------------------------------------------------

def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def reference_pre(x, fn, base, scale, hc: int, iters: int, hc_eps: float, rms_eps: float):
    mixes = F.linear(_unweighted_rms(x.flatten(1).float(), rms_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return collapsed, post, comb


def reference_head(x, fn, base, scale, hc_eps: float, rms_eps: float):
    mixes = F.linear(_unweighted_rms(x.flatten(1).float(), rms_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def reference_post(out, x, post, comb):
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


# ---------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MixTiles:
    """Launch shape of `_mix_kernel`: tokens per program, K per step, warps, K splits (None: enough
    programs for ~2 waves); and of `_pre_kernel`'s collapse: D splits (None: likewise, in chunks
    of at least 256 columns)."""
    bt: int
    bk: int = 128
    num_warps: int = 4
    split: int | None = None
    collapse_split: int | None = None


# Every program loads and splits the fn tile of each K step: 64 tokens share it (benchmarks/
# mhc_sweep.py, H100, T = 8192: hc_pre 0.39 ms against 0.45 with 32 tokens and the fn split hoisted
# out of the kernel, 0.60 before), in decode too, K split to fill the GPU (T = 256 / 64 / 1: 19.2 /
# 16.0 / 15.1 µs against 41.3 / 19.6 / 18.0 with the 16-token programs decode had)
MIX_TILES = MixTiles(bt=64)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
           hc_eps: float, rms_eps: float, impl: str, tiles: MixTiles | None = None):
    """x [T, hc, D] → (collapsed [T, D] x.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32).
    `tiles` overrides `MIX_TILES` (tuning)."""
    if check_impl(impl) == "torch":
        return reference_pre(x, fn, base, scale, hc, iters, hc_eps, rms_eps)
    return _launch_pre(x, fn, base, scale, hc, iters, hc_eps, rms_eps, head=False, tiles=tiles)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            rms_eps: float, impl: str) -> torch.Tensor:
    """x [T, hc, D] → [T, D] (fn [hc, hc·D], scale [1])."""
    if check_impl(impl) == "torch":
        return reference_head(x, fn, base, scale, hc_eps, rms_eps)
    return _launch_pre(x, fn, base, scale, x.shape[1], 0, hc_eps, rms_eps, head=True)[0]


def hc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, impl: str) -> torch.Tensor:
    """out [T, D], streams x [T, hc, D] → new streams [T, hc, D]."""
    if check_impl(impl) == "torch":
        return reference_post(out, x, post, comb)
    T, hc, D = x.shape
    new = torch.empty_like(x)
    if T:
        x, out = x.contiguous(), out.contiguous()
        bd = min(1024, triton.next_power_of_2(D))
        _post_kernel[(T, triton.cdiv(D, bd))](
            out, x, post.contiguous(), comb.contiguous(), new, D, HC=hc, BD=bd,
            ROUND_BF16=x.dtype == torch.bfloat16, num_warps=4)
    return new


def _launch_pre(x, fn, base, scale, hc, iters, hc_eps, rms_eps, head: bool, tiles: MixTiles | None = None):
    T, _, D = x.shape
    x = x.contiguous()
    collapsed = torch.empty(T, D, dtype=x.dtype, device=x.device)
    post = torch.empty(T, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=x.device)
    if T:
        if hc * hc != 16:
            raise ValueError(f"the mHC kernel is written for hc_mult 4, got {hc}")
        tiles = tiles or MIX_TILES
        fn = fn.float().contiguous()
        blocks, k_steps = triton.cdiv(T, tiles.bt), triton.cdiv(hc * D, tiles.bk)
        split = tiles.split or 1
        while tiles.split is None and blocks * split * 2 <= 264 and k_steps // (split * 2) >= 4:
            split *= 2  # decode: spread K over programs until ~2 waves of the GPU
        partial = torch.empty(split, T, 3 * 16 + 1, dtype=torch.float32, device=x.device)  # mixes | Σx²
        _mix_kernel[(blocks, split)](x, fn, partial, T, D, HC=hc, BT=tiles.bt, BK=tiles.bk, NP=16, SPLIT=split,
                                     HEAD=head, X_FP32=x.dtype == torch.float32, num_warps=tiles.num_warps)
        bt = 16 if T <= 2048 else 32
        # a decode step has a few token blocks: the collapse (the bytes of x) is spread over D
        # chunks, or 4 programs would read all of x at T = 64 (H100: 31.7 µs against 6.3)
        d_split = tiles.collapse_split or max(1, min(264 // triton.cdiv(T, bt), triton.cdiv(D, 256)))
        chunk = triton.cdiv(D, d_split)
        bd = min(256, triton.next_power_of_2(chunk))
        _pre_kernel[(triton.cdiv(T, bt), d_split)](
            x, partial, base.float().contiguous(), scale.float().contiguous(), collapsed, post, comb,
            T, D, triton.cdiv(chunk, bd) * bd, iters, hc_eps, rms_eps, HC=hc, BT=bt, NP=16, BD=bd,
            SPLIT=split, HEAD=head, num_warps=4)
    return collapsed, post, comb


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@triton.jit
def _split(v):
    """fp32 → bf16 hi + lo with hi + lo ≈ v to ~16 mantissa bits."""
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


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
                NP: tl.constexpr, SPLIT: tl.constexpr, HEAD: tl.constexpr, X_FP32: tl.constexpr):
    """Partial mixes x · fnᵀ (three row groups of fn, each padded to NP) and Σ x² over this
    program's share of K (steps split, split + SPLIT, ...) → out[split, t] = [pre | post | comb | Σx²]."""
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
def _pre_kernel(x_ptr, mix_ptr, base_ptr, scale_ptr, col_ptr, post_ptr, comb_ptr, T, D, D_CHUNK, iters, hc_eps,
                rms_eps, HC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr,
                HEAD: tl.constexpr):
    """From the mixes (`_mix_kernel`'s SPLIT partial sums, added here in split order: deterministic):
    pre, post, Sinkhorn comb, and the collapse Σᵢ preᵢ · xᵢ over the D columns
    [pid1 · D_CHUNK, (pid1 + 1) · D_CHUNK); every D chunk's program derives pre, the first also
    stores post and comb."""
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
    r = tl.rsqrt(sq / K + rms_eps)[:, None]
    pre = tl.sigmoid(a_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + cols, mask=cols < HC, other=0.0)) + hc_eps
    pre = tl.where((cols < HC)[None, :], pre, 0.0)
    if not HEAD and d_first == 0:
        post = 2 * tl.sigmoid(a_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + cols, mask=cols < HC,
                                                                              other=0.0))
        tl.store(post_ptr + tok[:, None] * HC + cols[None, :], post, mask=tmask[:, None] & (cols < HC)[None, :])
        # comb: softmax over each row i of the hc×hc matrix, then Sinkhorn-Knopp
        logit = a_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + cols, mask=cols < HC * HC, other=0.0)
        c = tl.reshape(logit, (BT, HC, NP // HC))  # NP == HC·HC: [t, i, j]
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + tok[:, None] * (HC * HC) + cols[None, :], tl.reshape(c, (BT, NP)), mask=tmask[:, None])
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
                 ROUND_BF16: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = offs < D
    s = tl.arange(0, HC)
    o = tl.load(out_ptr + t.to(tl.int64) * D + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t.to(tl.int64) * HC * D + s[:, None] * D + offs[None, :], mask=mask[None, :],
                other=0.0).to(tl.float32)  # [HC(j), BD]
    post = tl.load(post_ptr + t * HC + s)
    comb = tl.load(comb_ptr + t * HC * HC + s[:, None] * HC + s[None, :])  # [j, i]
    if ROUND_BF16:  # the reference mixes in the activations' dtype
        post = post.to(tl.bfloat16).to(tl.float32)
        comb = comb.to(tl.bfloat16).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [i, BD] = Σ_j comb[j, i] x_j
    scaled = post[:, None] * o[None, :]
    if ROUND_BF16:
        mixed = mixed.to(tl.bfloat16).to(tl.float32)
        scaled = scaled.to(tl.bfloat16).to(tl.float32)
    tl.store(new_ptr + t.to(tl.int64) * HC * D + s[:, None] * D + offs[None, :],
             (scaled + mixed).to(new_ptr.dtype.element_ty), mask=mask[None, :])

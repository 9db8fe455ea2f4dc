"""Fused partial RoPE: query RMS-rescale + RoPE, KV norm + RoPE + cache store, and plain
rotation (indexer queries, the attention output's de-rotation).

RoPE rotates the trailing r channels of each head in interleaved pairs (2i, 2i+1) by
position·inv_freq[i] (`model.rope`). The row kernel splits each loaded row into its (even, odd)
pairs in registers; the KV store, one entry per program, loads each element's partner (column
c ^ 1) beside it. Both round intermediates to the input dtype exactly where the reference does,
so bf16 results agree with it to the last bit except where the GPU's cos/sin differ from
torch's by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import check_impl
from model.kernels.attention.pool_io import entry_base, pack_code, store_entry
from model.kernels.common import invariant
from model.kernels.common.pdl import launch_options, wait
from model.rope import Rope

# ---------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------

def _rms_rescale(q: torch.Tensor, eps: float) -> torch.Tensor:
    return q * torch.rsqrt(invariant.mean(q.float().square(), -1, keepdim=True) + eps).to(q.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(invariant.mean(xf.square(), -1, keepdim=True) + eps)).to(x.dtype)


# ---------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------

def rotate(x: torch.Tensor, positions: torch.Tensor, rope: Rope, impl: str, inverse: bool = False) -> torch.Tensor:
    """x [T, H, d] or [T, d] rotated at `positions` [T] (by -position when `inverse`)."""
    if check_impl(impl) == "torch":
        return rope.apply(x, positions, inverse=inverse)
    return _launch_rows(x, positions, rope, inverse=inverse, rms_eps=None)


def q_rms_rope(q: torch.Tensor, positions: torch.Tensor, rope: Rope, eps: float, impl: str) -> torch.Tensor:
    """Per-head RMS rescale (no gain) then RoPE: q [T, H, d] → same shape and dtype."""
    if check_impl(impl) == "torch":
        return rope.apply(_rms_rescale(q, eps), positions)
    return _launch_rows(q, positions, rope, inverse=False, rms_eps=eps)


def store_kv(kv: torch.Tensor, batch, pools, layer: int, norm_weight: torch.Tensor, eps: float, rope: Rope,
             impl: str) -> None:
    """kv [T, d] (before `kv_norm`) → RMSNorm, RoPE, encode, and write into the SWA pool at each
    token's position."""
    if check_impl(impl) == "torch":
        kv = rope.apply(_rms_norm(kv, norm_weight, eps), batch.positions)
        for seg in batch.segments:
            pools.write("swa", layer, seg.seq.pages["swa"], batch.positions[seg.rows], kv[seg.rows])
        return
    T, d = kv.shape
    if T == 0:
        return
    meta, spec = batch.meta, pools.specs["swa"]
    table = meta.tables["swa"]
    _store_kv_kernel[(T,)](
        kv, kv.stride(0), meta.token_seq, meta.positions, table, table.stride(0),
        pools.buffers["swa"], spec.page_bytes, pools._local["swa"][layer] * spec.layer_bytes, spec.entry_bytes,
        norm_weight, rope.inv_freq_on(kv.device), eps, d,
        EPP=spec.entries_per_page, NOPE=d - rope.dim, ROPE=rope.dim, D=triton.next_power_of_2(d),
        PACK=pack_code(pools, "swa"), ENTRY_BYTES=spec.entry_bytes, ROUND_BF16=kv.dtype == torch.bfloat16,
        num_warps=4, **launch_options(kv))


def q_rms_rope_store_kv(q: torch.Tensor, kv: torch.Tensor, batch, pools, layer: int, norm_weight: torch.Tensor,
                        eps: float, rope: Rope, impl: str) -> torch.Tensor:
    """`q_rms_rope(q, batch.positions, rope, eps, impl)` and `store_kv(kv, ...)` with the same rope and
    eps, in one launch on the kernels' path: the KV store is one more program column of the query
    grid (a decode step of a few tokens pays one launch's latency for both). → rotated q."""
    T, H, d = q.shape
    if check_impl(impl) == "torch" or T == 0 or q.stride(-1) != 1 or kv.shape[-1] != d:
        out = q_rms_rope(q, batch.positions, rope, eps, impl)
        store_kv(kv, batch, pools, layer, norm_weight, eps, rope, impl)
        return out
    meta, spec = batch.meta, pools.specs["swa"]
    table = meta.tables["swa"]
    out = torch.empty_like(q)
    bh = min(16, triton.next_power_of_2(H))
    _q_rope_store_kv_kernel[(T, triton.cdiv(H, bh) + 1)](
        q, out, meta.positions, rope.inv_freq_on(q.device), H, d, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), eps, kv, kv.stride(0), meta.token_seq, table, table.stride(0), pools.buffers["swa"],
        spec.page_bytes, pools._local["swa"][layer] * spec.layer_bytes, spec.entry_bytes, norm_weight,
        BH=bh, D=triton.next_power_of_2(d), ROPE=rope.dim, EPP=spec.entries_per_page, PACK=pack_code(pools, "swa"),
        ENTRY_BYTES=spec.entry_bytes, ROUND_BF16=q.dtype == torch.bfloat16, num_warps=4, **launch_options(q))
    return out


def _launch_rows(x: torch.Tensor, positions: torch.Tensor, rope: Rope, inverse: bool, rms_eps: float | None):
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    T, H, d = x3.shape
    out = torch.empty_like(x3)
    if T:
        bh = min(16, triton.next_power_of_2(H))
        _rope_rows_kernel[(T, triton.cdiv(H, bh))](
            x3, out, positions, rope.inv_freq_on(x.device), H, d,
            x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), rms_eps or 0.0,
            BH=bh, D=triton.next_power_of_2(d), R=rope.dim, RMS=rms_eps is not None, INVERSE=inverse,
            ROUND_BF16=x.dtype == torch.bfloat16, num_warps=4, **launch_options(x3))
    return out if x.dim() == 3 else out.squeeze(1)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@triton.jit
def _round(x, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _rotate_cols(x, partner, pos, inv_freq_ptr, cols, d, R: tl.constexpr, INVERSE: tl.constexpr):
    """Apply RoPE to the trailing R of d columns of x [..., C]; other columns pass through."""
    in_rope = (cols >= d - R) & (cols < d)
    i = tl.where(in_rope, (cols - (d - R)) // 2, 0)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=in_rope, other=0.0)
    cos, sin = tl.cos(freq), tl.sin(freq)
    if INVERSE:
        sin = -sin
    even = (cols % 2) == 0
    rotated = tl.where(even, x * cos - partner * sin, x * cos + partner * sin)
    return tl.where(in_rope, rotated, x)


@triton.jit
def rotate_pairs(even, odd, c0: tl.constexpr, pos, inv_freq_ptr, d, R: tl.constexpr, INVERSE: tl.constexpr):
    """RoPE on split pairs: even / odd [M, P] hold columns c0 + 2i and c0 + 2i + 1; pairs in the
    trailing R of d columns rotate by pos·inv_freq (by -pos when INVERSE), the others pass."""
    half = c0 // 2 + tl.arange(0, even.shape[1])
    in_rope = (half >= (d - R) // 2) & (half < d // 2)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + half - (d - R) // 2, mask=in_rope, other=0.0)
    cos, sin = tl.cos(freq)[None, :], tl.sin(freq)[None, :]
    if INVERSE:
        sin = -sin
    in_rope = in_rope[None, :]
    return tl.where(in_rope, even * cos - odd * sin, even), tl.where(in_rope, odd * cos + even * sin, odd)


@triton.jit
def _rope_rows_kernel(x_ptr, out_ptr, pos_ptr, inv_freq_ptr, H, d, stride_xt, stride_xh, stride_ot, stride_oh, eps,
                      BH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RMS: tl.constexpr, INVERSE: tl.constexpr,
                      ROUND_BF16: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    _rope_rows(tl.program_id(0), tl.program_id(1), x_ptr, out_ptr, pos_ptr, inv_freq_ptr, H, d, stride_xt, stride_xh,
               stride_ot, stride_oh, eps, BH, D, R, RMS, INVERSE, ROUND_BF16)


@triton.jit
def _rope_rows(t, head_block, x_ptr, out_ptr, pos_ptr, inv_freq_ptr, H, d, stride_xt, stride_xh, stride_ot, stride_oh,
               eps, BH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RMS: tl.constexpr, INVERSE: tl.constexpr,
               ROUND_BF16: tl.constexpr):
    """Token t's heads [head_block·BH, (head_block + 1)·BH): RMS-rescaled (RMS), rotated, stored."""
    # rows are loaded whole and split into (even, odd) pairs in registers: a partner load at
    # column c ^ 1 is not contiguous, so it compiles to scalar loads, slower than a full read + write
    heads = head_block * BH + tl.arange(0, BH)
    cols = tl.arange(0, D)
    mask = (heads < H)[:, None] & (cols < d)[None, :]
    x = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if RMS:
        factor = _round(tl.rsqrt(tl.sum(x * x, axis=1) / d + eps), ROUND_BF16)[:, None]
        x = _round(x * factor, ROUND_BF16)
    even, odd = tl.split(tl.reshape(x, (BH, D // 2, 2)))
    even, odd = rotate_pairs(even, odd, 0, tl.load(pos_ptr + t), inv_freq_ptr, d, R, INVERSE)
    y = tl.join(even, odd)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :],
             tl.reshape(y, (BH, D)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(kv_ptr, stride_kv, seq_ptr, pos_ptr, table_ptr, table_stride, buf_ptr, page_bytes, layer_off,
                     entry_bytes, w_ptr, inv_freq_ptr, eps, d,
                     EPP: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr, PACK: tl.constexpr,
                     ENTRY_BYTES: tl.constexpr, ROUND_BF16: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    _store_kv(tl.program_id(0), kv_ptr, stride_kv, seq_ptr, pos_ptr, table_ptr, table_stride, buf_ptr, page_bytes,
              layer_off, entry_bytes, w_ptr, inv_freq_ptr, eps, d, EPP, NOPE, ROPE, D, PACK, ENTRY_BYTES, ROUND_BF16)


@triton.jit
def _q_rope_store_kv_kernel(q_ptr, out_ptr, pos_ptr, inv_freq_ptr, H, d, stride_qt, stride_qh, stride_ot, stride_oh,
                            eps, kv_ptr, stride_kv, seq_ptr, table_ptr, table_stride, buf_ptr, page_bytes, layer_off,
                            entry_bytes, w_ptr,
                            BH: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, EPP: tl.constexpr,
                            PACK: tl.constexpr, ENTRY_BYTES: tl.constexpr, ROUND_BF16: tl.constexpr,
                            PDL: tl.constexpr = False):
    """`_rope_rows_kernel` (RMS, forward) over the query heads in program columns 0 .. n - 2 and
    `_store_kv_kernel` in the last column, for token program_id(0)."""
    wait(PDL)
    t = tl.program_id(0)
    if tl.program_id(1) == tl.num_programs(1) - 1:
        _store_kv(t, kv_ptr, stride_kv, seq_ptr, pos_ptr, table_ptr, table_stride, buf_ptr, page_bytes, layer_off,
                  entry_bytes, w_ptr, inv_freq_ptr, eps, d, EPP, d - ROPE, ROPE, D, PACK, ENTRY_BYTES, ROUND_BF16)
    else:
        _rope_rows(t, tl.program_id(1), q_ptr, out_ptr, pos_ptr, inv_freq_ptr, H, d, stride_qt, stride_qh, stride_ot,
                   stride_oh, eps, BH, D, ROPE, True, False, ROUND_BF16)


@triton.jit
def _store_kv(t, kv_ptr, stride_kv, seq_ptr, pos_ptr, table_ptr, table_stride, buf_ptr, page_bytes, layer_off,
              entry_bytes, w_ptr, inv_freq_ptr, eps, d, EPP: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
              D: tl.constexpr, PACK: tl.constexpr, ENTRY_BYTES: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Token t's KV row: RMSNorm with w, RoPE, encoded into its SWA pool entry."""
    cols = tl.arange(0, D)
    valid = cols < d
    x = tl.load(kv_ptr + t * stride_kv + cols, mask=valid, other=0.0).to(tl.float32)
    xp = tl.load(kv_ptr + t * stride_kv + (cols ^ 1), mask=valid, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + (cols ^ 1), mask=valid, other=0.0).to(tl.float32)
    x = _round(w * x * r, ROUND_BF16)
    xp = _round(wp * xp * r, ROUND_BF16)
    pos = tl.load(pos_ptr + t)
    y = _round(_rotate_cols(x, xp, pos, inv_freq_ptr, cols, d, ROPE, False), ROUND_BF16)
    seq = tl.load(seq_ptr + t)
    base = entry_base(table_ptr, table_stride, seq, pos, True, EPP, page_bytes, layer_off, entry_bytes)
    store_entry(buf_ptr, base, y, cols, d, NOPE, ROPE, ENTRY_BYTES, D, PACK)

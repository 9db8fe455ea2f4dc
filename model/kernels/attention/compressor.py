"""Compressor: gated pooling of `ratio` tokens into one compressed entry, over the compress-state
ring, with the entry quantised into the pool's encoding on write.

Each token's raw projection row is [kv (coff·h) | score (coff·h)] (coff = 2 with overlap). Entry n
pools tokens [n·r, (n+1)·r) with weights softmax over rows of (score + ape[token % r]) per channel;
with overlap (ratio 4) it also pools the previous window [n·r - r, n·r) through the first halves
(kv_overlap, score_overlap) while the current window uses the second halves; entry 0 has no
previous window. The pooled vector is RMS-normed, roped at position n·r and stored. Tokens of the
window that precede the current segment come from the ring (row `token % ring`), the others from
this batch's projections; the ring keeps the last `ring` rows of every request afterwards.

Kernels: `_emit_kernel`, one program per token, only the token that completes a window works (a
grid of shapes only: capturable in a CUDA graph); rows are read in blocks with an online softmax
per channel. `_ring_kernel` then writes the rows the ring keeps (after `_emit_kernel` has read
the old ones, by stream order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import check_impl
from model.kernels.attention.pool_io import entry_base, index_scale_at, pack_code, store_entry
from model.kernels.common import invariant
from model.kernels.common.pdl import launch_options, wait
from model.rope import Rope


def reference(proj, batch, pools, layer: int, ratio: int, kind: str, state_kind: str, ape, norm_weight, eps: float,
              rope: Rope) -> None:
    """proj [T, 2·coff·h] float32 → entries into `kind`, ring rows into `state_kind`."""
    overlap = ratio == 4
    ring = 2 * ratio if overlap else ratio
    h = proj.shape[1] // (4 if overlap else 2)
    dev = proj.device
    for seg in batch.segments:
        r, s, e, rows_new = ratio, seg.start, seg.end, proj[seg.rows]
        slot = seg.seq.pages[state_kind]
        n0, n1 = s // r, e // r  # entries complete before / after this segment
        if n1 > n0:
            lo = max(0, n0 * r - (r if overlap else 0))
            history = pools.read(state_kind, layer, slot, torch.arange(lo, s, device=dev) % ring)
            rows = torch.cat([history, rows_new[: n1 * r - s]])  # tokens [lo, n1·r)
            width = rows.shape[1] // 2
            kv, score = rows[:, :width], rows[:, width:] + ape[torch.arange(lo, n1 * r, device=dev) % r]
            windows = torch.arange(n0, n1, device=dev).unsqueeze(1) * r + torch.arange(r, device=dev) - lo
            if overlap:
                prev, first = windows - r, n0 == 0
                kv = torch.cat([kv[prev.clamp_min(0), :h], kv[windows, h:]], dim=1)
                score = torch.cat([score[prev.clamp_min(0), :h], score[windows, h:]], dim=1)
                if first:  # window 0 has no predecessor: zero value, zero weight
                    kv[0, :r], score[0, :r] = 0.0, float("-inf")
            else:
                kv, score = kv[windows], score[windows]
            pooled = invariant.sum(kv * invariant.softmax(score, dim=1), dim=1)  # [n, h]
            normed = norm_weight.float() * pooled * torch.rsqrt(invariant.mean(pooled.square(), -1, keepdim=True) + eps)
            entries = rope.apply(normed, torch.arange(n0, n1, device=dev) * r)
            pools.write(kind, layer, seg.seq.pages[kind], torch.arange(n0, n1, device=dev), entries)
        keep = min(ring, seg.length)  # ring rows written after the read above
        pools.write(state_kind, layer, slot, torch.arange(e - keep, e, device=dev) % ring, rows_new[-keep:])


def compress(proj: torch.Tensor, batch, pools, layer: int, ratio: int, kind: str, state_kind: str, ape: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, rope: Rope, impl: str) -> None:
    """See module docstring. proj [T, 2·coff·h] float32; ape [ratio, coff·h]; norm_weight [h]."""
    if check_impl(impl) == "torch":
        return reference(proj, batch, pools, layer, ratio, kind, state_kind, ape, norm_weight, eps, rope)
    T, width = proj.shape
    if T == 0:
        return
    overlap = ratio == 4
    h = width // (4 if overlap else 2)
    meta = batch.meta
    out, state = pools.specs[kind], pools.specs[state_kind]
    state_off = pools._local[state_kind][layer] * state.layer_bytes
    if proj.stride(1) != 1:  # rows may be strided (a slice of a fused product), columns not
        proj = proj.contiguous()
    rows = 2 * ratio if overlap else ratio
    _emit_kernel[(T,)](
        proj, proj.stride(0), meta.token_seq, meta.positions, meta.seg_start,
        pools.buffers[state_kind], meta.tables[state_kind], meta.tables[state_kind].stride(0), state.page_bytes,
        state_off, state.entry_bytes,
        pools.buffers[kind], meta.tables[kind], meta.tables[kind].stride(0), out.page_bytes,
        pools._local[kind][layer] * out.layer_bytes, out.entry_stride,
        ape.float().contiguous(), norm_weight.float().contiguous(), rope.inv_freq_on(proj.device), eps, h,
        RATIO=ratio, OVERLAP=overlap, ROWS=rows, BR=min(rows, 16), RING=rows, EPP=out.entries_per_page,
        NOPE=h - rope.dim, ROPE=rope.dim, D=triton.next_power_of_2(h), PACK=pack_code(pools, kind),
        ENTRY_BYTES=out.entry_bytes, num_warps=4, **launch_options(proj))
    bc = min(triton.next_power_of_2(width), 1024)
    _ring_kernel[(T, triton.cdiv(width, bc))](
        proj, proj.stride(0), meta.token_seq, meta.positions, meta.seg_end,
        pools.buffers[state_kind], meta.tables[state_kind], meta.tables[state_kind].stride(0), state.page_bytes,
        state_off, state.entry_bytes, width, RING=rows, BC=bc, num_warps=4, **launch_options(proj))


@triton.jit
def _emit_kernel(proj_ptr, stride_p, seq_ptr, pos_ptr, seg_start_ptr,
                 st_buf, st_table, st_tstride, st_page_bytes, st_layer_off, st_row_bytes,
                 out_buf, out_table, out_tstride, out_page_bytes, out_layer_off, out_entry_stride,
                 ape_ptr, w_ptr, inv_freq_ptr, eps, h,
                 RATIO: tl.constexpr, OVERLAP: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr,
                 RING: tl.constexpr, EPP: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr,
                 PACK: tl.constexpr, ENTRY_BYTES: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    if (pos + 1) % RATIO != 0:
        return
    seq = tl.load(seq_ptr + t)
    start = tl.load(seg_start_ptr + seq)
    n = (pos + 1) // RATIO - 1
    cols = tl.arange(0, D)
    cmask = cols < h
    coff = 2 if OVERLAP else 1
    slot = tl.load(st_table + seq * st_tstride)
    ring_row0 = st_buf + slot.to(tl.int64) * st_page_bytes + st_layer_off
    m = tl.full((D,), float("-inf"), tl.float32)
    l = tl.zeros((D,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for r0 in range(0, ROWS, BR):
        j = r0 + tl.arange(0, BR)
        tp = n * RATIO - (RATIO if OVERLAP else 0) + j  # token of each row
        half = (j >= RATIO).to(tl.int32) if OVERLAP else tl.zeros_like(j)
        kv_col = half[:, None] * h + cols[None, :]
        sc_col = coff * h + kv_col
        ok = (tp >= 0)[:, None] & cmask[None, :]
        in_ring = (tp < start)[:, None]
        ring_ptr = (ring_row0 + ((tp % RING) * st_row_bytes)[:, None]).to(tl.pointer_type(tl.float32))
        new_ptr = proj_ptr + (t - (pos - tp)).to(tl.int64)[:, None] * stride_p
        kv = tl.where(in_ring, tl.load(ring_ptr + kv_col, mask=ok & in_ring, other=0.0),
                      tl.load(new_ptr + kv_col, mask=ok & ~in_ring, other=0.0))
        sc = tl.where(in_ring, tl.load(ring_ptr + sc_col, mask=ok & in_ring, other=0.0),
                      tl.load(new_ptr + sc_col, mask=ok & ~in_ring, other=0.0))
        sc += tl.load(ape_ptr + (tp % RATIO)[:, None] * (coff * h) + kv_col, mask=ok, other=0.0)
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[None, :])
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        m = m_new
    pooled = tl.where(cmask, acc / l, 0.0)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    y = w * pooled * tl.rsqrt(tl.sum(pooled * pooled, axis=0) / h + eps)
    # rope at position n·ratio on the trailing ROPE channels (pairs 2i, 2i+1)
    even, odd = tl.split(tl.reshape(y, (D // 2, 2)))
    half_i = tl.arange(0, D // 2)
    in_rope = (half_i >= NOPE // 2) & (half_i < (NOPE + ROPE) // 2)
    freq = (n * RATIO).to(tl.float32) * tl.load(inv_freq_ptr + half_i - NOPE // 2, mask=in_rope, other=0.0)
    cos, sin = tl.cos(freq), tl.sin(freq)
    y = tl.reshape(tl.join(tl.where(in_rope, even * cos - odd * sin, even),
                           tl.where(in_rope, odd * cos + even * sin, odd)), (D,))
    base = entry_base(out_table, out_tstride, seq, n, True, EPP, out_page_bytes, out_layer_off, out_entry_stride)
    store_entry(out_buf, base, y, cols, h, NOPE, ROPE, ENTRY_BYTES, D, PACK, index_scale_at(base, n, EPP, h))


@triton.jit
def _ring_kernel(proj_ptr, stride_p, seq_ptr, pos_ptr, seg_end_ptr, st_buf, st_table, st_tstride, st_page_bytes,
                 st_layer_off, st_row_bytes, width, RING: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    seq = tl.load(seq_ptr + t)
    if pos < tl.load(seg_end_ptr + seq) - RING:  # a later token of the segment owns this ring row
        return
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = cols < width
    slot = tl.load(st_table + seq * st_tstride)
    dst = st_buf + slot.to(tl.int64) * st_page_bytes + st_layer_off + (pos % RING) * st_row_bytes
    row = tl.load(proj_ptr + t.to(tl.int64) * stride_p + cols, mask=mask)
    tl.store(dst.to(tl.pointer_type(tl.float32)) + cols, row, mask=mask)

"""Sparse MQA with attention sink over the paged pools: each query attends to its sliding window
(the last `window` positions, SWA pool) plus its compressed entries (HCA: every complete window
of `ratio` tokens; CSA: the indexer's picks, -1 = none), one shared K = V head.

    out_h = Σ_j softmax_j([q_h·k_j / √d]_j ∪ {sink_h}) · k_j      (the sink carries no value)

then the rope channels of the output are rotated back by -position (the output de-rotation).

Kernel: one program per (token, block of BH heads, KV split). Entries are gathered through the
page tables and decoded to bf16 in registers (exact for bf16 and fp8_pack pools) a quarter of
the head dim at a time, once for the scores and again for P·V (see the kernel); both products
run on the tensor cores with fp32 accumulation, softmax is online in base 2. The sink
seeds the running max and denominator of split 0 (m = sink, l = 1, acc = 0), so no -inf ever
reaches an exponent. With one split the kernel also de-rotates and writes the final output;
with several (decode with few tokens, to fill the GPU) it writes partial (acc, m, l) that
`_combine_kernel` merges and de-rotates in one more launch (`combine_reference` in torch: a
dozen launches and as many passes over the partials, which at batch 64 are 4 × the output).

On sm_90 with `fp8_pack` pools `attend` runs `sparse_attention_wgmma`'s kernel instead (Gluon:
each block decoded once into shared memory, asynchronous wgmma; same grid, splits and combine;
faster at large batches, docs/results.md, decode step); this Triton kernel serves other
GPUs, bf16 and fp32 pools, the interpreter, and any call that names its launch options.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import check_impl, num_sms
from model.kernels.attention import sparse_attention_wgmma
from model.kernels.attention.pool_io import alignment, entry_base, load_entries, pack_code
from model.kernels.attention.rope import rotate_pairs
from model.kernels.common import invariant
from model.kernels.common.pdl import launch_options, wait
from model.rope import Rope

LOG2E = 1.4426950408889634
COMBINE_HEADS = 4  # heads per `_combine_kernel` program: [4, 512] fp32, 16 registers a thread


# ---------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------

def reference(q, batch, pools, layer: int, ratio: int, picks, sink, window: int, rope: Rope) -> torch.Tensor:
    """q [T, H, d] → de-rotated output [T, H, d] float32 (see module docstring).

    Each query attends over its own entries, laid out the same way in every batch and chunk:
    the sink, then its window oldest first (slot j: position p - window + 1 + j), then its
    compressed entries in entry order (CSA: its picks; HCA: every entry of the request, those
    past its causal end masked). Masked slots hold zero keys, and the products and the softmax's
    sum are `invariant`'s, which zeros do not change: a query's output is the same bits whatever
    the segment's length, start or companions."""
    T, H, d = q.shape
    out = torch.empty(T, H, d, dtype=torch.float32, device=q.device)
    kind = {4: "c4", 128: "c128"}.get(ratio)
    dev = q.device
    cfg = pools.cfg
    # the most entries a query can attend to (its picks, or every window of the longest context)
    longest = window + (cfg.index_topk if picks is not None else cfg.max_position_embeddings // ratio if ratio else 0)
    for seg in batch.segments:
        qs, qpos = q[seg.rows].float(), batch.positions[seg.rows]
        first = max(0, seg.start - window + 1)
        keys = pools.read("swa", layer, seg.seq.pages["swa"], torch.arange(first, seg.end, device=dev))
        kpos = qpos.unsqueeze(1) - window + 1 + torch.arange(window, device=dev)  # [S, window]
        visible, slots = kpos >= 0, (kpos - first).clamp_min(0)
        if ratio:
            n = seg.end // ratio
            comp = pools.read(kind, layer, seg.seq.pages[kind], torch.arange(n, device=dev))
            if picks is None:  # HCA: every complete window at or before the query
                ids = torch.arange(n, device=dev).expand(qs.shape[0], n)
                comp_visible = ids < ((qpos + 1) // ratio).unsqueeze(1)
            else:  # CSA: the indexer's picks (-1 = no pick)
                ids = picks[seg.rows].long()
                comp_visible = ids >= 0
            comp_slots = keys.shape[0] + ids.clamp(0, n - 1) if n else torch.zeros_like(ids)  # (none: masked)
            keys = torch.cat([keys, comp])
            slots = torch.cat([slots, comp_slots], dim=1)
            visible = torch.cat([visible, comp_visible], dim=1)
        # each query's keys [S, L, d], zero where masked (quantised once, then gathered)
        mine = invariant.Rows.of(keys).take(slots).masked(visible)
        logits = invariant.dot(qs, mine) * d ** -0.5  # [S, H, L]
        logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
        sinks = sink.float().view(1, -1, 1).expand(qs.shape[0], -1, 1)
        probs = invariant.softmax(torch.cat([sinks, logits], dim=-1), dim=-1)[..., 1:]
        out[seg.rows] = invariant.mix(probs, mine, k_max=longest)
    return rope.apply(out, batch.positions, inverse=True)


# ---------------------------------------------------------------------------------------
# op
# ---------------------------------------------------------------------------------------

def attend(q: torch.Tensor, batch, pools, layer: int, ratio: int, picks: torch.Tensor | None, sink: torch.Tensor,
           window: int, rope: Rope, impl: str, block_h: int | None = None, splits: int | None = None,
           block_n: int | None = None, out_dtype: torch.dtype = torch.float32, num_warps: int | None = None,
           num_stages: int | None = None, wgmma: bool | None = None, deterministic: bool = False) -> torch.Tensor:
    """q [T, H, d] (roped) → [T, H, d] de-rotated attention output in `out_dtype` (fp32 inside;
    the kernel stores the rounded result itself, which saves a pass over [T, H, d] in prefill).

    picks [T, K] int32 (-1 padded) on CSA layers, None otherwise. `block_h` / `splits` override
    the launch heuristics (tests and tuning), as do `block_n` (entries per step) and the launch options.
    `wgmma`: run `sparse_attention_wgmma`'s kernel (None: wherever it applies and no launch option
    of this kernel is given; it has its own). `deterministic`: `DETERMINISTIC_SPLITS` splits for
    every step, merged by the combine launch, in launches of at most `DETERMINISTIC_ROWS` tokens
    (`split_count`)."""
    if check_impl(impl) == "torch":
        return reference(q, batch, pools, layer, ratio, picks, sink, window, rope).to(out_dtype)
    T, H, d = q.shape
    out = torch.empty(T, H, d, dtype=out_dtype, device=q.device)
    if T == 0:
        return out
    meta = batch.meta
    kind = {4: "c4", 128: "c128"}.get(ratio, "swa")  # "swa" as a placeholder pool when ratio == 0
    swa, comp = pools.specs["swa"], pools.specs[kind]
    n_comp = 0 if not ratio else (picks.shape[1] if picks is not None else meta.max_end // ratio)
    bh = block_h or min(64, max(16, triton.next_power_of_2(H)))
    programs = T * triton.cdiv(H, bh)
    # 64 entries a step, decode as prefill: the fastest in both the decode and the prefill sweeps
    # (benchmarks/research/decode_attention_sweep.py, benchmarks/research/attention_sweep.py)
    bn = block_n or 64
    blocks = triton.cdiv(window, bn) + triton.cdiv(n_comp, bn)
    if splits is None:
        splits = split_count(programs, blocks, num_sms(q.device), deterministic)
    if deterministic and T > DETERMINISTIC_ROWS:
        # the split partials of a prefill-size step in slices: each query's program is its own
        for lo in range(0, T, DETERMINISTIC_ROWS):
            rows = slice(lo, min(T, lo + DETERMINISTIC_ROWS))
            out[rows] = attend(q[rows], _RowSlice(batch, rows), pools, layer, ratio,
                               None if picks is None else picks[rows], sink, window, rope, impl, block_h, splits,
                               block_n, out_dtype, num_warps, num_stages, wgmma, deterministic)
        return out
    if splits == 1:
        partial, ml = out, out  # unused
    else:
        partial = torch.empty(splits, T, H, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(splits, T, H, 2, dtype=torch.float32, device=q.device)
    fits = sparse_attention_wgmma.supported(q, d, rope.dim, pack_code(pools, "swa"), pack_code(pools, kind))
    if wgmma is None:
        wgmma = fits and (block_h, block_n, num_warps, num_stages) == (None,) * 4
    elif wgmma and not fits:
        raise ValueError(f"the wgmma sparse-attention kernel reads fp8_pack pools of {sparse_attention_wgmma.NOPE.value} "
                         f"+ {sparse_attention_wgmma.ROPE.value}-column entries on sm_90; got {pools.format} pools, "
                         f"d={d}, rope {rope.dim}, on {q.device}")
    args = _launch_args(q, out, partial, ml, meta, pools, layer, kind, picks, sink, rope, n_comp)
    consts = dict(WINDOW=window, RATIO=ratio, HAS_PICKS=picks is not None, SWA_EPP=swa.entries_per_page,
                  C_EPP=comp.entries_per_page, SPLITS=splits, SWA_ALIGN=alignment(pools, "swa"),
                  C_ALIGN=alignment(pools, kind))
    if wgmma:
        sparse_attention_wgmma.launch(args, T, H, d ** -0.5 * LOG2E, consts, bool(launch_options(q)))
    else:
        _sparse_attn_kernel[(T, triton.cdiv(H, bh), splits)](
            *args, H, d, d ** -0.5 * LOG2E, **consts, NOPE=d - rope.dim, ROPE=rope.dim, PACK=pack_code(pools, "swa"),
            BH=bh, BN=bn, D=triton.next_power_of_2(d), num_warps=num_warps or (8 if bh >= 64 else 4),
            num_stages=num_stages or 2, **launch_options(q))
    if splits > 1:
        combine(partial, ml, meta.positions, rope, out)
    return out


# `--deterministic`: this many KV splits at every step size. Entry block i goes to split i mod S
# whatever the step, a split past a query's entries or over blocks of no entry (-1 picks, a batch's
# wider top-k) leaves its sums as they were (α = 1, p = 0), and the combine weighs an empty split
# 0: a query's sums run in one order, set by its own entries. Always more than one, so every
# step goes through the same combine launch.
DETERMINISTIC_SPLITS = 8
# ... and the step's split partials (S × T × H × d fp32, 1 MB a token at V4-Flash widths) in
# launches of at most this many queries
DETERMINISTIC_ROWS = 256


def split_count(programs: int, blocks: int, sms: int, deterministic: bool = False) -> int:
    """KV splits of a step of `programs` (token, head block) programs over `blocks` entry blocks
    on `sms` SMs: split the entries while the split programs still fit one wave, down to a block
    each: the power of two from `blocks` on, some splits then empty; small batches gain most
    (benchmarks/research/decode_attention_sweep.py). Powers of two keep the compiled variants few.
    `deterministic`: `DETERMINISTIC_SPLITS`, whatever the step."""
    if deterministic:
        return DETERMINISTIC_SPLITS
    splits = 1
    while programs * splits * 2 <= sms and blocks > splits:
        splits *= 2
    return splits


class _RowSlice:
    """A batch's kernel metadata for its token rows `rows`: what `attend` reads of `batch.meta`
    (each row's request and position, the page tables, the longest request's end)."""

    def __init__(self, batch, rows: slice):
        m = batch.meta
        self.token_seq, self.positions, self.tables, self.max_end = m.token_seq[rows], m.positions[rows], m.tables, \
            m.max_end
        self.meta = self


def _launch_args(q, out, partial, ml, meta, pools, layer: int, kind: str, picks, sink, rope: Rope, n_comp: int) -> tuple:
    """The arguments both attention kernels take first, in their order: q and out with their token
    and head strides, the partials, the batch's rows, the sink and RoPE, each pool's buffer, page
    table, page bytes, layer offset and entry bytes (window, then compressed), the picks (the
    token rows as a placeholder on other layers) and how many a row holds."""
    swa, comp = pools.specs["swa"], pools.specs[kind]
    picks_arg = picks if picks is not None else meta.token_seq
    return (q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), partial, ml,
            meta.token_seq, meta.positions, sink, rope.inv_freq_on(q.device),
            pools.buffers["swa"], meta.tables["swa"], meta.tables["swa"].stride(0), swa.page_bytes,
            pools._local["swa"][layer] * swa.layer_bytes, swa.entry_bytes,
            pools.buffers[kind], meta.tables[kind], meta.tables[kind].stride(0), comp.page_bytes,
            pools._local[kind].get(layer, 0) * comp.layer_bytes, comp.entry_bytes,
            picks_arg, picks_arg.stride(0) if picks is not None else 0, n_comp)


def combine(partial: torch.Tensor, ml: torch.Tensor, positions: torch.Tensor, rope: Rope, out: torch.Tensor) -> None:
    """`combine_reference` into out [T, H, d] (any float dtype, rounded once), one launch."""
    S, T, H, d = partial.shape
    # a program a head while the heads of all tokens fill fewer than four programs an SM: a step
    # of a few tokens has many splits to read (16 at batch 1) and few heads to spread them over
    bh = COMBINE_HEADS if T * H >= COMBINE_HEADS * num_sms(partial.device) else 1
    _combine_kernel[(T, triton.cdiv(H, bh))](
        partial, ml, out, out.stride(0), out.stride(1), positions, rope.inv_freq_on(partial.device), H, d,
        SPLITS=S, BH=bh, D=triton.next_power_of_2(d), ROPE=rope.dim, num_warps=4,
        **launch_options(partial))


def combine_reference(partial: torch.Tensor, ml: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """What `_combine_kernel` computes: split partials (acc [S, T, H, d], (m, l) [S, T, H, 2] with
    base-2 logits) merged into [T, H, d] float32 and de-rotated."""
    m, l = ml[..., 0], ml[..., 1]
    w = torch.exp2(m - m.amax(dim=0, keepdim=True))
    out = (w.unsqueeze(-1) * partial).sum(0) / (w * l).sum(0).unsqueeze(-1)
    return rope.apply(out, positions, inverse=True)


# ---------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------

@triton.jit
def _pv(acc, alpha, p, row_ptr, valid, c0: tl.constexpr, DC: tl.constexpr, d, NOPE: tl.constexpr,
        ROPE: tl.constexpr, PACK: tl.constexpr):
    k = load_entries(row_ptr, valid, c0, DC, d, NOPE, ROPE, PACK).to(tl.bfloat16)
    return acc * alpha[:, None] + tl.dot(p, k)


@triton.jit
def _finish(acc, l, c0: tl.constexpr, DC: tl.constexpr, pos, inv_freq_ptr, heads, hmask, t, split, H, d,
            out_ptr, stride_ot, stride_oh, partial_ptr, ml_ptr, m, BH: tl.constexpr, ROPE: tl.constexpr,
            SPLITS: tl.constexpr):
    """Store output columns [c0, c0 + DC): normalised and de-rotated (one split) or the partial."""
    cols = c0 + tl.arange(0, DC)
    cmask = hmask[:, None] & (cols < d)[None, :]
    if SPLITS == 1:
        o = acc / l[:, None]
        if c0 + DC > d - ROPE:  # de-rotate the rope channels (by -pos)
            even, odd = tl.split(tl.reshape(o, (BH, DC // 2, 2)))
            even, odd = rotate_pairs(even, odd, c0, pos, inv_freq_ptr, d, ROPE, True)
            o = tl.reshape(tl.join(even, odd), (BH, DC))
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        row = (split * tl.num_programs(0) + t) * H + heads
        tl.store(partial_ptr + row[:, None] * d + cols[None, :], acc, mask=cmask)
        if c0 == 0:
            tl.store(ml_ptr + row * 2, m, mask=hmask)
            tl.store(ml_ptr + row * 2 + 1, l, mask=hmask)


@triton.jit
def _sparse_attn_kernel(
        q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, partial_ptr, ml_ptr,
        seq_ptr, pos_ptr, sink_ptr, inv_freq_ptr,
        swa_buf, swa_table, swa_tstride, swa_page_bytes, swa_layer_off, swa_entry_bytes,
        c_buf, c_table, c_tstride, c_page_bytes, c_layer_off, c_entry_bytes,
        picks_ptr, stride_pk, n_comp,
        H, d, scale_log2,
        WINDOW: tl.constexpr, RATIO: tl.constexpr, HAS_PICKS: tl.constexpr, SWA_EPP: tl.constexpr,
        C_EPP: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, PACK: tl.constexpr,
        BH: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SWA_ALIGN: tl.constexpr,
        C_ALIGN: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    # The head dim is worked in 4 column chunks: K is decoded chunk by chunk for q·kᵀ and again for
    # p·k (an L1/L2 hit), so the decoded tile never holds a whole [BN, D] in registers beside the
    # [BH, D] accumulator (which, whole, makes the kernel spill).
    DC: tl.constexpr = D // 4
    t = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    offs = tl.arange(0, BN)
    hmask = heads < H
    seq = tl.load(seq_ptr + t)
    pos = tl.load(pos_ptr + t)
    # (q straight from loads: the compiler keeps them in shared memory as the MMA's A operands; a q
    # computed in registers here, e.g. the RMS rescale and RoPE fused in, stays in registers and
    # spills next to the accumulator, which is slower)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    c = tl.arange(0, DC)
    q0 = tl.load(q_row + c[None, :], mask=hmask[:, None] & (c < d)[None, :], other=0.0).to(tl.bfloat16)
    q1 = tl.load(q_row + DC + c[None, :], mask=hmask[:, None] & (DC + c < d)[None, :], other=0.0).to(tl.bfloat16)
    q2 = tl.load(q_row + 2 * DC + c[None, :], mask=hmask[:, None] & (2 * DC + c < d)[None, :],
                 other=0.0).to(tl.bfloat16)
    q3 = tl.load(q_row + 3 * DC + c[None, :], mask=hmask[:, None] & (3 * DC + c < d)[None, :],
                 other=0.0).to(tl.bfloat16)
    if split == 0:  # the sink: a logit with a zero value vector
        m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        l = tl.full((BH,), 1.0, tl.float32)
    else:
        m = tl.full((BH,), -1e30, tl.float32)
        l = tl.zeros((BH,), tl.float32)
    acc0 = tl.zeros((BH, DC), tl.float32)
    acc1 = tl.zeros((BH, DC), tl.float32)
    acc2 = tl.zeros((BH, DC), tl.float32)
    acc3 = tl.zeros((BH, DC), tl.float32)

    lo = tl.maximum(pos - WINDOW + 1, 0)
    n_win_blocks = tl.cdiv(WINDOW, BN)
    if RATIO == 0:
        n_blocks = n_win_blocks
    elif HAS_PICKS:
        n_blocks = n_win_blocks + tl.cdiv(n_comp, BN)
    else:
        n_blocks = n_win_blocks + tl.cdiv((pos + 1) // RATIO, BN)
    for i in range(split, n_blocks, SPLITS):
        if i < n_win_blocks:
            idx = lo + i * BN + offs
            valid = idx <= pos
            row_ptr = swa_buf + entry_base(swa_table, swa_tstride, seq, idx, valid, SWA_EPP, swa_page_bytes,
                                           swa_layer_off, swa_entry_bytes, SWA_ALIGN)
        else:
            j = (i - n_win_blocks) * BN + offs
            if HAS_PICKS:
                idx = tl.load(picks_ptr + t * stride_pk + j, mask=j < n_comp, other=-1)
                valid = idx >= 0
            else:
                idx = j
                valid = j < (pos + 1) // RATIO
            row_ptr = c_buf + entry_base(c_table, c_tstride, seq, idx, valid, C_EPP, c_page_bytes, c_layer_off,
                                         c_entry_bytes, C_ALIGN)
        s = tl.dot(q0, tl.trans(load_entries(row_ptr, valid, 0, DC, d, NOPE, ROPE, PACK).to(tl.bfloat16)))
        s += tl.dot(q1, tl.trans(load_entries(row_ptr, valid, DC, DC, d, NOPE, ROPE, PACK).to(tl.bfloat16)))
        s += tl.dot(q2, tl.trans(load_entries(row_ptr, valid, 2 * DC, DC, d, NOPE, ROPE, PACK).to(tl.bfloat16)))
        s += tl.dot(q3, tl.trans(load_entries(row_ptr, valid, 3 * DC, DC, d, NOPE, ROPE, PACK).to(tl.bfloat16)))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        p = p.to(tl.bfloat16)
        acc0 = _pv(acc0, alpha, p, row_ptr, valid, 0, DC, d, NOPE, ROPE, PACK)
        acc1 = _pv(acc1, alpha, p, row_ptr, valid, DC, DC, d, NOPE, ROPE, PACK)
        acc2 = _pv(acc2, alpha, p, row_ptr, valid, 2 * DC, DC, d, NOPE, ROPE, PACK)
        acc3 = _pv(acc3, alpha, p, row_ptr, valid, 3 * DC, DC, d, NOPE, ROPE, PACK)
        m = m_new

    args = (pos, inv_freq_ptr, heads, hmask, t, split, H, d, out_ptr, stride_ot, stride_oh, partial_ptr, ml_ptr, m)
    _finish(acc0, l, 0, DC, *args, BH, ROPE, SPLITS)
    _finish(acc1, l, DC, DC, *args, BH, ROPE, SPLITS)
    _finish(acc2, l, 2 * DC, DC, *args, BH, ROPE, SPLITS)
    _finish(acc3, l, 3 * DC, DC, *args, BH, ROPE, SPLITS)


@triton.jit
def _combine_kernel(partial_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, pos_ptr, inv_freq_ptr, H, d,
                    SPLITS: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                    PDL: tl.constexpr = False):
    """One (token, BH heads) program: out = Σ_s 2^(m_s - M)·acc_s / Σ_s 2^(m_s - M)·l_s, M = max_s m_s,
    then the rope pairs rotated by -position. Partial row (s, t, h) = (s·T + t)·H + h, as `_finish`
    stores it; a split that saw no entry has m = -1e30, l = 0, acc = 0 and weighs nothing (split 0
    holds the sink, so M is finite)."""
    wait(PDL)
    t = tl.program_id(0)
    T = tl.num_programs(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    cols = tl.arange(0, D)
    mask = hmask[:, None] & (cols < d)[None, :]
    mx = tl.full((BH,), -1e30, tl.float32)
    # both loops unrolled: every split's loads in flight at once, not one L2 round trip a split
    for s in tl.static_range(SPLITS):
        mx = tl.maximum(mx, tl.load(ml_ptr + ((s * T + t) * H + heads) * 2, mask=hmask, other=-1e30))
    acc = tl.zeros((BH, D), tl.float32)
    den = tl.zeros((BH,), tl.float32)
    for s in tl.static_range(SPLITS):
        row = (s * T + t) * H + heads
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=hmask, other=-1e30) - mx)
        den += w * tl.load(ml_ptr + row * 2 + 1, mask=hmask, other=0.0)
        acc += w[:, None] * tl.load(partial_ptr + row[:, None] * d + cols[None, :], mask=mask, other=0.0)
    o = acc / tl.where(hmask, den, 1.0)[:, None]
    even, odd = tl.split(tl.reshape(o, (BH, D // 2, 2)))
    even, odd = rotate_pairs(even, odd, 0, tl.load(pos_ptr + t), inv_freq_ptr, d, ROPE, True)
    o = tl.reshape(tl.join(even, odd), (BH, D))
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mask)

"""Lightning indexer: per query, score every causal compressed entry and keep the top k.

    score[t, j] = Σ_h w[t, h] · relu(q[t, h] · k_j) / √c      for j < (pos_t + 1) / 4

keys from the C4-indexer pool (FP8 + fp32 scale per key, or bf16 / fp32; with FP8 keys and
`fp8_query`, a W8A8 model's, q is taken in FP8 too: `scoring_query`), q [T, n_I, c] roped
(or rotated here, given the `Rope`: by the logits kernel, as it loads each query, rather than by a
launch of its own), w [T, n_I] the head weights (already scaled by n_I^-½). picks [T, K] int32, K = min(topk,
entries of the longest request), -1 where a query sees fewer than K entries.

`_select_kernel` takes a row's top k in one program: it finds the k-th largest score by
deciding its bits from the top (counts or histograms over the row held in registers; floats made
order-preserving as integers, -0 as +0; the passes stop early once the k-th's bucket is to be
taken whole, its smallest entry then being the k-th), keeps the entries above it and, of those
equal to it, the lowest first (`invariant.top_k`'s rule, the reference's too), and writes them
in entry order (a prefix sum places each), -1 after them. Picks are a set to the attention, so
no sort: entry order is what the reference gives too (`select`), and it walks the pages in
order; a bitonic sort of the whole row would cost the row times log² of it.

Batched prefill needs no ks/ke arrays: each query reads its own request's pages (its row of the
page table) from entry 0 to its own causal end (pos + 1) / 4, so programs past a query's end
write -inf and read nothing. The logits of a chunk of queries are materialised [T_chunk, N] for
the top-k, with T_chunk bounded so that buffer stays under `max_logit_bytes`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model import low_precision
from model.kernels import check_impl, num_sms
from model.kernels.attention.pool_io import alignment, entry_base, index_scale_at, load_entries, pack_code
from model.kernels.attention.rope import rotate_pairs
from model.kernels.common import invariant
from model.kernels.common.pdl import launch_options, wait
from model.kernels.gemm.act_quant import quantize_blocks
from model.rope import Rope


def scoring_query(q: torch.Tensor, pools, fp8_query: bool) -> torch.Tensor:
    """q [T, n_I, c] → float32 [T, n_I, c], the query the scores see. `fp8_query` (a model whose
    projections run W8A8: `quantize_model(..., act_fp8=True)`) against FP8 keys (the `fp8_pack`
    pools): the query is FP8 too, as seed 001's `fp8_mqa_logits(q_fp8, kv_fp8, ...)` takes it,
    e4m3 codes with a UE8M0 scale per head (`low_precision.fp8_quantize_rows`, a block of c), so the
    logits are one e4m3 × e4m3 product on the tensor cores. Otherwise q as it is: like W8A8's
    activations, the codes turn last-bit differences of q (another batch shape's sums) into
    whole-step ones, which a model with exact activations does not have."""
    if not (fp8_query and pools.format == "fp8_pack"):
        return q.float()
    c = q.shape[-1]
    return low_precision.fp8_dequantize_rows(*low_precision.fp8_quantize_rows(q.float(), c), c)


def reference(q, w, batch, pools, layer: int, topk: int, fp8_query: bool = False) -> torch.Tensor:
    T, n_heads, c = q.shape
    max_end = max(s.end for s in batch.segments)
    K = min(topk, max_end // 4)
    picks = torch.full((T, K), -1, dtype=torch.int32, device=q.device)
    q = scoring_query(q, pools, fp8_query)
    for seg in batch.segments:
        n = seg.end // 4
        keys = pools.read("c4_indexer", layer, seg.seq.pages["c4_indexer"], torch.arange(n, device=q.device))
        # a score is one query row against one key: the same bits in any batch or chunk (`invariant`)
        scores = invariant.dot(q[seg.rows], invariant.Rows.of(keys)).relu() * c ** -0.5  # [S, n_I, n]
        scores = invariant.sum(scores * w[seg.rows].float().unsqueeze(-1), dim=1)  # [S, n]
        picks[seg.rows, : min(topk, n)] = select(scores, batch.positions[seg.rows], topk).int()
    return picks


def select(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [S, n] of queries at `positions` [S] → top-k entry ids [S, min(k, n)] in entry
    order, -1 after them where a query has fewer than k causal entries (entry j is causal for p
    iff j < (p+1)/4). Ties by `invariant.top_k`'s rule: equal scores (ReLU makes many, zeros
    above all) go to the lower entries, as the select kernel takes them."""
    n = scores.shape[1]
    visible = (positions + 1) // 4
    future = torch.arange(n, device=scores.device) >= visible.unsqueeze(1)
    top = invariant.top_k(scores.masked_fill(future, float("-inf")), topk)[1]
    return _in_entry_order(torch.where(top >= visible.unsqueeze(1), -1, top), n)


def _in_entry_order(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Ids [R, K] (-1 = none) → the same ids ascending, the -1s last."""
    ordered = torch.where(ids < 0, n, ids).sort(dim=-1).values
    return torch.where(ordered == n, -1, ordered)


def logits(q: torch.Tensor, w: torch.Tensor, batch, pools, layer: int, rows: slice, n_max: int,
           block_n: int | None = None, blocks: int | None = None, num_warps: int = 4, rope: Rope | None = None,
           w_scale: float = 1.0, fp8_query: bool = False, deterministic: bool = False) -> torch.Tensor:
    """Kernel: scores [rows, n_max] float32 of the queries in `rows`, -inf past each causal end;
    `rope`: q is not roped yet, each program rotates its query's heads as `rope_ops.rotate` would
    (fp32, rounded back to q's dtype: the same bits); the head weights are w · `w_scale` (fp32,
    the bits of scaling w first, without that element-wise launch); `fp8_query`: `scoring_query`'s.
    A program takes `blocks` blocks of `block_n` keys: the most of 2, 4, 8, 16 blocks of 64 that
    still leaves two waves of programs (programs of more keys load the query fewer times; fewer
    than two waves leave SMs idle), and from 256 keys a program those keys in blocks of 128: half
    the loop bodies, each MMA twice as tall (batch 1 keeps 2 blocks of 64). The choices are the
    fastest in benchmarks/research/decode_attention_sweep.py --skip-attention (docs/journal/).
    `deterministic`: `logit_blocks(..., deterministic=True)`."""
    meta = batch.meta
    spec = pools.specs["c4_indexer"]
    T = rows.stop - rows.start
    n_heads, c = q.shape[1], q.shape[2]
    out = torch.empty(T, n_max, dtype=torch.float32, device=q.device)
    bn, nb = logit_blocks(T, n_max, num_sms(q.device), block_n, blocks, deterministic)
    qs, ws = q[rows], w[rows]
    _logits_kernel[(T, triton.cdiv(n_max, bn * nb))](
        qs, qs.stride(0), qs.stride(1), ws, ws.stride(0), out, out.stride(0),
        meta.token_seq[rows], meta.positions[rows],
        pools.buffers["c4_indexer"], meta.tables["c4_indexer"], meta.tables["c4_indexer"].stride(0), spec.page_bytes,
        pools._local["c4_indexer"][layer] * spec.layer_bytes, spec.entry_stride, n_max, n_heads, c, c ** -0.5, w_scale,
        rope.inv_freq_on(q.device) if rope is not None else qs, ROPE=rope.dim if rope is not None else 0,
        EPP=spec.entries_per_page, PACK=pack_code(pools, "c4_indexer"), Q8=fp8_query,
        NH=max(16, triton.next_power_of_2(n_heads)),
        C=max(32, triton.next_power_of_2(c)), BN=bn, NB=nb, ALIGN=alignment(pools, "c4_indexer"), num_warps=num_warps,
        **launch_options(qs))
    return out


def logit_blocks(T: int, n_max: int, sms: int, block_n: int | None = None, blocks: int | None = None,
                 deterministic: bool = False) -> tuple[int, int]:
    """(keys per block, blocks per program) of the logits launch (`logits` says how they are
    chosen). `deterministic`: 2 blocks of 64 at every step: the head sum of a key's score runs
    over a tile of the same shape whatever T or the batch's longest request."""
    bn, nb = block_n or 64, blocks or 2
    if deterministic:
        return bn, nb
    while blocks is None and nb < 16 and T * triton.cdiv(n_max, bn * nb * 2) >= 2 * sms:
        nb *= 2
    if block_n is None and blocks is None and nb >= 4:
        bn, nb = 128, nb // 2
    return bn, nb


def indexer_topk(q: torch.Tensor, w: torch.Tensor, batch, pools, layer: int, topk: int, impl: str,
                 max_logit_bytes: int = 1 << 28, rope: Rope | None = None, w_scale: float = 1.0,
                 fp8_query: bool = False, deterministic: bool = False) -> torch.Tensor:
    """q [T, n_I, c], w [T, n_I] → picks [T, K] int32 (see module docstring); `rope`: q is not
    roped yet (the kernels rotate it in the logits launch); the head weights are w · `w_scale`
    (float32; the kernels scale them in the logits launch); `fp8_query`: `scoring_query`'s;
    `deterministic`: one logits tile for every step (`logit_blocks`). The top-k is exact either
    way (the same ids for any row length; a batch's wider K only adds -1s, which the attention
    skips)."""
    if check_impl(impl) == "torch":
        if rope is not None:
            q = rope.apply(q, batch.positions)
        return reference(q, w * w_scale if w_scale != 1.0 else w, batch, pools, layer, topk, fp8_query)
    T = q.shape[0]
    n_max = batch.meta.max_end // 4
    K = min(topk, n_max)
    if K == 0 or T == 0:
        return torch.empty(T, K, dtype=torch.int32, device=q.device)

    def pick(rows: slice) -> torch.Tensor:
        return top_k(logits(q, w, batch, pools, layer, rows, n_max, rope=rope, w_scale=w_scale,
                            fp8_query=fp8_query, deterministic=deterministic), K)

    chunk = max(1, max_logit_bytes // (4 * n_max))
    if chunk >= T:  # one chunk (every decode step): the picks as top_k makes them, without a copy
        return pick(slice(0, T))
    picks = torch.empty(T, K, dtype=torch.int32, device=q.device)
    for lo in range(0, T, chunk):
        picks[lo:lo + chunk] = pick(slice(lo, min(T, lo + chunk)))
    return picks


# The select kernel holds a row in registers: up to 8192 entries (a 32K-token context); longer
# rows go to torch's multi-block radix select.
TOPK_KERNEL_MAX_N = 8192
# Bits of the K-th score the select kernel decides a pass: 2 by comparisons below 2048 entries, 4
# by histograms from there, with 8 warps. A step of few tokens runs one program a row, whose
# passes are serial; since they stop early (`_kth_by_histogram`) the histograms win at 2048 too
# (benchmarks/research/decode_attention_sweep.py --skip-attention, docs/journal/)
SELECT_HISTOGRAM_MIN_N = 2048


def top_k(scores: torch.Tensor, K: int, num_warps: int | None = None, digit_bits: int | None = None
          ) -> torch.Tensor:
    """scores [R, n] float32 (-inf = not causal) → the K best entry ids [R, K] int32 in entry order
    (ties at the K-th score: the lower entries), -1 after them where fewer than K scores are
    finite. `num_warps` and `digit_bits` (the K-th score's bits decided per pass: 1 or 2 by
    comparisons, 4 or 8 by histograms) override the select kernel's (tuning); every choice gives
    the same ids."""
    if digit_bits not in (None, 1, 2, 4, 8):
        raise ValueError(f"digit_bits must be 1, 2, 4 or 8, got {digit_bits}")
    R, n = scores.shape
    if n > TOPK_KERNEL_MAX_N:
        values, idx = invariant.top_k(scores, K)
        return _in_entry_order(torch.where(values == float("-inf"), -1, idx), n).int()
    out = torch.empty(R, K, dtype=torch.int32, device=scores.device)
    KP = triton.next_power_of_2(K)
    N = triton.next_power_of_2(n)
    bits = digit_bits or (4 if N >= SELECT_HISTOGRAM_MIN_N else 2)
    _select_kernel[(R,)](scores, scores.stride(0), out, out.stride(0), n, K, N=N, KP=KP, BITS=bits,
                         num_warps=num_warps or (8 if N >= SELECT_HISTOGRAM_MIN_N else 4),
                         **launch_options(scores))
    return out


@triton.jit
def _kth_by_counts(u, K, BITS: tl.constexpr):
    """(the K-th largest of u [N] uint32, 1 unless it stopped early), BITS bits a pass from the
    top: one reduction of [N, 2^BITS] comparisons a pass. Invariant: at least K entries are >= thr
    (all N are >= 0, and K <= n), so digit 0 always qualifies, and the counts fall as the digit
    grows: the largest qualifying digit is how many qualify, less one. Stops early where exactly K
    entries reach the chosen digit: their smallest is the K-th."""
    thr = tl.zeros([], dtype=tl.uint32)
    shift = tl.full([], 32, dtype=tl.uint32)
    digits = tl.arange(0, 2 ** BITS).to(tl.uint32)
    open_ = tl.full([], 1, dtype=tl.int32)  # 0 once thr is decided before its last bits
    for _ in range(32 // BITS):
        if open_ != 0:
            shift -= BITS
            counts = tl.sum((u[:, None] >= (thr | (digits << shift))[None, :]).to(tl.int32), 0)
            d = tl.sum((counts >= K).to(tl.int32), 0) - 1
            thr = thr | (d.to(tl.uint32) << shift)
            if tl.sum(tl.where(digits == d.to(tl.uint32), counts, 0), 0) == K:
                # exactly K entries from the chosen digit's start: the K-th is their smallest
                # (`_kth_by_histogram`'s early stop)
                thr = tl.min(tl.where(u >= thr, u, 0xFFFFFFFF), 0)
                open_ = 0
    return thr, open_


@triton.jit
def _kth_by_histogram(u, K, BITS: tl.constexpr):
    """(the K-th largest of u [N] uint32, 1 unless it stopped early), BITS bits a pass from the
    top: a histogram of the next digit over the entries that match the bits decided so far
    (`tl.histogram`: ballots within a warp, one shared-memory sum across warps): 4 bits a pass
    cost fewer instructions than two passes of 2-bit comparisons.
    Invariant: `rank` (>= 1) entries of the matching ones are still to be passed over to reach
    the K-th, and at least `rank` match; the chosen digit is the largest whose suffix count
    reaches `rank`, and `rank` drops by the count above it. Stops early where the chosen digit's
    bucket holds exactly `rank` entries: their smallest is the K-th."""
    B: tl.constexpr = 2 ** BITS
    thr = tl.zeros([], dtype=tl.uint32)
    decided = tl.zeros([], dtype=tl.uint32)  # the bits of thr fixed so far (a shift by 32 is undefined)
    rank = K
    shift = tl.full([], 32, dtype=tl.uint32)
    bins = tl.arange(0, B)
    open_ = tl.full([], 1, dtype=tl.int32)  # 0 once thr is decided before its last bits
    for _ in range(32 // BITS):
        if open_ != 0:
            shift -= BITS
            match = ((u ^ thr) & decided) == 0
            digit = (u >> shift) & (B - 1)
            h = tl.histogram(digit.to(tl.int32), B, mask=match)
            below = tl.cumsum(h, 0) - h  # entries of a smaller digit
            suffix = tl.sum(h, 0) - below  # of this digit or a larger one
            d = tl.sum((suffix >= rank).to(tl.int32), 0) - 1
            rank -= tl.sum(tl.where(bins == d, suffix - h, 0), 0)
            thr = thr | (d.to(tl.uint32) << shift)
            decided = decided | ((B - 1) << shift).to(tl.uint32)
            if tl.sum(tl.where(bins == d, h, 0), 0) == rank:
                # every entry of the chosen bucket is taken: the K-th is its smallest, and the
                # passes over the bits left would only spell that out (indexer-like scores stop
                # after 5-6 of 8 four-bit passes)
                thr = tl.min(tl.where(match & (digit == d.to(tl.uint32)), u, 0xFFFFFFFF), 0)
                open_ = 0
    return thr, open_


@triton.jit
def _select_kernel(s_ptr, stride_s, out_ptr, stride_o, n, K, N: tl.constexpr, KP: tl.constexpr,
                   BITS: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    bits = tl.load(s_ptr + t * stride_s + j, mask=j < n, other=float("-inf")).to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 as +0.0: equal scores, a tie (`invariant.top_k`)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped → signed int order
    u = (key ^ -2147483648).to(tl.uint32, bitcast=True)  # the same order as unsigned
    # the K-th largest u: the largest x with at least K entries >= x, decided BITS bits a pass from
    # the top, 32 / BITS passes
    if BITS <= 2:
        thr, full = _kth_by_counts(u, K, BITS)
    else:
        thr, full = _kth_by_histogram(u, K, BITS)
    if full != 0:  # every pass ran: of the entries equal to the K-th, the lowest as many as needed
        above = u > thr
        tie = u == thr
        take = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= K - tl.sum(above.to(tl.int32), 0)))
    else:  # stopped early: the K-th's bucket, all entries equal to it included, is taken whole
        take = u >= thr
    real = take & (bits != -8388608)  # -inf's bits: fewer than K causal entries leave -1s instead
    pos = tl.cumsum(real.to(tl.int32), 0) - 1
    row = out_ptr + t * stride_o
    tl.store(row + pos, j, mask=real)
    r = tl.arange(0, KP)
    tl.store(row + r, tl.full((KP,), -1, tl.int32), mask=(r >= tl.sum(real.to(tl.int32), 0)) & (r < K))


@triton.jit
def _fp16_query(q):
    """q [NH, C] (bf16 values) → (fp16 q · 2^k, 2^-k) with the largest |q| · 2^k in [2^14, 2^15).
    Exact for every element above 2^-29 of the largest (bf16's 8 significant bits fit fp16's 11
    wherever fp16 is normal); smaller ones round to fp16 subnormals, an error below 2^-39 of the
    largest, far under the fp32 sum's own rounding."""
    qf = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(qf), axis=1), axis=0), 1e-30)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax))
    up = ((127 + 14 - e) << 23).to(tl.float32, bitcast=True)
    down = ((127 - 14 + e) << 23).to(tl.float32, bitcast=True)
    return (qf * up).to(tl.float16), down


@triton.jit
def _logits_kernel(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, out_ptr, stride_ot, seq_ptr, pos_ptr,
                   buf, table, tstride, page_bytes, layer_off, entry_stride, n_max, n_heads, c, scale, w_scale,
                   inv_freq_ptr,
                   ROPE: tl.constexpr, EPP: tl.constexpr, PACK: tl.constexpr, Q8: tl.constexpr, NH: tl.constexpr,
                   C: tl.constexpr,
                   BN: tl.constexpr, NB: tl.constexpr, ALIGN: tl.constexpr, PDL: tl.constexpr = False):
    """One query × NB blocks of BN keys: the query's heads are loaded once for NB key blocks
    (they weigh more than a block of FP8 keys). Keys are the MMA's M side and heads its N side,
    so the head-weighted sum runs along each thread's accumulator row, not across warps, which
    would need a cross-warp reduction. ROPE > 0: the query's trailing ROPE channels are rotated
    here first.

    FP8 keys (PACK 3) with Q8 multiply an FP8 query (`scoring_query`): the head's e4m3 codes and
    UE8M0 scale as `act_quant.quantize_blocks` makes them, the raw keys as they lie in the pool,
    one e4m3 × e4m3 wgmma with no conversion of the keys, the fastest form. Without Q8 they
    multiply in fp16: e4m3 → fp16 is one exact conversion a pair, and q is scaled into fp16 by a
    power of two (`_fp16_query`). Either way each key's scale multiplies its score once, after the
    head sum (with the fp16 query's unscale), and the FP8 query's scales ride on the head
    weights, as √c does: relu commutes with a positive factor."""
    wait(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    n_vis = (pos + 1) // 4
    seq = tl.load(seq_ptr + t)
    heads = tl.arange(0, NH)
    cols = tl.arange(0, C)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=(heads < n_heads)[:, None] & (cols < c)[None, :], other=0.0)
    if ROPE > 0:  # as rope.py's `_rope_rows`: fp32 pairs, rounded back to q's dtype
        even, odd = tl.split(tl.reshape(q.to(tl.float32), (NH, C // 2, 2)))
        even, odd = rotate_pairs(even, odd, 0, pos, inv_freq_ptr, c, ROPE, False)
        q = tl.reshape(tl.join(even, odd), (NH, C)).to(q_ptr.dtype.element_ty)
    w = tl.load(w_ptr + t * stride_wt + heads, mask=heads < n_heads, other=0.0).to(tl.float32) * w_scale * scale
    unscale = 1.0
    if PACK == 3 and Q8:
        q, q_scale = quantize_blocks(q.to(tl.float32))  # [NH, C] e4m3, [NH] (zeros past c: same amax)
        w = w * q_scale
    elif PACK == 3:
        q, unscale = _fp16_query(q)
    else:
        q = q.to(tl.bfloat16)
    for b in tl.static_range(NB):
        j0 = (tl.program_id(1) * NB + b) * BN
        j = j0 + tl.arange(0, BN)
        if j0 >= n_vis:  # wholly past this query's causal end
            tl.store(out_ptr + t * stride_ot + j, tl.full((BN,), float("-inf"), tl.float32), mask=j < n_max)
        else:
            valid = j < n_vis
            base = entry_base(table, tstride, seq, j, valid, EPP, page_bytes, layer_off, entry_stride, ALIGN)
            if PACK == 3:  # FP8 keys: the raw e4m3 values (exact in fp16), each key's scale after the sum
                k = tl.load((buf + base[:, None] + cols[None, :]).to(tl.pointer_type(tl.float8e4nv)),
                            mask=valid[:, None] & (cols < c)[None, :], other=0.0)
                if not Q8:
                    k = k.to(tl.float16)
                factor = tl.load((buf + index_scale_at(base, j, EPP, c)).to(tl.pointer_type(tl.float32)),
                                 mask=valid, other=0.0) * unscale
            else:
                k = load_entries(buf + base, valid, 0, C, c, 0, 0, PACK).to(tl.bfloat16)  # [BN, C]
                factor = tl.full((BN,), 1.0, tl.float32)
            s = tl.dot(k, tl.trans(q))  # [BN, NH]
            score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * factor
            tl.store(out_ptr + t * stride_ot + j, tl.where(valid, score, float("-inf")), mask=j < n_max)

"""Manifold-constrained hyper-connections (mHC): the residual stream is hc parallel streams
x [T, hc, D]. Around each sub-block:

* `hc_pre`: mixes = rms(x.flatten) · fnᵀ (fn [(2+hc)·hc, hc·D]) split into pre [hc], post [hc],
  comb [hc, hc]; pre = σ(·) + eps, post = 2σ(·), comb = Sinkhorn-Knopp(softmax(·) + eps) (columns
  first, then rows / columns alternately, `hc_sinkhorn_iters` in all); collapsed = Σᵢ preᵢ·xᵢ;
* `hc_post`: new streams = post ⊗ out + combᵀ · x (in the activations' dtype);
* `hc_head`: the final collapse with pre only.

The model enters each sub-block through `sublayer_input`: the previous sub-block's `hc_post`
(left pending in a `Residual`), `hc_pre` and the RMSNorm of the collapse, which the reference runs
as ~55 small torch ops. The kernels (kernels/mhc/mhc_kernels.py):

* up to `SMALL_TOKENS` tokens (decode of a small batch), one launch, `_entry_small_kernel`: its
  programs split D, settle the pending streams, take their share of the mixes on the CUDA cores,
  and the last to arrive (a counter) adds the shares and writes the normed collapse. Four
  launches before it (post, mixes, Sinkhorn with the collapse, norm) each paid their latency at
  one token. Post and the Sinkhorn comb, which only the next entry reads, come from
  `_post_comb_kernel`, on a side stream beside the sub-block when the caller gives an
  `EntryScratch` (the block does);
* up to `BATCH_TOKENS` tokens (a decode batch), two launches: `_settle_mix_kernel`, whose
  programs each own a token block and D columns of every stream, settle them and take their
  share of the mixes on the tensor cores, then `_collapse_kernel`, a program a token: the
  partial mixes added in one fixed-shape sum, the normed collapse, post and the Sinkhorn comb;
* from more tokens (prefill), `_post_kernel`, then `_mix_kernel`: the skinny mixes GEMM on the
  tensor cores with Σx² for the RMS factor, its K split over programs when there are few token
  blocks, then `_pre_kernel`: the partial sums added in split order (deterministic), every
  Sinkhorn iteration in registers and the collapse, and the RMSNorm.

The tensor-core mixes split fn into bf16 hi + lo parts (the streams are bf16 on the GPU, exact
there), which keeps fp32-level accuracy at bf16 speed. The three paths round differently, so
an entry's bits depend on which one its token count selects.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from model.kernels import arrival_counter, check_impl
from model.kernels.common import invariant, rmsnorm
from model.kernels.common.pdl import launch_options
from model.kernels.mhc.mhc_kernels import (
    _collapse_kernel,
    _entry_small_kernel,
    _mix_kernel,
    _post_comb_kernel,
    _post_kernel,
    _pre_kernel,
    _settle_mix_kernel,
)
from model.side_stream import SideStream, fork, join

# ---------------------------------------------------------------------------------------
# references (the model's definition)
# ---------------------------------------------------------------------------------------

def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(invariant.mean(x.square(), -1, keepdim=True) + eps)


def reference_pre(x, fn, base, scale, hc: int, iters: int, hc_eps: float, rms_eps: float):
    mixes = invariant.linear(_unweighted_rms(x.flatten(1).float(), rms_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = invariant.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * invariant.sigmoid(post_w * scale[1] + post_b)
    comb = invariant.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (invariant.sum(comb, -2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (invariant.sum(comb, -1, keepdim=True) + hc_eps)
        comb = comb / (invariant.sum(comb, -2, keepdim=True) + hc_eps)
    collapsed = invariant.sum(pre.unsqueeze(-1) * x, 1).to(x.dtype)
    return collapsed, post, comb


def reference_head(x, fn, base, scale, hc_eps: float, rms_eps: float):
    mixes = invariant.linear(_unweighted_rms(x.flatten(1).float(), rms_eps), fn.float())
    pre = invariant.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return invariant.sum(pre.unsqueeze(-1) * x, 1).to(x.dtype)


def reference_post(out, x, post, comb):
    """post ⊗ out + combᵀ · x; combᵀ · x as fp32 products summed over the source stream, then
    rounded to x's dtype (what a GEMM of comb in that dtype gives, in a fixed order)."""
    dtype = x.dtype
    mixed = invariant.sum(comb.to(dtype).float().unsqueeze(-1) * x.float().unsqueeze(2), 1).to(dtype)  # [T, hc, D]
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + mixed


# ---------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual streams between sub-blocks: x [T, hc, D] and, while the last sub-block's
    `hc_post` is pending, its output `out` [T, D] with post [T, hc] and comb [T, hc, hc] (fp32);
    the streams' value is then post ⊗ out + combᵀ · x. The next `sublayer_input` settles them in
    the kernel that reads them anyway (one launch and one pass over the streams fewer)."""
    x: torch.Tensor
    out: torch.Tensor | None = None
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None

    def rows(self, rows) -> "Residual":
        """The same residual for token rows `rows` (an index of the first dim)."""
        pick = (lambda t: None if t is None else t[rows])  # noqa: E731
        return Residual(self.x[rows], pick(self.out), pick(self.post), pick(self.comb))


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


# Every program loads and splits the fn tile of each K step: 64 tokens share it, in prefill and in
# decode too, K split to fill the GPU; the fastest in benchmarks/research/mhc_sweep.py at both
# sizes (docs/journal/)
MIX_TILES = MixTiles(bt=64)


@dataclasses.dataclass(frozen=True)
class SmallTiles:
    """Launch shape of `_entry_small_kernel`: D columns per program (of every stream), warps."""
    columns: int = 32
    num_warps: int = 4


# Up to this many tokens a sub-block entry is one launch (`_entry_small_kernel`): faster than
# four launches there, slower from 4 tokens (benchmarks/research/mhc_sweep.py)
SMALL_TOKENS = 2
SMALL_TILES = SmallTiles()


@dataclasses.dataclass(frozen=True)
class BatchTiles:
    """Launch shape of a decode batch's two-launch entry (`_settle_mix_kernel`, `_collapse_kernel`):
    tokens per program (>= 16, the tensor cores' tile), D columns per program of every stream, warps."""
    bt: int = 64
    columns: int = 32
    num_warps: int = 4


# Up to this many tokens an entry is `_settle_mix_kernel` then `_collapse_kernel` (a program a
# token), in place of post, mixes, Sinkhorn with the collapse, and the norm: faster than those
# four launches at every decode size (benchmarks/research/mhc_sweep.py). 16-token programs up to
# 16 tokens, 64 above.
BATCH_TOKENS = 256
BATCH_TILES = BatchTiles()


# `--deterministic`: every entry, of any token count, is the two-launch batch entry on these tiles
# (its partial mixes are one fixed-shape sum per token; a token's bits then depend on nothing else)
DETERMINISTIC_TILES = BatchTiles(bt=16)


def batch_tiles(tokens: int) -> BatchTiles:
    """The default `BatchTiles` of an entry of `tokens` tokens."""
    return BatchTiles(bt=16) if tokens <= 16 else BATCH_TILES


def entry_tiles(tokens: int, deterministic: bool = False) -> SmallTiles | BatchTiles | MixTiles:
    """The entry path and launch shape `_enter` takes for `tokens` tokens: the one-launch entry up
    to `SMALL_TOKENS`, the batch entry up to `BATCH_TOKENS`, the prefill launches above;
    `deterministic`: `DETERMINISTIC_TILES` for every count."""
    if deterministic:
        return DETERMINISTIC_TILES
    if tokens <= SMALL_TOKENS:
        return SMALL_TILES
    return batch_tiles(tokens) if tokens <= BATCH_TOKENS else MIX_TILES


class EntryScratch:
    """A block's side work of its one-launch entries: `_post_comb_kernel` (post and the Sinkhorn
    comb, a serial chain that a step of one token would wait on) runs on the block's side stream,
    beside the sub-block whose input the entry wrote, from the full mixes in `mixes` [2, 32] fp32 (a buffer
    the block keeps, so no freed allocation is shared between the streams). Only the next entry
    reads post and comb: the block joins `side` before it. Without a side stream (the CPU) the
    kernel runs in order. One per forward call."""

    def __init__(self, mixes: torch.Tensor, side: SideStream | None):
        self.mixes, self.side = mixes, side

    @classmethod
    def beside(cls, mixes: torch.Tensor) -> "EntryScratch":
        """A scratch for `mixes` with a side stream of its own (`SideStream.beside`)."""
        return cls(mixes, SideStream.beside(mixes.device))

    def join(self) -> None:
        """The current stream waits for the side work (`SideStream.join`)."""
        join(self.side)


def mixes_buffer(device: torch.device | str | None = None) -> torch.Tensor:
    """An `EntryScratch.mixes` buffer: the full mixes of up to `SMALL_TOKENS` tokens."""
    return torch.zeros(max(2, SMALL_TOKENS), 32, dtype=torch.float32, device=device)


def settle(res: Residual, impl: str) -> torch.Tensor:
    """The streams [T, hc, D] of `res`, its pending hc_post applied."""
    return res.x if res.out is None else hc_post(res.out, res.x, res.post, res.comb, impl)


def sublayer_input(res: Residual, fn, base, scale, norm_weight, norm_eps: float, hc: int, iters: int,
                   hc_eps: float, rms_eps: float, impl: str, arrivals: torch.Tensor | None = None,
                   tiles: "MixTiles | SmallTiles | BatchTiles | None" = None, scratch: "EntryScratch | None" = None,
                   deterministic: bool = False):
    """Enter a sub-block: → (streams x [T, hc, D] settled, its input rms_norm(collapsed) [T, D],
    post [T, hc] fp32, comb [T, hc, hc] fp32). `arrivals`: a `kernels.arrival_counter` buffer (else
    one is zero-filled per call); `tiles` overrides the launch shape and the kernel (tuning);
    `deterministic`: one path for every T (`entry_tiles`).
    `scratch`: up to `SMALL_TOKENS` tokens, post and comb are computed on its side stream, beside
    the sub-block: the caller joins it (`EntryScratch.join`) before anything reads them."""
    if check_impl(impl) == "torch":
        x = settle(res, impl)
        collapsed, post, comb = reference_pre(x, fn, base, scale, hc, iters, hc_eps, rms_eps)
        return x, rmsnorm.reference(collapsed, norm_weight, norm_eps), post, comb
    return _enter(res, fn, base, scale, hc, iters, hc_eps, rms_eps, False, norm_weight, norm_eps, arrivals,
                  tiles or entry_tiles(res.x.shape[0], deterministic), scratch)


def head_input(res: Residual, fn, base, scale, norm_weight, norm_eps: float, hc_eps: float, rms_eps: float,
               impl: str, arrivals: torch.Tensor | None = None, deterministic: bool = False) -> torch.Tensor:
    """The LM head's input rms_norm(hc_head(streams)) [T, D] (fn [hc, hc·D], scale [1]);
    `deterministic`: one path for every T (`entry_tiles`)."""
    if check_impl(impl) == "torch":
        x = settle(res, impl)
        return rmsnorm.reference(reference_head(x, fn, base, scale, hc_eps, rms_eps), norm_weight, norm_eps)
    return _enter(res, fn, base, scale, res.x.shape[1], 0, hc_eps, rms_eps, True, norm_weight, norm_eps, arrivals,
                  entry_tiles(res.x.shape[0], deterministic))[1]


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
           hc_eps: float, rms_eps: float, impl: str, tiles: "MixTiles | SmallTiles | BatchTiles | None" = None):
    """x [T, hc, D] → (collapsed [T, D] x.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32).
    `tiles` overrides the launch shape and the kernel (tuning)."""
    if check_impl(impl) == "torch":
        return reference_pre(x, fn, base, scale, hc, iters, hc_eps, rms_eps)
    return _enter(Residual(x), fn, base, scale, hc, iters, hc_eps, rms_eps, False, tiles=tiles)[1:]


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            rms_eps: float, impl: str) -> torch.Tensor:
    """x [T, hc, D] → [T, D] (fn [hc, hc·D], scale [1])."""
    if check_impl(impl) == "torch":
        return reference_head(x, fn, base, scale, hc_eps, rms_eps)
    return _enter(Residual(x), fn, base, scale, x.shape[1], 0, hc_eps, rms_eps, True)[1]


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
            ROUND_BF16=x.dtype == torch.bfloat16, num_warps=4, **launch_options(x))
    return new


def _enter(res: Residual, fn, base, scale, hc, iters, hc_eps, rms_eps, head: bool, norm_weight=None,
           norm_eps: float = 0.0, arrivals: torch.Tensor | None = None,
           tiles: "MixTiles | SmallTiles | BatchTiles | None" = None, scratch: "EntryScratch | None" = None):
    """The kernels' sub-block entry → (streams x, collapsed [T, D] (RMSNormed with `norm_weight`
    when given), post, comb): one launch up to `SMALL_TOKENS` tokens, two up to `BATCH_TOKENS`,
    else hc_post (when pending), the mixes, Sinkhorn with the collapse, and the norm (when given)."""
    T, _, D = res.x.shape
    if hc * hc != 16:
        raise ValueError(f"the mHC kernel is written for hc_mult 4, got {hc}")
    dev = res.x.device
    pending = res.out is not None
    xp = res.x.contiguous()
    post = torch.empty(T, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
    out = torch.empty(T, D, dtype=xp.dtype, device=dev)
    if not T:
        return xp, out, post, comb
    fn, base, scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    if isinstance(tiles, SmallTiles) or (T <= SMALL_TOKENS and tiles is None):
        small = tiles or SMALL_TILES
        x, o, postp, combp = _settle_operands(res, xp, post, comb)
        bt, split = max(2, triton.next_power_of_2(T)), triton.cdiv(D, small.columns)
        partial = torch.empty(split, bt, 32, dtype=torch.float32, device=dev)
        # the full mixes for `_post_comb_kernel`: the scratch's buffer when it runs on the side
        # stream (a buffer freed here could be handed to the main stream while it still reads)
        side = scratch is not None and scratch.side is not None
        mix = scratch.mixes if side else torch.empty(bt, 32, dtype=torch.float32, device=dev)
        _entry_small_kernel[(split,)](
            x, xp, o, postp, combp, fn, partial, arrival_counter(dev) if arrivals is None else arrivals, base, scale,
            fn if norm_weight is None else norm_weight, out, mix, T, D, hc_eps, rms_eps, norm_eps,
            HC=hc, BT=bt, CD=small.columns, NR=32, NP=16, BD=triton.next_power_of_2(D),
            SPLIT_PAD=triton.next_power_of_2(split), NORM=norm_weight is not None, num_warps=small.num_warps,
            HEAD=head, POST=pending, ROUND_BF16=xp.dtype == torch.bfloat16, **launch_options(xp))
        if not head:
            with fork(scratch.side if side else None):
                _post_comb_kernel[(1,)](mix, base, scale, post, comb, T, hc * D, iters, hc_eps, rms_eps, HC=hc, BT=bt,
                                        NR=32, NP=16, num_warps=4, **launch_options(mix))
        return x, out, post, comb
    if isinstance(tiles, BatchTiles) or (T <= BATCH_TOKENS and tiles is None):
        return _enter_batch(res, xp, fn, base, scale, post, comb, out, iters, hc_eps, rms_eps, head, norm_weight,
                            norm_eps, tiles or batch_tiles(T))
    x = hc_post(res.out, xp, res.post, res.comb, "triton") if pending else xp
    tiles = tiles or MIX_TILES
    blocks, k_steps = triton.cdiv(T, tiles.bt), triton.cdiv(hc * D, tiles.bk)
    split = tiles.split or 1
    while tiles.split is None and blocks * split * 2 <= 264 and k_steps // (split * 2) >= 4:
        split *= 2  # decode: spread K over programs until ~2 waves of the GPU
    partial = torch.empty(split, T, 3 * 16 + 1, dtype=torch.float32, device=dev)  # mixes | Σx²
    _mix_kernel[(blocks, split)](x, fn, partial, T, D, HC=hc, BT=tiles.bt, BK=tiles.bk, NP=16, SPLIT=split,
                                 HEAD=head, X_FP32=x.dtype == torch.float32, num_warps=tiles.num_warps,
                                 **launch_options(x))
    bt = 16 if T <= 2048 else 32
    # a decode step has a few token blocks: the collapse (the bytes of x) is spread over D
    # chunks, or 4 programs would read all of x at T = 64
    d_split = tiles.collapse_split or max(1, min(264 // triton.cdiv(T, bt), triton.cdiv(D, 256)))
    chunk = triton.cdiv(D, d_split)
    bd = min(256, triton.next_power_of_2(chunk))
    _pre_kernel[(triton.cdiv(T, bt), d_split)](
        x, partial, base, scale, out, post, comb, T, D, triton.cdiv(chunk, bd) * bd, iters, hc_eps, rms_eps,
        HC=hc, BT=bt, NP=16, BD=bd, SPLIT=split, HEAD=head, num_warps=4, **launch_options(x))
    if norm_weight is not None:
        out = rmsnorm.rms_norm(out, norm_weight, norm_eps, "triton")
    return x, out, post, comb


def _enter_batch(res: Residual, xp, fn, base, scale, post, comb, out, iters, hc_eps, rms_eps, head: bool,
                 norm_weight, norm_eps: float, tiles: BatchTiles):
    """`_enter` for a decode batch in two launches: settle and mixes split over token blocks and
    D columns, then a program a token adds the partial mixes and writes the normed collapse,
    post and comb."""
    T, hc, D = xp.shape
    pending = res.out is not None
    x, o, postp, combp = _settle_operands(res, xp, post, comb)
    split = triton.cdiv(D, tiles.columns)
    partial = torch.empty(split, T, 32, dtype=torch.float32, device=xp.device)  # mixes | Σx², per column chunk
    _settle_mix_kernel[(triton.cdiv(T, tiles.bt), split)](
        x, xp, o, postp, combp, fn, partial, T, D, HC=hc, BT=tiles.bt, CD=tiles.columns, NR=32, HEAD=head,
        POST=pending, ROUND_BF16=xp.dtype == torch.bfloat16, X_FP32=xp.dtype == torch.float32,
        num_warps=tiles.num_warps, **launch_options(xp))
    _collapse_kernel[(T,)](
        x, partial, base, scale, fn if norm_weight is None else norm_weight, out, post, comb, T, D, iters, hc_eps,
        rms_eps, norm_eps, HC=hc, NR=32, NP=16, BD=triton.next_power_of_2(D), SPLIT=split,
        SPLIT_PAD=triton.next_power_of_2(split), HEAD=head, NORM=norm_weight is not None, num_warps=4,
        **launch_options(xp))
    return x, out, post, comb


def _settle_operands(res: Residual, xp, post, comb):
    """(the settled streams' buffer, out, post, comb of the pending hc_post) for an entry kernel
    that settles as it reads: a new buffer and res's tensors when hc_post is pending, else xp
    itself and placeholders the kernel does not read."""
    if res.out is None:
        return xp, xp, post, comb
    return torch.empty_like(xp), res.out.contiguous(), res.post.contiguous(), res.comb.contiguous()

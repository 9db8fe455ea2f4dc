"""MoE routing after the gate GEMM: scores, expert choice and routing weights, in one launch.

Semantics (`reference`, impl "torch"), per token t over E experts:
    score = sqrt(softplus(logit)) | sigmoid(logit) | softmax(logit)       (`scoring`)
    ids   = tid2eid[input_ids[t]]  (hash layers)  or  top-k of score + bias  (bias steers selection only)
    w     = score[ids], divided by Σ w + 1e-20 when `norm`, times `scale`
→ weights [T, k] float32, ids [T, k] int64, ids by descending selection score, equal scores by
the lower expert id (`invariant.top_k`'s rule; the kernel's arg-max rounds take the first maximum,
which is the same order). The slot order is part of the result: the normalising sum and the
experts' combine add in it.

Kernel: one program per BT tokens holds their [BT, E] logits in registers and picks the k experts
by k rounds of arg-max (k is 6 at V4 shapes, E = 256: no sort needed). It replaces the eight or
so element-wise, top-k, gather and reduction launches of the torch code, which at batch 1 cost
more in launches than in work.

`gate_route` runs the gate product as well, for steps of up to `TOKENS_PER_PROGRAM` tokens: 128
programs each take two gate rows (fp32 sums of bf16 products), and the last one to arrive routes
from the whole logits, as above. One launch where cuBLAS and the routing would take three a layer at
batch 1 (cuBLAS's split-K GEMV, its reduction, the routing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.config import SCORING_FUNCS as SCORING
from model.kernels import arrival_counter, check_impl
from model.kernels.common import invariant
from model.kernels.common.pdl import launch_options, wait

TOKENS_PER_PROGRAM = 4  # [4, 256] fp32 logits: 8 registers a thread at 4 warps
# `gate_route`: up to TOKENS_PER_PROGRAM tokens the gate product runs inside the routing launch,
# GATE_EXPERTS gate rows a program (128 programs at E = 256, 16 KB of bf16 weights each), the K
# loop unrolled in GATE_BLOCK_D-wide steps so every step's loads are in flight at once
GATE_EXPERTS = 2
GATE_BLOCK_D = 1024


def score(name: str, logits: torch.Tensor) -> torch.Tensor:
    """The gate's score function on logits [..., E] (float32; `invariant`'s activations)."""
    if name == "sqrtsoftplus":
        return invariant.softplus(logits).sqrt()
    if name == "sigmoid":
        return invariant.sigmoid(logits)
    return invariant.softmax(logits, dim=-1)


def reference(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor, k: int, scoring: str, norm: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = score(scoring, logits)
    if tid2eid is not None:
        ids = tid2eid[input_ids].long()
    else:  # descending selection score, equal scores by the lower expert id (`invariant.top_k`)
        ids = invariant.top_k(scores + bias.float(), k)[1]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (invariant.sum(weights, -1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _check(E: int, k: int, scoring: str, bias: torch.Tensor | None, tid2eid: torch.Tensor | None) -> None:
    if scoring not in SCORING:
        raise ValueError(f"scoring function must be one of {SCORING}, got {scoring!r}")
    if (bias is None) == (tid2eid is None):
        raise ValueError("routing needs exactly one of a selection bias (score layers) or a tid2eid table (hash layers)")
    if not 0 < k <= E:
        raise ValueError(f"cannot route to {k} of {E} experts")


def route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None, input_ids: torch.Tensor,
          k: int, scoring: str, norm: bool, scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 (the gate GEMM's output); bias [E] (score layers) or tid2eid [vocab, k]
    (hash layers, then `input_ids` [T] picks the row) → (weights [T, k] float32, ids [T, k] int64)."""
    _check(logits.shape[1], k, scoring, bias, tid2eid)
    if check_impl(impl) == "torch":
        return reference(logits, bias, tid2eid, input_ids, k, scoring, norm, scale)
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    hashed = tid2eid is not None
    table = tid2eid if hashed else bias
    _route_kernel[(triton.cdiv(T, TOKENS_PER_PROGRAM),)](
        logits.contiguous(), table, input_ids, weights, ids, T, E, float(scale),
        K=k, KP=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(E), BT=TOKENS_PER_PROGRAM,
        SCORING=scoring, HASHED=hashed, NORM=norm, num_warps=4, **launch_options(logits))
    return weights, ids


def gate_route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
               input_ids: torch.Tensor, k: int, scoring: str, norm: bool, scale: float,
               arrivals: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the gate's logits x [T, D] · gate [E, D]ᵀ (fp32 sums) for up to
    `TOKENS_PER_PROGRAM` tokens, in one launch (the kernels' path of a decode step of a few
    tokens: the gate product alone would be a split-K cuBLAS GEMV and its reduction, two launches
    before the routing). `arrivals`: a `kernels.arrival_counter` buffer, used by one call at a time
    (calls in stream order), else a zeroed one per call."""
    T, D = x.shape
    E = gate.shape[0]
    if T > TOKENS_PER_PROGRAM:
        raise ValueError(f"gate_route takes up to {TOKENS_PER_PROGRAM} tokens, got {T}")
    _check(E, k, scoring, bias, tid2eid)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, ids
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    hashed = tid2eid is not None
    _gate_route_kernel[(triton.cdiv(E, GATE_EXPERTS),)](
        x.contiguous(), gate.contiguous(), logits, arrival_counter(x.device) if arrivals is None else arrivals,
        tid2eid if hashed else bias, input_ids, weights, ids, T, E, float(scale), D=D,
        K=k, KP=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(E), BT=TOKENS_PER_PROGRAM,
        BE=GATE_EXPERTS, BD=min(GATE_BLOCK_D, triton.next_power_of_2(D)), SCORING=scoring, HASHED=hashed, NORM=norm,
        num_warps=4, **launch_options(x))
    return weights, ids


@triton.jit
def _route_kernel(logit_ptr, table_ptr, tok_ptr, w_ptr, id_ptr, T, E, scale,
                  K: tl.constexpr, KP: tl.constexpr, E_PAD: tl.constexpr, BT: tl.constexpr,
                  SCORING: tl.constexpr, HASHED: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    x = tl.load(logit_ptr + rows[:, None] * E + cols[None, :], mask=(rows < T)[:, None] & (cols < E)[None, :],
                other=0.0)
    _route_rows(x, rows, T, E, table_ptr, tok_ptr, w_ptr, id_ptr, scale, K, KP, E_PAD, BT, SCORING, HASHED, NORM)


@triton.jit
def _gate_route_kernel(x_ptr, g_ptr, logit_ptr, cnt_ptr, table_ptr, tok_ptr, w_ptr, id_ptr, T, E, scale,
                       D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E_PAD: tl.constexpr, BT: tl.constexpr,
                       BE: tl.constexpr, BD: tl.constexpr, SCORING: tl.constexpr, HASHED: tl.constexpr,
                       NORM: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: logits [T, BE] of gate rows [p·BE, (p+1)·BE) for all T ≤ BT tokens (products on
    the CUDA cores: a few tokens would be mostly padding in a 16-row MMA) into logit_ptr [T, E];
    the last program to arrive (the counter, set back to zero by it) routes every token from the
    whole [T, E] logits in registers."""
    wait(PDL)
    t = tl.arange(0, BT)
    tmask = t < T
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    emask = e < E
    acc = tl.zeros((BT, BE), tl.float32)
    for d0 in tl.static_range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dmask = d < D
        xv = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
        gv = tl.load(g_ptr + e[:, None] * D + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(xv.to(tl.float32)[:, None, :] * gv.to(tl.float32)[None, :, :], axis=2)
    tl.store(logit_ptr + t[:, None] * E + e[None, :], acc, mask=tmask[:, None] & emask[None, :], cache_modifier=".cg")
    tl.debug_barrier()  # every thread's stores before the release below
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") != tl.num_programs(0) - 1:
        return
    tl.debug_barrier()
    tl.store(cnt_ptr, 0)
    cols = tl.arange(0, E_PAD)
    x = tl.load(logit_ptr + t[:, None] * E + cols[None, :], mask=tmask[:, None] & (cols < E)[None, :], other=0.0,
                cache_modifier=".cg")
    _route_rows(x, t, T, E, table_ptr, tok_ptr, w_ptr, id_ptr, scale, K, KP, E_PAD, BT, SCORING, HASHED, NORM)


@triton.jit
def _route_rows(x, rows, T, E, table_ptr, tok_ptr, w_ptr, id_ptr, scale, K: tl.constexpr, KP: tl.constexpr,
                E_PAD: tl.constexpr, BT: tl.constexpr, SCORING: tl.constexpr, HASHED: tl.constexpr,
                NORM: tl.constexpr):
    """Scores, choice and weights of the tokens `rows` [BT] from their logits x [BT, E_PAD] (rows
    at or past T and columns at or past E are masked)."""
    rmask = rows < T
    cols = tl.arange(0, E_PAD)
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    if SCORING == "sqrtsoftplus":  # sqrt(softplus): max(x, 0) + log1p(e^-|x|), linear above 20 as torch's
        y = tl.exp(-tl.abs(x))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))  # log1p from log (Goldberg)
        s = tl.sqrt(tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p))
    elif SCORING == "sigmoid":
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        xs = tl.where(cmask[None, :], x, float("-inf"))  # rows past T hold zeros: finite maxima
        e = tl.exp(xs - tl.max(xs, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    slot = tl.arange(0, KP)
    ids = tl.zeros((BT, KP), tl.int32)
    w = tl.zeros((BT, KP), tl.float32)
    if HASHED:
        tok = tl.load(tok_ptr + rows, mask=rmask, other=0)
        ids = tl.load(table_ptr + tok[:, None] * K + slot[None, :], mask=rmask[:, None] & (slot < K)[None, :],
                      other=0).to(tl.int32)
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(slot[None, :] == j, ids, 0), axis=1)
            w_j = tl.sum(tl.where(cols[None, :] == e_j[:, None], s, 0.0), axis=1)
            w = tl.where(slot[None, :] == j, w_j[:, None], w)
    else:
        sel = tl.where(mask, s + tl.load(table_ptr + cols, mask=cmask, other=0.0)[None, :], float("-inf"))
        for j in tl.static_range(K):
            e_j = tl.argmax(sel, axis=1).to(tl.int32)
            hit = cols[None, :] == e_j[:, None]
            w_j = tl.sum(tl.where(hit, s, 0.0), axis=1)
            sel = tl.where(hit, float("-inf"), sel)
            ids = tl.where(slot[None, :] == j, e_j[:, None], ids)
            w = tl.where(slot[None, :] == j, w_j[:, None], w)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    omask = rmask[:, None] & (slot < K)[None, :]
    tl.store(w_ptr + rows[:, None] * K + slot[None, :], w * scale, mask=omask)
    tl.store(id_ptr + rows[:, None] * K + slot[None, :], ids.to(tl.int64), mask=omask)

"""MoE routing after the gate GEMM: scores, expert choice and routing weights, in one launch.

Semantics (`reference`, impl "torch"), per token t over E experts:
    score = sqrt(softplus(logit)) | sigmoid(logit) | softmax(logit)       (`scoring`)
    ids   = tid2eid[input_ids[t]]  (hash layers)  or  top-k of score + bias  (bias steers selection only)
    w     = score[ids], divided by Σ w + 1e-20 when `norm`, times `scale`
→ weights [T, k] float32, ids [T, k] int64. The order of ids within a row is unspecified (torch's
unsorted top-k; the kernel gives descending selection scores).

Kernel: one program per BT tokens holds their [BT, E] logits in registers and picks the k experts
by k rounds of arg-max (k is 6 at V4 shapes, E = 256: no sort needed). It replaces the eight or
so element-wise, top-k, gather and reduction launches of the torch code; on H100 it takes 3.9 µs
a layer at batch 1 (`docs/results/profile_decode_B1_h100_v10.txt`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from model.config import SCORING_FUNCS as SCORING
from model.kernels import check_impl

TOKENS_PER_PROGRAM = 4  # [4, 256] fp32 logits: 8 registers a thread at 4 warps


def score(name: str, logits: torch.Tensor) -> torch.Tensor:
    """The gate's score function on logits [..., E] (float32)."""
    if name == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if name == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def reference(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor, k: int, scoring: str, norm: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = score(scoring, logits)
    if tid2eid is not None:
        ids = tid2eid[input_ids].long()
    else:
        ids = (scores + bias.float()).topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None, input_ids: torch.Tensor,
          k: int, scoring: str, norm: bool, scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 (the gate GEMM's output); bias [E] (score layers) or tid2eid [vocab, k]
    (hash layers, then `input_ids` [T] picks the row) → (weights [T, k] float32, ids [T, k] int64)."""
    if scoring not in SCORING:
        raise ValueError(f"scoring function must be one of {SCORING}, got {scoring!r}")
    if (bias is None) == (tid2eid is None):
        raise ValueError("routing needs exactly one of a selection bias (score layers) or a tid2eid table (hash layers)")
    if check_impl(impl) == "torch":
        return reference(logits, bias, tid2eid, input_ids, k, scoring, norm, scale)
    T, E = logits.shape
    if not 0 < k <= E:
        raise ValueError(f"cannot route to {k} of {E} experts")
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    hashed = tid2eid is not None
    table = tid2eid if hashed else bias
    _route_kernel[(triton.cdiv(T, TOKENS_PER_PROGRAM),)](
        logits.contiguous(), table, input_ids, weights, ids, T, E, float(scale),
        K=k, KP=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(E), BT=TOKENS_PER_PROGRAM,
        SCORING=scoring, HASHED=hashed, NORM=norm, num_warps=4)
    return weights, ids


@triton.jit
def _route_kernel(logit_ptr, table_ptr, tok_ptr, w_ptr, id_ptr, T, E, scale,
                  K: tl.constexpr, KP: tl.constexpr, E_PAD: tl.constexpr, BT: tl.constexpr,
                  SCORING: tl.constexpr, HASHED: tl.constexpr, NORM: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    cols = tl.arange(0, E_PAD)
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(logit_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0)
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

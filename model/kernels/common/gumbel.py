"""Gumbel-max draw over each row's support: the noisy argmax that sampling ends in.

    token[r] = argmax over kept t of  scaled[r, t] + g(key[r], t),   g = -log(-log(u)),

u a uniform from an exact 32-bit hash of (key words, token id), so a token's noise is the same on
every device and in every batch. The support is given as a threshold in the ranking by (value
descending, id ascending): token t is kept iff (scaled[t], -t) ≥ (thr_value, -thr_id), which is
how a top-k / top-p prefix of a stable sort reads without the sort's permutation.

The reference is ~35 elementwise passes over [R, V] (the hash alone is 20 int64 ops); the kernel
is one pass that reads the fp32 logits once. Both compute the same fp64 score in the same order
of operations, and both break ties towards the lowest id.

`draw` is the whole draw of rows without top-k or top-p (temperature, min_p, greedy rows) in one
launch over the raw logits, where the unfused draw takes a cast, a division, two reductions over
the vocabulary and a select: the draws of a speculative step (three drafts and the verify's) and
of a plain decode step are latency-bound launches of one to a few rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import check_impl
from model.kernels.common.pdl import launch_options, wait

MASK32 = 0xFFFFFFFF
BLOCK = 4096  # tokens per program; a row's programs are reduced in torch


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2³² for 0 ≤ x < 2³², in 16-bit halves so no int64 product overflows."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons), a 32-bit integer finaliser, on int64 tensors holding 0 ≤ x < 2³²."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 [R, N] for token ids `tokens` [R, N] of rows keyed by `keys` [R, 3] (int64
    holding 32-bit words); 52 random bits, strictly inside (0, 1)."""
    k0, k1, k2 = (keys[:, i, None] for i in range(3))
    a = hash32(hash32(tokens ^ k0) ^ k1)
    b = hash32(a ^ k2)
    return ((a >> 6) * 67108864 + (b >> 6)).double().add_(0.5).mul_(2.0 ** -52)


def kept(scaled: torch.Tensor, thr_value: torch.Tensor, thr_id: torch.Tensor) -> torch.Tensor:
    """Bool [R, V]: (scaled[r, t], -t) ≥ (thr_value[r], -thr_id[r])."""
    ids = torch.arange(scaled.shape[-1], device=scaled.device)
    return (scaled > thr_value[:, None]) | ((scaled == thr_value[:, None]) & (ids <= thr_id[:, None]))


def reference(scaled: torch.Tensor, keys: torch.Tensor, thr_value: torch.Tensor, thr_id: torch.Tensor):
    R, V = scaled.shape
    u = uniform_noise(keys, torch.arange(V, device=scaled.device).expand(R, V))
    score = scaled.double() + -torch.log(-torch.log(u))
    return score.masked_fill_(~kept(scaled, thr_value, thr_id), float("-inf")).argmax(-1)


def gumbel_argmax(scaled: torch.Tensor, keys: torch.Tensor, thr_value: torch.Tensor, thr_id: torch.Tensor,
                  impl: str) -> torch.Tensor:
    """scaled [R, V] fp32 (temperature applied), keys [R, 3] int64, thr_value [R] fp32,
    thr_id [R] int64 → token ids [R] int64. Every row must keep at least one token."""
    if check_impl(impl) == "torch":
        return reference(scaled, keys, thr_value, thr_id)
    R, V = scaled.shape
    scaled = scaled.contiguous()
    chunks = triton.cdiv(V, BLOCK)
    best = torch.empty(R, chunks, dtype=torch.float64, device=scaled.device)
    best_id = torch.empty(R, chunks, dtype=torch.int64, device=scaled.device)
    _gumbel_argmax_kernel[(R, chunks)](scaled, keys.contiguous(), thr_value.contiguous(), thr_id.contiguous(),
                                        best, best_id, V, chunks, BLOCK=BLOCK, num_warps=8,
                                        **launch_options(scaled))
    return _first_best(best, best_id)


def _first_best(best: torch.Tensor, best_id: torch.Tensor) -> torch.Tensor:
    """Each row's id of its best chunk [R, chunks] → [R]: the first maximum over the chunks, so the
    lowest id among equal scores, as argmax over [V] gives."""
    return best_id.gather(1, best.argmax(1, keepdim=True)).squeeze(1)


def draw_reference(logits: torch.Tensor, temperature: torch.Tensor, log_min_p: torch.Tensor, greedy: torch.Tensor,
                   keys: torch.Tensor) -> torch.Tensor:
    """`draw`'s semantics: a greedy row takes its logits' first maximum; another draws Gumbel-max
    from logits / temperature over the tokens whose scaled logit is at least the row's largest +
    log_min_p (min_p's support; -inf keeps every token)."""
    scaled = logits.float() / temperature[:, None]
    thr_id = torch.full_like(greedy, logits.shape[-1], dtype=torch.int64)
    drawn = reference(scaled, keys, scaled.amax(-1) + log_min_p, thr_id)
    return torch.where(greedy, logits.argmax(-1), drawn)


def draw(logits: torch.Tensor, temperature: torch.Tensor, log_min_p: torch.Tensor, greedy: torch.Tensor,
         keys: torch.Tensor, impl: str) -> torch.Tensor:
    """logits [R, V] (bf16 or fp32), temperature [R] fp32 (1 on greedy rows), log_min_p [R] fp32,
    greedy [R] bool, keys [R, 3] int64 (rows may be strided) → token ids [R] int64, as
    `draw_reference`. The kernel reads each logit once, and a min_p row once more for its maximum."""
    if check_impl(impl) == "torch":
        return draw_reference(logits, temperature, log_min_p, greedy, keys)
    R, V = logits.shape
    if logits.stride(-1) != 1 or keys.stride(-1) != 1:
        raise ValueError("gumbel.draw needs logits and keys with unit stride along their last dimension")
    chunks = triton.cdiv(V, BLOCK)
    best = torch.empty(R, chunks, dtype=torch.float64, device=logits.device)
    best_id = torch.empty(R, chunks, dtype=torch.int64, device=logits.device)
    _draw_kernel[(R, chunks)](logits, temperature, log_min_p, greedy, keys, best, best_id, V, chunks,
                              logits.stride(0), keys.stride(0), BLOCK=BLOCK, num_warps=8,
                              **launch_options(logits))
    return _first_best(best, best_id)


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_noise(keys_ptr, ids):
    """g = -log(-log(u)) float64 for token ids `ids` of the row whose keys start at `keys_ptr`
    (`uniform_noise`'s u, exact)."""
    k0 = tl.load(keys_ptr).to(tl.uint32)
    k1 = tl.load(keys_ptr + 1).to(tl.uint32)
    k2 = tl.load(keys_ptr + 2).to(tl.uint32)
    a = _hash32(_hash32(ids.to(tl.uint32) ^ k0) ^ k1)
    b = _hash32(a ^ k2)
    u = ((a >> 6).to(tl.float64) * 67108864.0 + (b >> 6).to(tl.float64) + 0.5) * (2.0 ** -52)
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_argmax_kernel(scaled_ptr, keys_ptr, thr_value_ptr, thr_id_ptr, best_ptr, best_id_ptr, V, chunks,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = ids < V
    s = tl.load(scaled_ptr + row * V + ids, mask=inside, other=float("-inf"))
    thr_value = tl.load(thr_value_ptr + row)
    thr_id = tl.load(thr_id_ptr + row)
    score = s.to(tl.float64) + _gumbel_noise(keys_ptr + row * 3, ids)
    keep = inside & ((s > thr_value) | ((s == thr_value) & (ids <= thr_id)))
    score = tl.where(keep, score, float("-inf"))
    pick = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(best_ptr + row * chunks + chunk, tl.max(score, axis=0))
    tl.store(best_id_ptr + row * chunks + chunk, chunk * BLOCK + pick)


@triton.jit
def _draw_kernel(logits_ptr, temperature_ptr, log_min_p_ptr, greedy_ptr, keys_ptr, best_ptr, best_id_ptr, V, chunks,
                 stride_logits, stride_keys, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One (row, BLOCK tokens) program of `draw`: the chunk's best score and its first id."""
    wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = ids < V
    row_logits = logits_ptr + row * stride_logits
    t = tl.load(temperature_ptr + row)
    # IEEE division, as torch divides (Triton's `/` on fp32 is the approximate one)
    s = tl.math.div_rn(tl.load(row_logits + ids, mask=inside, other=float("-inf")).to(tl.float32), t)
    log_min_p = tl.load(log_min_p_ptr + row)
    thr = log_min_p  # -inf: every token kept
    if log_min_p > float("-inf"):  # min_p's floor needs the row's largest scaled logit
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for lo in range(0, V, BLOCK):
            at = lo + tl.arange(0, BLOCK)
            x = tl.load(row_logits + at, mask=at < V, other=float("-inf")).to(tl.float32)
            top = tl.maximum(top, tl.math.div_rn(x, t))
        thr = tl.max(top, axis=0) + log_min_p
    greedy = tl.load(greedy_ptr + row) != 0
    s64 = s.to(tl.float64)
    # a greedy row's temperature is 1, so its s is its logit: the argmax of s is the logits' argmax
    score = tl.where(greedy, s64, s64 + _gumbel_noise(keys_ptr + row * stride_keys, ids))
    keep = inside & (greedy | (s >= thr))
    score = tl.where(keep, score, float("-inf"))
    pick = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(best_ptr + row * chunks + chunk, tl.max(score, axis=0))
    tl.store(best_id_ptr + row * chunks + chunk, chunk * BLOCK + pick)

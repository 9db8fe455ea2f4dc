"""Sinkhorn-Knopp of mHC's per-token 4×4 comb matrices, in registers (kernels/mhc/mhc_kernels.py's
entries and Sinkhorn launches): each of the 16 entries is a [BT] vector of its own, so every step
of the chain is elementwise."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def entry(m, cols, k: tl.constexpr):
    """Column k of m [BT, 16] as a [BT] vector."""
    return tl.sum(tl.where(cols[None, :] == k, m, 0.0), axis=1)


@triton.jit
def _softmax4(a, b, c, d, eps):
    top = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - top), tl.exp(b - top), tl.exp(c - top), tl.exp(d - top)
    r = 1.0 / (a + b + c + d)
    return a * r + eps, b * r + eps, c * r + eps, d * r + eps


@triton.jit
def _normalize4(a, b, c, d, eps):
    # one reciprocal and four products, not four divisions: a division is a MUFU instruction, of
    # which an sm_90 SM partition issues one a warp every 8 cycles, and the Sinkhorn chain is the
    # serial tail of a decode step's entry (benchmarks/research/mhc_entry_parts.py)
    r = 1.0 / (a + b + c + d + eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def sinkhorn(logit, cols, iters, eps):
    """logit [BT, 16] (4×4 row-major per token) → softmax over each row, + eps, then Sinkhorn-Knopp
    (columns first, then rows / columns alternately, `iters` column normalisations in all).

    The 16 entries are held as 16 [BT] vectors, so every step is elementwise in registers: on a
    [BT, 4, 4] tensor each of the 40 sums of the chain would be a shuffle between threads, and
    the chain is the longest serial stretch of a decode step's mHC entry."""
    c00, c01, c02, c03 = _softmax4(entry(logit, cols, 0), entry(logit, cols, 1), entry(logit, cols, 2),
                                   entry(logit, cols, 3), eps)
    c10, c11, c12, c13 = _softmax4(entry(logit, cols, 4), entry(logit, cols, 5), entry(logit, cols, 6),
                                   entry(logit, cols, 7), eps)
    c20, c21, c22, c23 = _softmax4(entry(logit, cols, 8), entry(logit, cols, 9), entry(logit, cols, 10),
                                   entry(logit, cols, 11), eps)
    c30, c31, c32, c33 = _softmax4(entry(logit, cols, 12), entry(logit, cols, 13), entry(logit, cols, 14),
                                   entry(logit, cols, 15), eps)
    c00, c10, c20, c30 = _normalize4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _normalize4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _normalize4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _normalize4(c03, c13, c23, c33, eps)
    for _ in range(iters - 1):
        c00, c01, c02, c03 = _normalize4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _normalize4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _normalize4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _normalize4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _normalize4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _normalize4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _normalize4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _normalize4(c03, c13, c23, c33, eps)
    out = _place4(logit * 0.0, cols, 0, c00, c01, c02, c03)
    out = _place4(out, cols, 4, c10, c11, c12, c13)
    out = _place4(out, cols, 8, c20, c21, c22, c23)
    return _place4(out, cols, 12, c30, c31, c32, c33)


@triton.jit
def _place4(m, cols, k0: tl.constexpr, a, b, c, d):
    """m [BT, 16] with columns k0 .. k0+3 set to the [BT] vectors a, b, c, d."""
    m = tl.where(cols[None, :] == k0, a[:, None], m)
    m = tl.where(cols[None, :] == k0 + 1, b[:, None], m)
    m = tl.where(cols[None, :] == k0 + 2, c[:, None], m)
    return tl.where(cols[None, :] == k0 + 3, d[:, None], m)

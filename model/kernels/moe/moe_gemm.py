"""One expert tile's matrix product W · Xᵀ with the weights dequantised in registers (FP4 or FP8).

`w_xt` runs the K loop for one expert and up to two weight-row sets (gate and up rows share the
activation tile), for the kernels of kernels/moe/moe_grouped.py. Two orientations:

* SWAP (decode): weight rows are the MMA's M side (64 per warpgroup) and the BT >= 16 tokens its
  N side, so a tile of a few tokens still runs wgmma with the weights as the register operand;
  the activations are permuted into `fp4.mma_order` so each thread's fragment is one 32-bit word.
* not SWAP: tokens are the M side; activation tiles go from global to shared memory to the
  tensor cores untouched, and the dequantised weight tile is written to shared memory as the
  B operand, its cost shared by BT (128) tokens.
* SWAP with XPRE (FP4 prefill, kernels/moe/moe_prefill.py): the activations were laid out in
  `preorder`'s order beforehand, so their tiles go from global to shared memory untouched (no
  register permutation per step) while the weights stay the register operand.

FP4 weights and scales are K-blocked (kernels/moe/packed_experts.py's `PackedExperts`): a step's tile of BN rows is
one contiguous read (`_k_step`).

Scales are fetched one K step ahead in registers (`_scales`; FP4's already made bf16 factors,
`fp4.fp4_scale_factor`): a global load consumed in its own step stalls the warp. (Loading gate
and up scales as one tile through the pipeliner's asynchronous copies is no faster.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels.common.fp4 import FP8_BLOCK, fp4_scale_factor, fp4_to_bf16, fp8_to_bf16, mma_order, mma_order_pairs

B8 = tl.constexpr(FP8_BLOCK)  # kernels may only read constexpr globals


@triton.jit
def _k_step(rows, i, R: tl.constexpr, B: tl.constexpr, N: tl.constexpr):
    """Offsets [BN, N] of K step i's N bytes of `rows` in a K-blocked matrix of R rows and B bytes per
    row and block (kernels/moe/packed_experts.py's `PackedExperts`); N divides B, so a step stays in one block.
    Written from the step index: the same offsets from the byte offset j (`(j // B)·R·B + j % B`)
    hide from Triton's alignment analysis that the remainder is a multiple of N, and the weight
    tile then stops going through asynchronous copies."""
    per_block: tl.constexpr = B // N
    return (i // per_block) * (R * B) + (i % per_block) * N + rows[:, None] * B + tl.arange(0, N)[None, :]


@triton.jit
def _scales(s_ptr, rows, srows, k0, s_stride, FP4: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
            BK: tl.constexpr):
    """The scales a K step at k0 needs: FP4 [BN, BK/32] bf16 factors (`fp4_scale_factor`, per row and
    32 K), FP8 [BN] bytes (per row's block)."""
    if FP4:
        s = fp4_scale_factor(tl.load(s_ptr + _k_step(rows, k0 // BK, R, KB // 16, BK // 32)))
    else:
        s = tl.load(s_ptr + srows * s_stride + k0 // 128)
    return s


@triton.jit
def _operands(w_ptr, s, rows, k0, w_stride, FP4: tl.constexpr, SWAP: tl.constexpr,
              ASM: tl.constexpr, MMA: tl.constexpr, R: tl.constexpr, KB: tl.constexpr, BK: tl.constexpr):
    """W[rows, k0:k0+BK] as MMA operand(s), scales `s` from `_scales`: FP4 SWAP → (even, odd) K in
    `mma_order`; FP4 → (bf16 tile, same); FP8 → (bf16 tile, same) (SWAP: `mma_order`). MMA: the
    SWAP tile is a wgmma register operand (kernels/common/fp4.py's `fp4_to_bf16`)."""
    if FP4:
        w = tl.load(w_ptr + _k_step(rows, k0 // BK, R, KB, BK // 2))
        if SWAP:
            a, b = fp4_to_bf16(mma_order(w), s, ASM, MMA)
        else:
            even, odd = fp4_to_bf16(w, s, ASM, False)
            a = tl.reshape(tl.join(even, odd), [w.shape[0], BK])
            b = a
    else:
        w = tl.load(w_ptr + rows[:, None] * w_stride + (k0 + tl.arange(0, BK))[None, :])
        if SWAP:
            w = mma_order(w)
        a = fp8_to_bf16(w, s, ASM)
        b = a
    return a, b


@triton.jit
def _accumulate(acc, a, b, xt, x_even, x_odd, FP4: tl.constexpr, SWAP: tl.constexpr):
    """acc += W · xᵀ for W's `_operands` (a, b). SWAP: acc [BN, BT], x in `mma_order` (x_even/x_odd
    for FP4, xt for FP8); else acc [BT, BN], xt natural."""
    if FP4 and SWAP:
        acc = tl.dot(a, tl.trans(x_even), acc)
        acc = tl.dot(b, tl.trans(x_odd), acc)
    elif SWAP:
        acc = tl.dot(a, tl.trans(xt), acc)
    else:
        acc = tl.dot(xt, tl.trans(a), acc)
    return acc


@triton.jit
def _settled(acc):
    """acc, passed through an opaque move: reading it makes the compiler wait for every product
    pending on it (wgmma.wait_group 0) at this point. Pipelined, Triton 3.6 lets the next K step
    start while the step's last register-operand products are in flight, and their A registers
    can be overwritten under them (triton-lang/triton#9433); waiting here
    keeps the deeper pipeline of weight loads and gives up only the products' overlap with the
    next step's conversion."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def w_xt(x_ptr, x_rows, x_mask, w_ptr, s_ptr, rows_a, srows_a, rows_b, srows_b,
          K: tl.constexpr, FP4: tl.constexpr, TWO: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, MMA: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, XPRE: tl.constexpr = False,
          R: tl.constexpr = 0, KB: tl.constexpr = 0, KS: tl.constexpr = 1, ks=0, SETTLE: tl.constexpr = False):
    """(W[rows_a] · Xᵀ, W[rows_b] · Xᵀ) [BN, BT] fp32 over K for one expert's W (its FP8 scale rows
    `srows_*`; FP4 scales are per weight row); X rows `x_rows` (stride K, masked by x_mask), in
    `preorder`'s layout with XPRE (FP4 and SWAP only). Only the first product when not TWO.
    FP4: W is K-blocked, R rows and KB code bytes per row and block (BK/2 divides KB).
    KS > 1: only the ks-th of KS equal K ranges (KS·BK divides K), a partial sum.
    SETTLE (wgmma register operand only): each K step's products finish before the next step
    converts its weights (`_settled`)."""
    w_stride: tl.constexpr = K  # FP8
    s_stride: tl.constexpr = (K + B8 - 1) // B8
    if SWAP:
        acc_a = tl.zeros([BN, BT], dtype=tl.float32)
        acc_b = tl.zeros([BN, BT], dtype=tl.float32)
    else:
        acc_a = tl.zeros([BT, BN], dtype=tl.float32)
        acc_b = tl.zeros([BT, BN], dtype=tl.float32)
    k_lo = 0  # a compile-time 0 and K without a split: the loop the pipeliner sees is unchanged
    k_hi = K
    if KS > 1:
        k_lo = ks * (K // KS)
        k_hi = k_lo + K // KS
    sa = _scales(s_ptr, rows_a, srows_a, k_lo, s_stride, FP4, R, KB, BK)
    sb = sa
    if TWO:
        sb = _scales(s_ptr, rows_b, srows_b, k_lo, s_stride, FP4, R, KB, BK)
    for k0 in range(k_lo, k_hi, BK):
        k_next = tl.minimum(k0 + BK, k_hi - BK)
        sa_next = _scales(s_ptr, rows_a, srows_a, k_next, s_stride, FP4, R, KB, BK)
        sb_next = sa_next
        if TWO:
            sb_next = _scales(s_ptr, rows_b, srows_b, k_next, s_stride, FP4, R, KB, BK)
        if XPRE:  # even K in the row's first half, odd K in its second, each in mma_order
            xe = x_ptr + x_rows[:, None] * K + (k0 // 2 + tl.arange(0, BK // 2))[None, :]
            x_even = tl.load(xe, mask=x_mask[:, None], other=0.0).to(tl.bfloat16)
            x_odd = tl.load(xe + K // 2, mask=x_mask[:, None], other=0.0).to(tl.bfloat16)
            xt = x_even
        else:
            xt = tl.load(x_ptr + x_rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :],
                         mask=x_mask[:, None], other=0.0).to(tl.bfloat16)
            x_even, x_odd = xt, xt
        if SWAP and not XPRE:
            if FP4:
                x_even, x_odd = mma_order_pairs(xt)
            else:
                xt = mma_order(xt)
        # both weight sets dequantised before either product: the tensor cores then get the two
        # back to back, one wait per step instead of two
        a1, a2 = _operands(w_ptr, sa, rows_a, k0, w_stride, FP4, SWAP, ASM, MMA, R, KB, BK)
        b1, b2 = a1, a2
        if TWO:
            b1, b2 = _operands(w_ptr, sb, rows_b, k0, w_stride, FP4, SWAP, ASM, MMA, R, KB, BK)
        acc_a = _accumulate(acc_a, a1, a2, xt, x_even, x_odd, FP4, SWAP)
        if TWO:
            acc_b = _accumulate(acc_b, b1, b2, xt, x_even, x_odd, FP4, SWAP)
        if SETTLE and MMA:
            acc_a = _settled(acc_a)
            if TWO:
                acc_b = _settled(acc_b)
        sa, sb = sa_next, sb_next
    if not SWAP:
        acc_a, acc_b = tl.trans(acc_a), tl.trans(acc_b)
    return acc_a, acc_b

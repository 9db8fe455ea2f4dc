"""In-kernel dequantisation of the expert weight codecs of `model/quant.py`, as `@triton.jit` helpers.

* FP4 e2m1, two codes per byte (low nibble = even K index), UE8M0 scale byte per 32 along K.
  The bf16 value is built from bits, with no lookup table and no float arithmetic: for a code
  of magnitude m = code & 7 (value 0, 0.5, 1, 1.5, 2, 3, 4, 6) and scale byte s (scale 2^(s-127)),

      bits = (m << 6) + ((s - 1) << 7)          for m >= 2
      bits = (s - 1) << 7                       for m == 1   (0.5 · 2^(s-127))
      bits = 0                                  for m == 0
      bits |= (code & 8) << 12                  (the sign)

  `m << 6` puts e2m1's two exponent bits into bf16's exponent field and its mantissa bit at the
  top of bf16's mantissa; adding `(s - 1) << 7` rebiases the exponent (e2m1 bias 1, bf16 bias
  127) and applies the scale in the same add. Every product code × scale is exact in bf16 for
  scale bytes 2..253 (scales 2^-125..2^126; real weights use about 2^-10..2^-4). Integer ops only,
  so the Triton interpreter (which multiplies bf16 as raw bits) computes the same values.
* FP8 e4m3 with a UE8M0 scale per 128×128 block: the caller gathers one scale per weight row of
  the current 128-wide K block; `fp8_rows_to_bf16` widens and scales in fp32 (exact) and narrows
  to bf16 (exact: e4m3 has 3 mantissa bits).

`fp4_to_bf16` returns the even and the odd K elements as two tiles rather than interleaving them:
the caller multiplies them with the even and odd columns of the activations (two dots of K/2),
which costs a split of the small activation tile instead of a shuffle of the large weight tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP4_GROUP = 32  # K elements per UE8M0 scale
FP8_BLOCK = 128  # rows and K elements per FP8 weight scale
FP8_BLOCK_C = tl.constexpr(FP8_BLOCK)  # the same, for use inside kernels (globals there must be constexpr)


@triton.jit
def _e2m1_scaled_bits(code, bias):
    """code: e2m1 codes (uint16, 0..15); bias: (s - 1) << 7 broadcastable → bf16 bits (uint16)."""
    mag = code & 7
    bits = (mag << 6) + bias
    bits = tl.where(mag == 1, bits - 64, bits)
    bits = tl.where(mag == 0, 0, bits)
    return bits | ((code & 8) << 12)


@triton.jit
def fp4_to_bf16(packed, scale):
    """packed uint8 [R, C] (K elements 2j, 2j+1 in byte j), scale uint8 [R, C // 16]
    → (even, odd): bf16 [R, C] holding K elements 2j and 2j+1 times their row's scale."""
    R: tl.constexpr = packed.shape[0]
    C: tl.constexpr = packed.shape[1]
    p = tl.reshape(packed.to(tl.uint16), [R, C // 16, 16])  # 16 bytes = one 32-element scale group
    bias = ((scale.to(tl.uint16) - 1) << 7)[:, :, None]
    lo = _e2m1_scaled_bits(p & 15, bias)
    hi = _e2m1_scaled_bits(p >> 4, bias)
    even = tl.reshape(lo, [R, C]).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    odd = tl.reshape(hi, [R, C]).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return even, odd


@triton.jit
def ue8m0_to_f32(byte):
    """UE8M0 scale byte(s) → float32 2^(byte-127) (byte 0, 2^-127, reads as 0: never a real scale)."""
    return (byte.to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_rows_to_bf16(q, row_scale):
    """q e4m3 [R, C], row_scale uint8 [R] (UE8M0 of each row's current 128×128 block) → bf16 [R, C]."""
    return (q.to(tl.float32) * ue8m0_to_f32(row_scale)[:, None]).to(tl.bfloat16)


def check_fp4_block(block_k: int) -> None:
    """Host-side check of a K tile for FP4 weights: whole scale groups, and K/2 >= 16 for tl.dot."""
    if block_k % FP4_GROUP or block_k < FP4_GROUP:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of {FP4_GROUP} (one UE8M0 scale per 32 K) for FP4")


def check_fp8_block(block_k: int) -> None:
    if FP8_BLOCK % block_k or block_k < 16:
        raise ValueError(f"BLOCK_K={block_k} must divide {FP8_BLOCK} (one scale per 128 K) and be >= 16 for FP8")


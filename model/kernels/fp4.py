"""In-kernel dequantisation of the expert weight codecs of `model/quant.py`, as `@triton.jit` helpers.

FP4 e2m1 (two codes per byte, low nibble = even K, a UE8M0 scale byte per 32 K) to bf16 is a bit
placement and one multiply. A code s·m2 m1 m0 placed as bf16 bits `s << 15 | m2m1m0 << 6` reads
as its e2m1 value times 2^-126 — for the subnormal code 0.5 too, since bf16's subnormal step
lines up with e2m1's — so `value = bits × 2^(scale_byte - 1)`, exact in bf16 for scale bytes
1..128 (scales up to 2; real weights use ~2^-10..2^-4, `PackedExperts` refuses larger).
FP8 e4m3 likewise: bits `s << 15 | e4m3_magnitude << 4` read as the value times 2^-120,
so `value = bits × 2^(scale_byte - 7)` (exact for scale bytes 1..134, i.e. scales up to 2^7).

On a GPU (`ASM`) this runs as PTX on 32-bit words, two bf16 lanes at a time: bytes j, j+1 are
spread to the two 16-bit halves (`prmt`), one nibble of each is masked and multiplied by
2^6 + 2^12 (low nibble) or 2^2 + 2^8 (high nibble), which moves its magnitude to bits 6..8 and
its sign to bit 15 in one `mul.lo` (the two shifted copies do not overlap), a mask keeps those,
and `mul.rn.bf16x2` applies the scale: ~2.3 instructions per weight, against ~17 for Triton's
per-element integer code. A decode step is bound by how fast weights become MMA operands. The
Triton interpreter has no inline PTX, so it runs the same construction in integer tensor ops.

MMA order: a wgmma A operand held in registers gives each thread, per 16-wide K slice, the
columns 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4). `mma_order` permutes K so that these are four
consecutive weight bytes (one 32-bit word: one PTX input, no byte shuffles); the activations are
permuted the same way (`mma_order_pairs` / `mma_order`), which leaves the dot product unchanged.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

FP4_GROUP = 32  # K elements per UE8M0 scale
FP8_BLOCK = 128  # rows and K elements per FP8 weight scale
FP4_K_BLOCK = 64  # code bytes (128 K) per row in one K block of a packed FP4 matrix (`fp4_k_block`)


# ---------------------------------------------------------------------------------------
# K order
# ---------------------------------------------------------------------------------------

@triton.jit
def mma_order(t):
    """[R, C] (C % 16 == 0): column 16i + 4q + 2h + r → 16i + 8h + 2q + r."""
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    return tl.reshape(tl.permute(tl.reshape(t, [R, C // 16, 4, 2, 2]), [0, 1, 3, 2, 4]), [R, C])


@triton.jit
def mma_order_pairs(x):
    """[T, 2C] activations of C FP4 bytes → (even, odd) [T, C], columns in `mma_order` of the bytes."""
    T: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1] // 2
    x = tl.reshape(tl.permute(tl.reshape(x, [T, C // 16, 4, 2, 2, 2]), [0, 1, 3, 2, 4, 5]), [T, C, 2])
    return tl.split(x)


# ---------------------------------------------------------------------------------------
# FP4
# ---------------------------------------------------------------------------------------

@triton.jit
def _e2m1_bits(code):
    """e2m1 codes (int, 0..15) → bf16 bits of value · 2^-126."""
    return ((code & 7) << 6) | ((code & 8) << 12)


@triton.jit
def fp4_to_bf16(packed, scale, ASM: tl.constexpr):
    """packed uint8 [R, C] (K elements 2j, 2j+1 in byte j), scale uint8 [R, C // 16]
    → (even, odd): bf16 [R, C], the low and high nibble of each byte times its group's scale."""
    R: tl.constexpr = packed.shape[0]
    C: tl.constexpr = packed.shape[1]
    if ASM:
        f = ((scale.to(tl.uint16) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^(s-1)
        f = tl.reshape(tl.broadcast_to(f[:, :, None], [R, C // 16, 16]), [R, C])
        even, odd = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u0, u1, a;
            prmt.b32 u0, $4, 0, 0x4140;
            prmt.b32 u1, $4, 0, 0x4342;
            and.b32 a, u0, 0x000F000F; mul.lo.u32 a, a, 0x1040; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $0, a, $5;
            and.b32 a, u1, 0x000F000F; mul.lo.u32 a, a, 0x1040; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $1, a, $6;
            and.b32 a, u0, 0x00F000F0; mul.lo.u32 a, a, 0x0104; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $2, a, $5;
            and.b32 a, u1, 0x00F000F0; mul.lo.u32 a, a, 0x0104; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $3, a, $6;
            }
            """,
            constraints="=r,=r,=r,=r,r,r,r", args=[packed, f], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4)
        return even, odd
    # interpreter: the same construction with integer ops, the multiply as an exponent add
    # (the interpreter's bf16 arithmetic works on raw bits); bf16 subnormal code 1 handled apart
    p = tl.reshape(packed.to(tl.int32), [R, C // 16, 16])
    bias = ((scale.to(tl.int32) - 1) << 7)[:, :, None]
    lo = _scaled_bits(p & 15, bias)
    hi = _scaled_bits(p >> 4, bias)
    even = tl.reshape(lo, [R, C]).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    odd = tl.reshape(hi, [R, C]).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return even, odd


@triton.jit
def _scaled_bits(code, bias):
    mag = code & 7
    bits = tl.where(mag == 1, bias, (mag << 6) + bias)  # 0.5·2^(s-127): exponent s-1, mantissa 0
    bits = tl.where(mag == 0, 0, bits)
    return bits | ((code & 8) << 12)


# ---------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------

@triton.jit
def ue8m0_to_f32(byte):
    """UE8M0 scale byte(s) → float32 2^(byte-127) (byte 0, 2^-127, reads as 0: never a real scale)."""
    return (byte.to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_to_bf16(q, row_scale, ASM: tl.constexpr):
    """q e4m3 [R, C], row_scale uint8 [R] (UE8M0 of each row's current 128×128 block) → bf16 [R, C]."""
    R: tl.constexpr = q.shape[0]
    C: tl.constexpr = q.shape[1]
    if ASM:
        f = ((row_scale.to(tl.uint16) + 120) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^(s-7)
        f = tl.broadcast_to(f[:, None], [R, C])
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u0, u1, a, b;
            prmt.b32 u0, $2, 0, 0x4140;
            prmt.b32 u1, $2, 0, 0x4342;
            shl.b32 a, u0, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, u0, 8; and.b32 b, b, 0x80008000;
            or.b32 a, a, b; mul.rn.bf16x2 $0, a, $3;
            shl.b32 a, u1, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, u1, 8; and.b32 b, b, 0x80008000;
            or.b32 a, a, b; mul.rn.bf16x2 $1, a, $4;
            }
            """,
            constraints="=r,=r,r,r,r", args=[q.to(tl.uint8, bitcast=True), f], dtype=tl.bfloat16,
            is_pure=True, pack=4)
    return (q.to(tl.float32) * ue8m0_to_f32(row_scale)[:, None]).to(tl.bfloat16)


# ---------------------------------------------------------------------------------------
# host-side checks
# ---------------------------------------------------------------------------------------

def fp4_k_block(row_bytes: int) -> int:
    """Code bytes per row in one K block of a packed FP4 matrix with `row_bytes` per row (a multiple
    of 16, the bytes of one scale group): `FP4_K_BLOCK`, or the largest power of two dividing
    `row_bytes` below it. The matrix is stored K block by K block, all rows of a block contiguous
    (model/moe.py's `PackedExperts`), so that one K step of a weight tile is one contiguous read."""
    return math.gcd(row_bytes, FP4_K_BLOCK)


def check_fp4_block(block_k: int) -> None:
    """A K tile for FP4 weights: whole 32-element scale groups, and K/2 >= 16 for tl.dot."""
    if block_k % FP4_GROUP or block_k < FP4_GROUP:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of {FP4_GROUP} (one UE8M0 scale per 32 K) for FP4")


def check_fp8_block(block_k: int) -> None:
    if FP8_BLOCK % block_k or block_k < 16:
        raise ValueError(f"BLOCK_K={block_k} must divide {FP8_BLOCK} (one scale per 128 K) and be >= 16 for FP8")


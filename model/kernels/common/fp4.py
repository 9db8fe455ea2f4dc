"""In-kernel dequantisation of the expert weight codecs of `model/low_precision.py`, as `@triton.jit` helpers.

FP4 e2m1 (a UE8M0 scale byte per 32 K) to bf16 is a bit placement and one multiply. A code
s·m2 m1 m0 placed as bf16 bits `s << 15 | m2m1m0 << 6` reads as its e2m1 value times 2^-126 —
for the subnormal code 0.5 too, since bf16's subnormal step lines up with e2m1's — so
`value = bits × 2^(scale_byte - 1)`, exact in bf16 for scale bytes 1..128 (scales up to 2; real
weights use ~2^-10..2^-4, `PackedExperts` refuses larger).
FP8 e4m3 likewise: bits `s << 15 | e4m3_magnitude << 4` read as the value times 2^-120,
so `value = bits × 2^(scale_byte - 7)` (exact for scale bytes 1..134, i.e. scales up to 2^7).

FP4 word layout. A wgmma A operand held in registers gives a thread, per 16-wide K slice, the
columns 2q, 2q+1 of rows g and g+8 in four consecutive registers, so one 32-bit input of the
conversion holds the bytes (g, 2p), (g, 2p+1), (g+8, 2p), (g+8, 2p+1): eight codes, two rows. The
packed experts store the 32 bits of each such group permuted (`shuffle_fp4_words`) so that each
output pair of bf16 lanes comes out of the word with few instructions: `word & M` (M = sign and
magnitude places of both lanes), `rotl(word, 10) & M`, `rotl(word, 13) & M`, and for the last pair
`((word & 0x001B001B) × 0x1084) & M` (three shifted copies of five bits, none overlapping), each
then times its row's scale (`mul.rn.bf16x2`): 12 instructions per 8 weights, where the bytes as
the checkpoint packs them take 18 (two `prmt` spreads, then mask, multiply, mask, scale per pair);
a decode step is bound by how fast weights become MMA operands. Outside the register operand (the
tokens-as-M product, the interpreter) the groups are assembled explicitly (`_words`).

MMA order: a wgmma A operand held in registers gives each thread, per 16-wide K slice, the
columns 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4). `mma_order` permutes K so that these are four
consecutive weight bytes (one 32-bit word: one PTX input, no byte shuffles); the activations are
permuted the same way (`mma_order_pairs` / `mma_order`), which leaves the dot product unchanged.
"""

from __future__ import annotations

import math
import re

import torch
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

# (pair, lane) → positions of the code's bits m0, m1, m2, s in a shuffled word. Pair 0 is bf16 lanes
# (low nibble of byte 0, of byte 1), pair 1 the low nibbles of bytes 2, 3, pairs 2, 3 the high
# nibbles likewise; bytes 0, 1 are row g's, 2, 3 row g+8's (module docstring).
WORD_BITS = (((6, 7, 8, 15), (22, 23, 24, 31)),  # word & M
             ((28, 29, 30, 5), (12, 13, 14, 21)),  # rotl 10
             ((25, 26, 27, 2), (9, 10, 11, 18)),  # rotl 13
             ((4, 0, 1, 3), (20, 16, 17, 19)))  # (word & 0x001B001B) × 0x1084
_PAIRS = """
            and.b32 a, $W, 0x81C081C0; mul.rn.bf16x2 $0, a, $G;
            shf.l.wrap.b32 a, $W, $W, 10; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $1, a, $H;
            shf.l.wrap.b32 a, $W, $W, 13; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $2, a, $G;
            and.b32 a, $W, 0x001B001B; mul.lo.u32 a, a, 0x1084; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $3, a, $H;
"""
# one input word $4 and the scales of its rows g, g+8 as bf16 pairs $5, $6 → four bf16 pairs $0..$3;
# the comment names the conversion in compiled code (`reads_wgmma_operand`)
_FP4_MARK = "fp4 words"
_FP4_PTX = tl.constexpr("{ .reg .b32 a; /* " + _FP4_MARK + " */"
                        + _PAIRS.replace("$W", "$4").replace("$G", "$5").replace("$H", "$6") + "}")


@triton.jit
def fp4_scale_factor(byte):
    """UE8M0 scale byte(s) → bf16 2^(byte - 1), the factor `fp4_to_bf16` multiplies placed codes by.
    Made where the bytes are loaded, before Triton moves them into the conversion's layout (through
    shared memory): they then arrive there as bf16 pairs, a thread's eight of a decode K step in one
    128-bit read, where bytes would each take an extract and an add in the K loop."""
    return ((byte.to(tl.uint16) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def fp4_to_bf16(packed, factor, ASM: tl.constexpr, MMA: tl.constexpr):
    """packed uint8 [R, C] (R % 16 == 0, shuffled words: byte pairs 2p, 2p+1 of rows g, g+8 of each
    16-row block; columns in any order that keeps those pairs), factor bf16 [R, C // 16]
    (`fp4_scale_factor` of the scale bytes) → (even, odd): bf16 [R, C], the low and high nibble's
    code of each byte times its group's scale. MMA: `packed` is laid out as a wgmma register
    operand, whose four consecutive bytes are one group (module docstring), and is converted in
    place."""
    f = _per_column(factor)
    if ASM and MMA:
        # four bytes per input: rows g, g+8 → their scales in $5, $6 (two lanes each)
        even, odd = tl.inline_asm_elementwise(
            asm=_FP4_PTX,
            constraints="=r,=r,=r,=r,r,r,r", args=[packed, f], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4)
        return even, odd
    b00, b01, b10, b11 = _words(packed)
    word = (b00.to(tl.uint32) | (b01.to(tl.uint32) << 8) | (b10.to(tl.uint32) << 16)
            | (b11.to(tl.uint32) << 24))
    fg, _, fh, _ = _words(f)  # row g's scale, row g+8's
    if ASM:
        fg = fg.to(tl.uint16, bitcast=True).to(tl.uint32)
        fh = fh.to(tl.uint16, bitcast=True).to(tl.uint32)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=_FP4_PTX,
            constraints="=r,=r,=r,=r,r,r,r", args=[word, fg | (fg << 16), fh | (fh << 16)],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
        even = _unwords(_lane(p0, 0), _lane(p0, 1), _lane(p1, 0), _lane(p1, 1))
        odd = _unwords(_lane(p2, 0), _lane(p2, 1), _lane(p3, 0), _lane(p3, 1))
        return even, odd
    # interpreter (no inline PTX): each code read from its bit places (`WORD_BITS`), then the same bits built
    # with integer ops, the multiply as an exponent add (the interpreter's bf16 arithmetic works
    # on raw bits); bf16 subnormal code 1 handled apart
    sg, _, sh, _ = _words((f.to(tl.uint16, bitcast=True) >> 7).to(tl.int32) - 126)  # the scale bytes
    bias_g = (sg - 1) << 7
    bias_h = (sh - 1) << 7
    w = word.to(tl.int32, bitcast=True)
    even = _unwords(_scaled_bits(_code(w, 6, 7, 8, 15), bias_g), _scaled_bits(_code(w, 22, 23, 24, 31), bias_g),
                    _scaled_bits(_code(w, 28, 29, 30, 5), bias_h), _scaled_bits(_code(w, 12, 13, 14, 21), bias_h))
    odd = _unwords(_scaled_bits(_code(w, 25, 26, 27, 2), bias_g), _scaled_bits(_code(w, 9, 10, 11, 18), bias_g),
                   _scaled_bits(_code(w, 4, 0, 1, 3), bias_h), _scaled_bits(_code(w, 20, 16, 17, 19), bias_h))
    return (even.to(tl.uint16).to(tl.bfloat16, bitcast=True), odd.to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _per_column(s):
    """Per-group values [R, G] → [R, 16·G], each repeated over its group's 16 code bytes."""
    R: tl.constexpr = s.shape[0]
    G: tl.constexpr = s.shape[1]
    return tl.reshape(tl.broadcast_to(s[:, :, None], [R, G, 16]), [R, G * 16])


@triton.jit
def _words(t):
    """[R, C] → its groups as four [R/16, 8, C/2] tensors: (row g, byte 2p), (g, 2p+1), (g+8, 2p), (g+8, 2p+1)."""
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    t = tl.permute(tl.reshape(t, [R // 16, 2, 8, C // 2, 2]), [0, 2, 3, 4, 1])  # [.., byte, row half]
    g, h = tl.split(t)
    g0, g1 = tl.split(g)
    h0, h1 = tl.split(h)
    return g0, g1, h0, h1


@triton.jit
def _unwords(g0, g1, h0, h1):
    """`_words`' inverse → [R, C]."""
    t = tl.join(tl.join(g0, g1), tl.join(h0, h1))  # [R/16, 8, C/2, byte, row half]
    t = tl.permute(t, [0, 4, 1, 2, 3])
    return tl.reshape(t, [t.shape[0] * 16, t.shape[3] * 2])


@triton.jit
def _lane(pair, lane: tl.constexpr):
    """bf16 lane 0 or 1 of a uint32 holding two."""
    return ((pair >> (16 * lane)) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _code(w, m0: tl.constexpr, m1: tl.constexpr, m2: tl.constexpr, s: tl.constexpr):
    """The e2m1 code (int32, 0..15) whose bits m0, m1, m2, sign sit at those places of word w."""
    return (((w >> m0) & 1) | (((w >> m1) & 1) << 1) | (((w >> m2) & 1) << 2) | (((w >> s) & 1) << 3))


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


# four e4m3 bytes $2 and their factors 2^(s-7) as bf16 pairs $3, $4 → bf16 pairs $0, $1: each code's
# magnitude placed at bf16 bits 4.. and its sign at bit 15, then one multiply a pair (pack=4)
FP8_PTX = tl.constexpr("""
{
.reg .b32 u0, u1, a, b;
prmt.b32 u0, $2, 0, 0x4140;
prmt.b32 u1, $2, 0, 0x4342;
shl.b32 a, u0, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, u0, 8; and.b32 b, b, 0x80008000;
or.b32 a, a, b; mul.rn.bf16x2 $0, a, $3;
shl.b32 a, u1, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, u1, 8; and.b32 b, b, 0x80008000;
or.b32 a, a, b; mul.rn.bf16x2 $1, a, $4;
}
""")  # a constexpr: kernels may only read constexpr globals


@triton.jit
def fp8_to_bf16(q, row_scale, ASM: tl.constexpr):
    """q e4m3 [R, C], row_scale uint8 [R] (UE8M0 of each row's current 128×128 block) → bf16 [R, C]."""
    R: tl.constexpr = q.shape[0]
    C: tl.constexpr = q.shape[1]
    if ASM:
        f = ((row_scale.to(tl.uint16) + 120) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^(s-7)
        f = tl.broadcast_to(f[:, None], [R, C])
        return tl.inline_asm_elementwise(
            asm=FP8_PTX, constraints="=r,=r,r,r,r", args=[q.to(tl.uint8, bitcast=True), f], dtype=tl.bfloat16,
            is_pure=True, pack=4)
    return (q.to(tl.float32) * ue8m0_to_f32(row_scale)[:, None]).to(tl.bfloat16)


# ---------------------------------------------------------------------------------------
# host-side checks
# ---------------------------------------------------------------------------------------

def shuffle_fp4_words(codes: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """FP4 codes [..., R, C] uint8 as the checkpoint packs them (K 2j in byte j's low nibble; R % 16
    == 0, C even) → the word layout `fp4_to_bf16` reads (module docstring), or back with `inverse`.
    A permutation of the 32 bits of each group (rows g, g+8 of a 16-row block × bytes 2p, 2p+1)."""
    *lead, R, C = codes.shape
    if R % 16 or C % 2:
        raise ValueError(f"FP4 word groups need rows in multiples of 16 and an even byte count, got {R} × {C}")
    t = codes.reshape(*lead, R // 16, 2, 8, C // 2, 2).movedim(-4, -1).to(torch.int64)  # [.., byte, half]
    word = t[..., 0, 0] | t[..., 1, 0] << 8 | t[..., 0, 1] << 16 | t[..., 1, 1] << 24
    out = torch.zeros_like(word)
    for k, lanes in enumerate(WORD_BITS):
        for lane, places in enumerate(lanes):
            # standard place of (pair k, lane): byte 2·(k % 2) + lane, nibble k // 2
            std = 8 * (2 * (k % 2) + lane) + 4 * (k // 2)
            for i, place in enumerate(places):
                src, dst = (place, std + i) if inverse else (std + i, place)
                out |= ((word >> src) & 1) << dst
    t = torch.stack([torch.stack([out & 0xFF, (out >> 8) & 0xFF], -1),
                     torch.stack([(out >> 16) & 0xFF, out >> 24], -1)], -1)  # [.., byte, half]
    return t.movedim(-1, -4).reshape(*lead, R, C).to(torch.uint8)


def reads_wgmma_operand(ttgir: str) -> bool:
    """Whether every conversion of packed FP4 bytes in place (`fp4_to_bf16` with MMA) in a compiled
    kernel's TTGIR takes its input as a wgmma register operand (opIdx 0 of an MMA v3 layout, kWidth
    2), the only layout in which four consecutive registers of a thread are one word group. Triton
    picks that layout, not the kernel: it moves the layout change ahead of the conversion for the
    V4 tiles (K steps of 128), but leaves it after for some smaller steps (BK 32; BK 64 at some BN
    and warp counts), where the four bytes are a row's columns 0, 1, 8, 9 instead."""
    mma_v3 = set(re.findall(r"^(#\w+) = #ttg\.nvidia_mma<\{versionMajor = 3\b", ttgir, re.M))
    for line in ttgir.splitlines():
        if _FP4_MARK not in line or "tt.elementwise_inline_asm" not in line:
            continue
        operands = line.rsplit("pure = true}", 1)[-1].split("->")[0]
        if "xi8," not in operands:
            continue  # explicit words (uint32): any layout is right
        m = re.search(r"xi8, #ttg\.dot_op<\{opIdx = 0, parent = (#\w+), kWidth = 2\}>>", operands)
        if m is None or m.group(1) not in mma_v3:
            return False
    return True


def fp4_k_block(row_bytes: int) -> int:
    """Code bytes per row in one K block of a packed FP4 matrix with `row_bytes` per row (a multiple
    of 16, the bytes of one scale group): `FP4_K_BLOCK`, or the largest power of two dividing
    `row_bytes` below it. The matrix is stored K block by K block, all rows of a block contiguous
    (kernels/moe/packed_experts.py's `PackedExperts`), so that one K step of a weight tile is one contiguous read."""
    return math.gcd(row_bytes, FP4_K_BLOCK)


def check_fp4_block(block_k: int) -> None:
    """A K tile for FP4 weights: whole 32-element scale groups, and K/2 >= 16 for tl.dot."""
    if block_k % FP4_GROUP or block_k < FP4_GROUP:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of {FP4_GROUP} (one UE8M0 scale per 32 K) for FP4")


def check_fp8_block(block_k: int) -> None:
    if FP8_BLOCK % block_k or block_k < 16:
        raise ValueError(f"BLOCK_K={block_k} must divide {FP8_BLOCK} (one scale per 128 K) and be >= 16 for FP8")


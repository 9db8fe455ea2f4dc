"""Reading and writing KV-pool entries inside Triton kernels (the layouts of `model.kv_pool`).

A pool is one uint8 buffer [num_pages, page_bytes], page-major, a page laid out
[layer][entry][entry_bytes]. Entry `j` of a request in layer slot `l` starts at byte

    table[seq, j // entries_per_page] · page_bytes + l · layer_bytes + (j % entries_per_page) · entry_stride

where `entry_stride` is `entry_bytes`, except for `fp8_pack` indexer keys (`PoolSpec.split_at`):
their values fill a block of entries_per_page · c bytes at the start of the layer's part of the
page, strided by c, and their fp32 scales a block after it (`index_scale_at`).

Entry encodings (`PACK`, a constexpr; `pack_code` maps pool kind and storage format to it):

| code | encoding | bytes |
|---|---|---|
| 0 | fp32 values | 4·d |
| 1 | bf16 values | 2·d |
| 2 | KV `NopeFp8RopeBf16Pack`: nope e4m3, rope bf16, one UE8M0 byte per 64 nope dims, zero pad | 584 for d=512 |
| 3 | indexer key: e4m3 values, and one fp32 scale (amax/448) in the page's scale block | d + 4 |

Decoding reproduces `model.low_precision` exactly (an e4m3 value times a power of two is exact in fp32
and bf16). Encoding matches it bit for bit except that the UE8M0 exponent is taken from the
float's bits (exact ceil(log2)) where torch evaluates log2 in fp32; they differ only when
amax/448 lies within an ulp above a power of two.
"""

from __future__ import annotations

import triton
import triton.language as tl

from model.kv_pool import STATE_KINDS, KVPools

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)  # model.low_precision.AMAX_FLOOR: keeps all-zero blocks finite


def alignment(pools: KVPools, kind: str) -> int:
    """Largest power of two (≤ 16) dividing every entry's byte offset in `kind`: the kernels tell
    the compiler (`tl.multiple_of`) so entry loads become vector loads, not byte gathers."""
    spec = pools.specs[kind]
    a = 16
    while a > 1 and (spec.entry_stride % a or spec.layer_bytes % a or spec.page_bytes % a):
        a //= 2
    return a


def pack_code(pools: KVPools, kind: str) -> int:
    """The entry encoding of `kind` in `pools` (table in the module docstring)."""
    fmt = "fp32" if kind in STATE_KINDS else pools.format
    if fmt == "fp32":
        return 0
    if fmt == "bf16":
        return 1
    return 3 if kind == "c4_indexer" else 2


@triton.jit
def entry_base(table_ptr, table_stride, seq, idx, valid, EPP: tl.constexpr, page_bytes, layer_off, entry_stride,
               ALIGN: tl.constexpr = 1):
    """Byte offsets (int64) of entries `idx` of request row `seq` (0 where not `valid`), each a
    multiple of ALIGN (`alignment`); `entry_stride` is the pool's `PoolSpec.entry_stride`."""
    page = tl.load(table_ptr + seq * table_stride + idx // EPP, mask=valid, other=0)
    base = page.to(tl.int64) * page_bytes + layer_off + (idx % EPP).to(tl.int64) * entry_stride
    return tl.multiple_of(tl.where(valid, base, 0), ALIGN)


@triton.jit
def index_scale_at(base, idx, EPP: tl.constexpr, c):
    """Byte offset of the fp32 scale of indexer key `idx` (code 3) whose values start at `base`:
    past the layer's EPP·c value bytes, 4 bytes a slot."""
    slot = (idx % EPP).to(tl.int64)
    return base + (EPP - slot) * c + slot * 4


@triton.jit
def load_entries(rows, valid, c0: tl.constexpr, C: tl.constexpr, d, NOPE: tl.constexpr, ROPE: tl.constexpr,
                 PACK: tl.constexpr):
    """Decode columns [c0, c0 + C) (those < d) of the entries at byte pointers `rows` [N] → fp32 [N, C].
    A chunk wholly in an fp8_pack entry's nope or rope part loads only that part."""
    cols = c0 + tl.arange(0, C)
    mask = valid[:, None] & (cols < d)[None, :]
    if PACK == 0:
        x = tl.load((rows[:, None] + 4 * cols[None, :]).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    elif PACK == 1:
        x = tl.load((rows[:, None] + 2 * cols[None, :]).to(tl.pointer_type(tl.bfloat16)), mask=mask,
                    other=0.0).to(tl.float32)
    elif PACK == 2:  # e4m3 nope with a UE8M0 byte per 64 columns, then bf16 rope
        nope = (cols < NOPE)[None, :]
        x = tl.zeros((rows.shape[0], C), tl.float32)
        if c0 < NOPE:
            q = tl.load((rows[:, None] + cols[None, :]).to(tl.pointer_type(tl.float8e4nv)), mask=mask & nope,
                        other=0.0).to(tl.float32)
            # one scale byte per 64 columns, loaded once per block and broadcast over its columns
            NB: tl.constexpr = (C + 63) // 64
            blk = tl.arange(0, NB)
            e = tl.load(rows[:, None] + (NOPE + 2 * ROPE + c0 // 64) + blk[None, :],
                        mask=valid[:, None] & (c0 // 64 + blk < NOPE // 64)[None, :], other=127)
            scale = tl.exp2(e.to(tl.float32) - 127.0)  # [N, NB]
            if NB == 1:
                scale = tl.broadcast_to(scale, (rows.shape[0], C))
            else:
                scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (rows.shape[0], NB, 64)), (rows.shape[0], C))
            x = q * scale
        if c0 + C > NOPE:
            r = tl.load((rows[:, None] + NOPE + 2 * (cols[None, :] - NOPE)).to(tl.pointer_type(tl.bfloat16)),
                        mask=mask & ~nope, other=0.0).to(tl.float32)
            x = tl.where(nope, x, r)
    else:
        tl.static_assert(PACK != 3, "indexer keys (code 3) keep their scales apart: index_scale_at")
    return x


@triton.jit
def _pow2_ceil(x):
    """2^ceil(log2(x)) for positive normal fp32 x, from its bits (exact)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True), e


@triton.jit
def store_entry(buf_ptr, base, v, cols, d, NOPE: tl.constexpr, ROPE: tl.constexpr, ENTRY_BYTES: tl.constexpr,
                D: tl.constexpr, PACK: tl.constexpr, scale_at=0):
    """Encode one entry `v` fp32 [D] (columns `cols` = arange(D), valid below d) at byte `base`;
    an indexer key's scale goes to byte `scale_at` (`index_scale_at`; unused by other codes)."""
    valid = cols < d
    if PACK == 0:
        tl.store((buf_ptr + base + 4 * cols).to(tl.pointer_type(tl.float32)), v, mask=valid)
    elif PACK == 1:
        tl.store((buf_ptr + base + 2 * cols).to(tl.pointer_type(tl.bfloat16)), v.to(tl.bfloat16), mask=valid)
    elif PACK == 2:
        nope = cols < NOPE
        blocks = tl.reshape(tl.abs(tl.where(nope, v, 0.0)), (D // 64, 64))
        amax = tl.maximum(tl.max(blocks, axis=1), AMAX_FLOOR)  # [D/64]
        scale, e = _pow2_ceil(amax / FP8_MAX)
        scale_col = tl.reshape(tl.broadcast_to(scale[:, None], (D // 64, 64)), (D,))
        q = tl.clamp(v / scale_col, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        tl.store((buf_ptr + base + cols).to(tl.pointer_type(tl.float8e4nv)), q, mask=nope)
        rope_ptr = buf_ptr + base + NOPE + 2 * (cols - NOPE)
        tl.store(rope_ptr.to(tl.pointer_type(tl.bfloat16)), v.to(tl.bfloat16), mask=valid & ~nope)
        blk = tl.arange(0, D // 64)
        tl.store(buf_ptr + base + NOPE + 2 * ROPE + blk, e.to(tl.uint8), mask=blk < NOPE // 64)
        pad = NOPE + 2 * ROPE + NOPE // 64
        tl.store(buf_ptr + base + pad + cols, tl.zeros_like(cols).to(tl.uint8), mask=cols < ENTRY_BYTES - pad)
    else:
        amax = tl.maximum(tl.max(tl.abs(tl.where(valid, v, 0.0)), axis=0), AMAX_FLOOR)
        s = amax / FP8_MAX
        q = tl.clamp(v / s, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        tl.store((buf_ptr + base + cols).to(tl.pointer_type(tl.float8e4nv)), q, mask=valid)
        tl.store((buf_ptr + scale_at).to(tl.pointer_type(tl.float32)), s)

"""Sparse attention over `fp8_pack` pools on Hopper, written in Gluon: the kernel of
`sparse_attention.attend` for 512-dim entries (448 e4m3 nope + 64 bf16 rope) on sm_90.

Same semantics and launch grid as `sparse_attention._sparse_attn_kernel` (one program per
(token, 64 heads, KV split); the sink seeds split 0; one split writes the de-rotated output,
several write partials for `_combine_kernel`), built differently where the Triton kernel is slow:

* each 64-entry block is decoded to bf16 **once**, into shared memory, and both products read it
  there: S = q·kᵀ (kᵀ a transposed view of the tile) and acc += P·k. The Triton kernel decodes
  every block twice (a quarter of the head dim at a time, to keep registers) and is bound by
  those decode instructions and their loads;
* two buffers of decoded blocks: block i's products run as asynchronous wgmma while the warps
  decode block i + 1 into the other buffer, half during S and half during P·k. Both products are
  awaited within the iteration (one left in flight across the back edge made ptxas serialise
  every wgmma, tests/model/test_sparse_attention_hopper_build.py);
* the address chain (picks → page table → entry bytes) runs an iteration ahead of its use, so a
  block's loads never wait on the load before them;
* 8 warps as two warpgroups: S's 64 entries split 32 + 32 between them and P·k's 512 columns
  256 + 256 (wgmma layout [4, 2]); the softmax's row reductions cross the two through shared
  memory, and P reaches both as the register operand of P·k.

Decoding: an e4m3 code placed as bf16 bits `s << 15 | magnitude << 4` reads as its value times
2^-120, so value × 2^(scale - 127) = bits × 2^(scale - 7), one bf16 multiply per pair (exact;
`fp4.FP8_PTX`, as `fp4.fp8_to_bf16` runs it). q is rounded to bf16 as the Triton kernel rounds it.

Shared memory: q [64, 512] and two decoded blocks [2, 64, 512], bf16 with 128-byte swizzle
(192 KB of Hopper's 227).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from model.kernels.common.fp4 import FP8_PTX

BH = gl.constexpr(64)  # heads a program: the wgmma M side of one warpgroup
BN = gl.constexpr(64)  # entries a block
D = gl.constexpr(512)  # entry width the kernel is built for
NOPE = gl.constexpr(448)
ROPE = gl.constexpr(64)
NUM_WARPS = 8


def supported(q: torch.Tensor, d: int, rope_dim: int, swa_pack: int, comp_pack: int) -> bool:
    """Whether `attend` can take this kernel: fp8_pack entries of 448 + 64 columns on sm_90 (wgmma
    is Hopper's; later GPUs run the Triton kernel)."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0) and d == D
            and rope_dim == ROPE and swa_pack == 2 and comp_pack == 2)


@gluon.jit
def _pdl_wait(PDL: gl.constexpr):
    if PDL:  # see model/kernels/common/pdl.py
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


# A block's entry addresses come from a chain of loads (picks → page table → entry bytes). The
# kernel keeps each link an iteration ahead of its use, so that no load waits on the one before:
# block i + 3·SPLITS's picks, i + 2·SPLITS's pages and i + SPLITS's bytes are in flight while
# block i's products run.

@gluon.jit
def _block_index(i, t, lo, n_win, n_blocks, offs, picks_ptr, stride_pk, n_comp, HAS_PICKS: gl.constexpr):
    """Block i's entry indices [BN]: window positions, or compressed entries (the picks' load
    issued, not waited on); -1 past the last block."""
    if i < n_win:
        idx = lo + i * BN + offs
    else:
        j = (i - n_win) * BN + offs
        if HAS_PICKS:
            idx = gl.load(picks_ptr + t * stride_pk + j, mask=(j < n_comp) & (i < n_blocks), other=-1)
        else:
            idx = j
    return gl.where(i < n_blocks, idx, -1)


@gluon.jit
def _block_page(i, idx, seq, pos, n_win, swa_table, swa_tstride, c_table, c_tstride,
                RATIO: gl.constexpr, HAS_PICKS: gl.constexpr, SWA_EPP: gl.constexpr, C_EPP: gl.constexpr):
    """(validity, page-table load issued) of block i's entries."""
    if i < n_win:
        valid = (idx >= 0) & (idx <= pos)
        page = gl.load(swa_table + seq * swa_tstride + idx // SWA_EPP, mask=valid, other=0)
    else:
        # idx is -1 past the last block, so with RATIO 0 (window-only layers: no block here) none is valid
        valid = idx >= 0
        if RATIO > 0 and not HAS_PICKS:  # HCA: every complete window
            valid = valid & (idx < (pos + 1) // RATIO)
        page = gl.load(c_table + seq * c_tstride + idx // C_EPP, mask=valid, other=0)
    return valid, page


@gluon.jit
def _block_ptr(i, idx, valid, page, n_win,
               swa_buf, swa_page_bytes, swa_layer_off, swa_entry_bytes, c_buf, c_page_bytes, c_layer_off,
               c_entry_bytes, SWA_EPP: gl.constexpr, C_EPP: gl.constexpr, SWA_ALIGN: gl.constexpr,
               C_ALIGN: gl.constexpr):
    """Block i's entry pointers [BN] (uint8*; the pool's start where invalid)."""
    if i < n_win:
        base = page.to(gl.int64) * swa_page_bytes + swa_layer_off + (idx % SWA_EPP).to(gl.int64) * swa_entry_bytes
        ptr = swa_buf + gl.multiple_of(gl.where(valid, base, 0), SWA_ALIGN)
    else:
        base = page.to(gl.int64) * c_page_bytes + c_layer_off + (idx % C_EPP).to(gl.int64) * c_entry_bytes
        ptr = c_buf + gl.multiple_of(gl.where(valid, base, 0), C_ALIGN)
    return ptr


@gluon.jit
def _load_block(ptr, valid, LD: gl.constexpr):
    """An entry block's bytes into registers: the 7 nope chunks (e4m3 [BN, 64] each), the rope
    (bf16 [BN, 64]) and the 8 scale bytes as one uint64 [BN] (7 scales and the pad); zeros where
    not valid."""
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
    p = ptr[:, None] + cols[None, :]
    m = valid[:, None]
    n0 = gl.load(p, mask=m, other=0)
    n1 = gl.load(p + 64, mask=m, other=0)
    n2 = gl.load(p + 128, mask=m, other=0)
    n3 = gl.load(p + 192, mask=m, other=0)
    n4 = gl.load(p + 256, mask=m, other=0)
    n5 = gl.load(p + 320, mask=m, other=0)
    n6 = gl.load(p + 384, mask=m, other=0)
    rope = gl.load((ptr + NOPE).to(gl.pointer_type(gl.bfloat16))[:, None] + cols[None, :], mask=m, other=0.0)
    scales = gl.load((ptr + NOPE + 2 * ROPE).to(gl.pointer_type(gl.uint64)), mask=valid, other=0)
    return n0, n1, n2, n3, n4, n5, n6, rope, scales


@gluon.jit
def _decode_chunk(codes, scales, j: gl.constexpr, k_smem):
    """Nope chunk j (e4m3 bytes [BN, 64]) times 2^(scale_j - 127) → bf16 columns [64j, 64j + 64) of k_smem."""
    e = ((scales >> (8 * j)) & 0xFF).to(gl.uint16)
    f = ((e + 120) << 7).to(gl.bfloat16, bitcast=True)  # 2^(e - 7)
    f = gl.broadcast(f[:, None], codes)[0]
    x = gl.inline_asm_elementwise(asm=FP8_PTX, constraints="=r,=r,r,r,r", args=[codes, f], dtype=gl.bfloat16,
                                  is_pure=True, pack=4)
    k_smem.slice(64 * j, 64, dim=1).store(x)


@gluon.jit
def _decode_block(n0, n1, n2, n3, n4, n5, n6, rope, scales, k_smem):
    _decode_chunk(n0, scales, 0, k_smem)
    _decode_chunk(n1, scales, 1, k_smem)
    _decode_chunk(n2, scales, 2, k_smem)
    _decode_chunk(n3, scales, 3, k_smem)
    _decode_chunk(n4, scales, 4, k_smem)
    _decode_chunk(n5, scales, 5, k_smem)
    _decode_chunk(n6, scales, 6, k_smem)
    k_smem.slice(NOPE, ROPE, dim=1).store(rope)


@gluon.jit
def _sparse_attn_wgmma_kernel(
        q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, partial_ptr, ml_ptr,
        seq_ptr, pos_ptr, sink_ptr, inv_freq_ptr,
        swa_buf, swa_table, swa_tstride, swa_page_bytes, swa_layer_off, swa_entry_bytes,
        c_buf, c_table, c_tstride, c_page_bytes, c_layer_off, c_entry_bytes,
        picks_ptr, stride_pk, n_comp, H, scale_log2,
        WINDOW: gl.constexpr, RATIO: gl.constexpr, HAS_PICKS: gl.constexpr, SWA_EPP: gl.constexpr,
        C_EPP: gl.constexpr, SPLITS: gl.constexpr, SWA_ALIGN: gl.constexpr, C_ALIGN: gl.constexpr,
        PDL: gl.constexpr):
    # layouts: LD the block loads (8 consecutive columns a thread), S_L / O_L the two products'
    # accumulators (warpgroups side by side along N), P_L P·k's register operand
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, LD)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    _pdl_wait(PDL)

    t = gl.program_id(0)
    h0 = gl.program_id(1) * BH
    split = gl.program_id(2)
    seq = gl.load(seq_ptr + t)
    pos = gl.load(pos_ptr + t)

    # q [BH, D] → shared memory, bf16 (rows of heads past H are zeros)
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    qh = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, Q_L))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, Q_L))
    q = gl.load(q_ptr + t * stride_qt + qh[:, None] * stride_qh + qc[None, :], mask=(qh < H)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], SMEM, q.to(gl.bfloat16))
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], SMEM)  # decoded blocks, alternately

    heads_s = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
    if split == 0:  # the sink: a logit with a zero value vector
        m = gl.load(sink_ptr + heads_s, mask=heads_s < H, other=0.0).to(gl.float32) * 1.4426950408889634
        l = gl.full([BH], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
    else:
        m = gl.full([BH], -1e30, gl.float32, layout=gl.SliceLayout(1, S_L))
        l = gl.full([BH], 0.0, gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BH, D], gl.float32, layout=O_L)
    s_zero = gl.zeros([BH, BN], gl.float32, layout=S_L)

    lo = gl.maximum(pos - WINDOW + 1, 0)
    n_win = (WINDOW + BN - 1) // BN
    if RATIO == 0:
        n_blocks = n_win
    elif HAS_PICKS:
        n_blocks = n_win + (n_comp + BN - 1) // BN
    else:
        n_blocks = n_win + ((pos + 1) // RATIO + BN - 1) // BN
    offs = gl.arange(0, BN, layout=ROW)

    tables = (seq, pos, n_win, swa_table, swa_tstride, c_table, c_tstride)
    bufs = (n_win, swa_buf, swa_page_bytes, swa_layer_off, swa_entry_bytes, c_buf, c_page_bytes, c_layer_off,
            c_entry_bytes)
    picks = (t, lo, n_win, n_blocks, offs, picks_ptr, stride_pk, n_comp)
    idx = _block_index(split, *picks, HAS_PICKS)
    valid, page = _block_page(split, idx, *tables, RATIO, HAS_PICKS, SWA_EPP, C_EPP)
    ptr = _block_ptr(split, idx, valid, page, *bufs, SWA_EPP, C_EPP, SWA_ALIGN, C_ALIGN)
    n0, n1, n2, n3, n4, n5, n6, rope, scales = _load_block(ptr, valid, LD)
    _decode_block(n0, n1, n2, n3, n4, n5, n6, rope, scales, k_bufs.index(0))
    fence_async_shared()
    gl.thread_barrier()
    idx1 = _block_index(split + SPLITS, *picks, HAS_PICKS)
    valid1, page1 = _block_page(split + SPLITS, idx1, *tables, RATIO, HAS_PICKS, SWA_EPP, C_EPP)
    idx2 = _block_index(split + 2 * SPLITS, *picks, HAS_PICKS)
    c = 0
    for i in range(split, n_blocks, SPLITS):
        # Block i (decoded in k_bufs[c]) runs its products on the tensor cores while the warps
        # load block i + SPLITS and decode it into k_bufs[1 - c]: half during S, half during P·k.
        # Both products are awaited within the iteration: a wgmma group in flight across the
        # loop's back edge makes ptxas serialise every wgmma of the kernel (C7514).
        cur = k_bufs.index(c)
        nxt = k_bufs.index(1 - c)
        s_tok = warpgroup_mma(q_smem, cur.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        ptr = _block_ptr(i + SPLITS, idx1, valid1, page1, *bufs, SWA_EPP, C_EPP, SWA_ALIGN, C_ALIGN)
        n0, n1, n2, n3, n4, n5, n6, rope, scales = _load_block(ptr, valid1, LD)
        mask = gl.convert_layout(valid, gl.SliceLayout(0, S_L))
        valid = valid1
        idx1 = idx2
        valid1, page1 = _block_page(i + 2 * SPLITS, idx2, *tables, RATIO, HAS_PICKS, SWA_EPP, C_EPP)
        idx2 = _block_index(i + 3 * SPLITS, *picks, HAS_PICKS)
        _decode_chunk(n0, scales, 0, nxt)
        _decode_chunk(n1, scales, 1, nxt)
        _decode_chunk(n2, scales, 2, nxt)
        _decode_chunk(n3, scales, 3, nxt)

        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = gl.where(mask[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        m = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), P_L)
        acc_tok = warpgroup_mma(p_op, cur, acc, is_async=True)
        _decode_chunk(n4, scales, 4, nxt)
        _decode_chunk(n5, scales, 5, nxt)
        _decode_chunk(n6, scales, 6, nxt)
        nxt.slice(NOPE, ROPE, dim=1).store(rope)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        fence_async_shared()
        gl.thread_barrier()  # nxt's stores visible to the next S; every warpgroup done with cur
        c = 1 - c

    heads = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    hmask = heads < H
    if SPLITS == 1:
        o = acc / gl.convert_layout(l, gl.SliceLayout(1, O_L))[:, None]
        # de-rotate the rope pairs (columns NOPE + 2i, NOPE + 2i + 1) by -pos
        R_L: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [8, 1, 1], [2, 1, 0])
        o = gl.convert_layout(gl.reshape(gl.convert_layout(o, gl.BlockedLayout([1, 2], [1, 32], [8, 1], [1, 0])),
                                         [BH, D // 2, 2]), R_L)
        even, odd = gl.split(o)
        PR: gl.constexpr = even.type.layout
        half = gl.arange(0, D // 2, layout=gl.SliceLayout(0, PR))
        in_rope = half >= NOPE // 2
        freq = pos.to(gl.float32) * gl.load(inv_freq_ptr + half - NOPE // 2, mask=in_rope, other=0.0)
        cos = gl.cos(freq)[None, :]
        sin = gl.sin(freq)[None, :]
        r = in_rope[None, :]
        even, odd = gl.where(r, even * cos + odd * sin, even), gl.where(r, odd * cos - even * sin, odd)
        oh = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, PR))
        base = out_ptr + t * stride_ot + oh[:, None] * stride_oh + 2 * half[None, :]
        om = (oh < H)[:, None]
        gl.store(base, even.to(out_ptr.dtype.element_ty), mask=om)
        gl.store(base + 1, odd.to(out_ptr.dtype.element_ty), mask=om)
    else:
        row = (split * gl.num_programs(0) + t) * H + heads
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
        gl.store(partial_ptr + row[:, None] * D + cols[None, :], acc, mask=hmask[:, None])
        heads_s = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        row_s = (split * gl.num_programs(0) + t) * H + heads_s
        gl.store(ml_ptr + row_s * 2, m, mask=heads_s < H)
        gl.store(ml_ptr + row_s * 2 + 1, l, mask=heads_s < H)


def launch(args: tuple, T: int, H: int, scale_log2: float, consts: dict, pdl: bool) -> None:
    """`sparse_attention.attend`'s launch on this kernel: `args` the launch arguments both kernels
    take first (through n_comp; `sparse_attention._launch_args`), `consts` the constexprs they share."""
    _sparse_attn_wgmma_kernel[(T, -(-H // BH), consts["SPLITS"])](*args, H, scale_log2, **consts, PDL=pdl,
                                                                   num_warps=NUM_WARPS, launch_pdl=pdl)

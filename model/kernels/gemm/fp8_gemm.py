"""FP8 block-scaled GEMM: y = x · dequant(W)ᵀ with W in e4m3 and UE8M0 scales per 128×128 block.

This is how the official checkpoint stores the dense projections (`wq_a`, `wq_b`, `wkv`, `wo_a`,
`wo_b`, `indexer.wq_b`, shared experts). With bf16 activations (W8A16) the weight tile is
dequantised in registers (an e4m3 value times a power of two is exact in bf16) and multiplied on
the tensor cores with fp32 accumulation, so the kernel computes exactly the reference's product up
to the order of the fp32 sums. With `act_fp8` (W8A8, the checkpoint's dynamic activation scheme)
the input is quantised (`act_quant`; up to `INLINE_QUANT_MAX_M` rows inside the product kernel)
and `_fp8_a8_kernel` multiplies the codes on the FP8 tensor cores at decode sizes (its weight
tiles by TMA above one token tile). On sm_90 the large products of a large decode batch and all
of prefill's go to cuBLAS's blockwise FP8 GEMM instead (`fp8_cublas`); elsewhere
prefill-size M multiplies the quantised-dequantised input.

Grouped form (the grouped low-rank O projection `wo_a`): W holds G groups of N rows each and
x [M, G, K] multiplies group g by rows [g·N, (g+1)·N): y [M, G, N]. G = 1 is a plain linear.

Decode-size M (up to `KERNEL_MAX_M` rows) runs one of two kernels (`decode_config`):
* up to `TOKENS_M_MAX` rows, `_fp8_gemm_kernel`: tokens are the MMA's M side (16 rows), the
  dequantised weight tile its B operand; scales are applied per output column of each 128-wide K
  step (acc += dot(x, qᵀ) · s[n]), so tiles never need to align with the 128-row scale blocks.
* above, `_fp8_swap_kernel`: weight rows are the M side (64 or 128 a tile) and the weight tile
  the register operand, dequantised with its block scale folded in, so the products chain in
  one accumulator; tokens (up to 64 a tile) are the N side. From 32 rows on it is the faster one
  (`benchmarks/research/fp8_gemm_bench.py`, docs/journal/); at 1 and 16 rows the two run alike.
Both split K over programs when a product has few output tiles (fp32 partials summed in split
order by the last program of each output tile: deterministic, one launch). Prefill-size M
without the FP8 GEMM (W8A16, or not on sm_90) dequantises once and uses cuBLAS's bf16 GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from model.kernels import check_impl
from model.kernels.common import invariant
from model.kernels.common.fp4 import fp8_to_bf16
from model.kernels.common.pdl import launch_options, wait
from model.kernels.gemm import act_quant, fp8_cublas
from model.kernels.gemm.act_quant import quantize_blocks

BLOCK = 128  # scale block along N and K


def reference_dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight e4m3 [R, K], scale float [⌈R/128⌉, ⌈K/128⌉] → [R, K] in `dtype` (fp32 product, rounded once)."""
    rows, k = weight.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :k]
    return (weight.float() * s).to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [..., K] (or [M, G, K] when grouped), weight e4m3 [G·N, K], scale float [⌈G·N/128⌉, ⌈K/128⌉]
    → y in x.dtype: [..., N] (or [M, G, N])."""
    rows, k = weight.shape
    w = reference_dequantize(weight, scale, x.dtype)
    if groups == 1:
        return invariant.linear(x, w)
    if x.device.type == "cpu":  # `invariant`'s product: a row's bits independent of the batch
        return invariant.matmul(x.transpose(0, 1), w.view(groups, rows // groups, k).transpose(1, 2)
                                ).transpose(0, 1).to(x.dtype)
    return torch.einsum("mgk,gnk->mgn", x, w.view(groups, rows // groups, k))


# Above this many rows (prefill) dequantising the weight once and calling cuBLAS's bf16 GEMM beats
# this kernel, with the same arithmetic: the one dequantisation is amortised over many rows.
KERNEL_MAX_M = 256
TOKENS_M_MAX = 16  # decode products up to this many rows put the tokens on the MMA's M side
# W8A8 products up to this many rows (one token tile) quantise their bf16 input inside the
# kernel: every program quantises the same few rows again, which costs less than the separate
# `act_quant` launch it replaces at batch 1 (four a layer); larger inputs are quantised once
INLINE_QUANT_MAX_M = 16


def arrival_counters(rows: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed buffer of split-K arrival counters for the decode products of a weight with `rows`
    rows (`fp8_linear`'s `arrivals`): one counter per output tile of either decode kernel at any M
    up to `KERNEL_MAX_M` (tiles of at least 64 weight rows and 16 tokens) and up to 64 groups. The
    kernel sets every counter it used back to zero, so the buffer is filled once, not before every
    product (a fill launch per split GEMM, ~90 per decode step)."""
    return torch.zeros((triton.cdiv(rows, 64) + 64) * triton.cdiv(KERNEL_MAX_M, 16), dtype=torch.int32, device=device)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, impl: str, groups: int = 1,
               arrivals: torch.Tensor | None = None, act_fp8: bool = False, deterministic: bool = False
               ) -> torch.Tensor:
    """See module docstring; `impl` "torch" or "triton". `arrivals`: an `arrival_counters` buffer,
    used by one product at a time (products on it run in stream order); without it the counters
    are zero-filled per call. `act_fp8`: W8A8, x quantised per 128 along K first (`act_quant`).
    `deterministic`: every M through one kernel and configuration (`deterministic_product`)."""
    rows = x.numel() // x.shape[-1] // (groups if groups > 1 else 1)
    if check_impl(impl) == "torch":
        return reference(act_quant.fake_quantize(x, impl) if act_fp8 else x, weight, scale, groups)
    K = weight.shape[1]
    N = weight.shape[0] // groups
    if deterministic:
        x3 = x.reshape(-1, 1, K) if groups == 1 else x
        out = deterministic_product(x3 if x3.stride(-1) == 1 else x3.contiguous(), weight, scale, arrivals, act_fp8)
        return out.view(*x.shape[:-1], N) if groups == 1 else out
    if act_fp8 and fp8_cublas.applies(rows, N, K, x.device, groups, prefill=rows > KERNEL_MAX_M):
        out = fp8_cublas.product(x.reshape(rows, groups * K), weight, scale, groups)
        return out.view(*x.shape[:-1], N) if groups == 1 else out
    if rows > KERNEL_MAX_M:
        return dense_product(act_quant.fake_quantize(x, impl) if act_fp8 else x, weight, scale, groups)
    if groups == 1:
        lead = x.shape[:-1]
        x3 = x.reshape(-1, 1, K)
    else:
        lead = None
        x3 = x
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if act_fp8 and x3.shape[0] <= INLINE_QUANT_MAX_M:
        out = decode_product(x3, weight, scale, arrivals, out_dtype=x.dtype, quantize_x=True)
    elif act_fp8:
        codes, x_scale = act_quant.quantize(x3, impl)
        out = decode_product(codes, weight, scale, arrivals, out_dtype=x.dtype, x_scale=x_scale)
    else:
        out = decode_product(x3, weight, scale, arrivals)
    return out.view(*lead, N) if lead is not None else out


def deterministic_product(x3: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          arrivals: torch.Tensor | None, act_fp8: bool,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_linear` under `--deterministic`: x3 [M, G, K] (unit stride along K) through one decode
    kernel and one configuration for every M (`decode_config(..., deterministic=True)`: its K split
    follows the weight's shape alone), in slices of `KERNEL_MAX_M` rows (the arrival counters' and
    split partials' size; a row's products do not depend on its slice). No cuBLAS and no in-kernel
    quantisation: W8A8 inputs are quantised by `act_quant` for every M (the same codes). The output
    in `out_dtype` (default x3's)."""
    M, groups, K = x3.shape
    out_dtype = out_dtype or x3.dtype
    N = weight.shape[0] // groups
    cfg = decode_config(M, N, K, groups, a8=act_fp8, deterministic=True)
    codes, x_scale = act_quant.quantize(x3, "triton") if act_fp8 and M else (x3, None)
    if M <= KERNEL_MAX_M:
        return decode_product(codes, weight, scale, arrivals, cfg, out_dtype=out_dtype, x_scale=x_scale)
    out = torch.empty(M, groups, N, device=x3.device, dtype=out_dtype)
    for lo in range(0, M, KERNEL_MAX_M):
        hi = min(M, lo + KERNEL_MAX_M)
        out[lo:hi] = decode_product(codes[lo:hi], weight, scale, arrivals, cfg, out_dtype=out_dtype,
                                    x_scale=None if x_scale is None else x_scale[lo:hi])
    return out


def dense_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """`reference`'s product by dequantising the weight once (one pass) and calling cuBLAS."""
    w = dequantize(weight, scale, x.dtype)
    if groups == 1:
        return torch.nn.functional.linear(x, w)
    # group g's [N, M] product in one batched GEMM; returned as the [M, G, N] view of [G, N, M],
    # whose flatten(1) is a (transposed) view that the next GEMM reads as it is: no permuting copy
    # of the output (the grouped wo_a of an 8K-token V4-Flash prefill: 128 MB)
    return torch.bmm(w.view(groups, w.shape[0] // groups, w.shape[1]), x.permute(1, 2, 0)).permute(2, 0, 1)


def decode_product(x3: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, arrivals: torch.Tensor | None,
                   cfg: dict | None = None, out_dtype: torch.dtype | None = None,
                   x_scale: torch.Tensor | None = None, quantize_x: bool = False) -> torch.Tensor:
    """x3 [M, G, K] (unit stride along K) · weight [G·N, K] → [M, G, N] in `out_dtype` (default
    x3's) with a decode kernel; `scale` float or UE8M0 bytes (uint8, as `PackedExperts` stores
    them); `cfg` (a `decode_config`) overrides the choice (benchmarks). W8A8 (`_fp8_a8_kernel`)
    when x3 is e4m3 with `x_scale` fp32 [M, G, ⌈K/128⌉] (`act_quant.quantize`), or with
    `quantize_x` when x3 is bf16: the kernel quantises its tiles itself, to the same codes."""
    M, groups, K = x3.shape
    N = weight.shape[0] // groups
    a8 = x_scale is not None or quantize_x
    if quantize_x:
        x_scale = x3[:, :, :1]  # unread: the kernel computes the scales (strides only)
    # launch options first, so that a given `cfg` may override them (benchmarks/research/pdl_probe.py)
    cfg = {**launch_options(x3), **(cfg or decode_config(M, N, K, groups, a8=a8))}
    kernel = _fp8_a8_kernel if a8 else _fp8_gemm_kernel if "BLOCK_M" in cfg else _fp8_swap_kernel
    split = cfg["SPLIT_K"]
    out = torch.empty(M, groups, N, device=x3.device, dtype=out_dtype or (torch.bfloat16 if a8 else x3.dtype))
    if scale.dtype not in (torch.uint8, torch.float32):  # the kernels read UE8M0 bytes or fp32
        scale = scale.float()
    tiles = triton.cdiv(M, cfg.get("BLOCK_M", cfg.get("BLOCK_T"))) * triton.cdiv(N, cfg["BLOCK_N"])
    # split K: each split writes its own fp32 partial and counts its arrival per output tile; the
    # last to arrive sums the partials in split order (deterministic, unlike atomic adds) and
    # writes the output: one launch, where a torch sum and cast after it would be two more per GEMM
    part = torch.empty(split * M * groups * N if split > 1 else 1, device=x3.device, dtype=torch.float32)
    if split == 1:
        arrivals = torch.empty(1, device=x3.device, dtype=torch.int32)  # unread: no fill launch
    elif arrivals is None or arrivals.numel() < tiles * groups:
        arrivals = torch.zeros(tiles * groups, device=x3.device, dtype=torch.int32)
    if kernel is _fp8_swap_kernel:
        cfg.update(EVEN_K=K % BLOCK == 0, ASM=x3.is_cuda)
    if M and a8:
        # TMA: the weight tiles through the bulk tensor copy engine, where its descriptor can hold
        # the weight (16-byte aligned base and rows); else the same tiles by plain loads
        cfg["TMA"] = bool(cfg.get("TMA")) and weight.stride(1) == 1 and (weight.stride(0) % 16 == 0
                                                                          and weight.data_ptr() % 16 == 0)
        w = TensorDescriptor.from_tensor(weight, [cfg["BLOCK_N"], BLOCK]) if cfg["TMA"] else weight
        # promotion by one factor a token above one token tile, where it is faster; at one token
        # it is slower (benchmarks/research/fp8_gemm_bench.py --variants a8)
        cfg["UNIFORM_SW"] = cfg.get("UNIFORM_SW", M > TOKENS_M_MAX) and uniform_weight_scale(N, cfg["BLOCK_N"])
        kernel[(tiles, groups, split)](
            x3, x_scale, w, scale, out, part, arrivals, M, N, K,
            x3.stride(0), x3.stride(1), x_scale.stride(0), x_scale.stride(1), weight.stride(0), scale.stride(0),
            out.stride(0), out.stride(1), M * groups * N, BLOCK_K=BLOCK, QUANT_X=quantize_x, **cfg)
    elif M:
        kernel[(tiles, groups, split)](
            x3, weight, scale, out, part, arrivals,
            M, N, K,
            x3.stride(0), x3.stride(1), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
            M * groups * N, BLOCK_K=BLOCK, **cfg)
    return out


def uniform_weight_scale(N: int, block_n: int) -> bool:
    """Whether every tile of `block_n` rows of a weight of groups of N rows lies inside one 128-row
    scale block: block_n divides 128 and N, so tiles start at multiples of block_n and never cross
    a multiple of 128. `_fp8_a8_kernel` then promotes with one factor per token (`UNIFORM_SW`)."""
    return BLOCK % block_n == 0 and N % block_n == 0


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`reference_dequantize` in one pass (1 byte read, 2 written per weight: the torch version's
    fp32 temporaries cost ~7× the traffic, a measurable share of a prefill)."""
    rows, k = weight.shape
    out = torch.empty(rows, k, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(rows, 64), triton.cdiv(k, BLOCK))
    _dequantize_kernel[grid](weight, scale.float() if scale.dtype != torch.float32 else scale, out, rows, k,
                             weight.stride(0), scale.stride(0), out.stride(0), BR=64, BK=BLOCK,
                             **launch_options(weight))
    return out


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, R, K, stride_w, stride_s, stride_o, BR: tl.constexpr, BK: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    kb = tl.program_id(1)
    c = kb * BK + tl.arange(0, BK)
    mask = (r < R)[:, None] & (c < K)[None, :]
    w = tl.load(w_ptr + r[:, None] * stride_w + c[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + (r // BK) * stride_s + kb, mask=r < R, other=0.0)  # BR divides the 128-row block
    tl.store(out_ptr + r[:, None] * stride_o + c[None, :], (w.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask)


# `--deterministic`: one configuration for every M (`decode_config`): the weights-as-M kernels'
# 64-token tiles (one tile for a decode batch) against 64 weight rows, K split by the weight's
# shape alone, as the decode heuristic splits it at one token tile
DETERMINISTIC_TILES = {"BLOCK_T": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def decode_config(M: int, N: int, K: int, groups: int, a8: bool = False, deterministic: bool = False,
                  **tiles) -> dict:
    """Kernel and tiles of a decode-size product by shape (no autotuning: deterministic and
    capturable in graphs); `tiles` overrides the choice (benchmarks), the K split follows it.
    `_fp8_gemm_kernel`'s configurations hold BLOCK_M (token rows), `_fp8_swap_kernel`'s and
    `_fp8_a8_kernel`'s (`a8`: weights as M at every row count) BLOCK_T. `deterministic`: the
    same configuration for every M (`DETERMINISTIC_TILES`, the K split a function of N, K and
    groups only, no TMA switch, the W8A8 promotion by the outer product of scales): a row's sums
    then run in one order whatever M."""
    if deterministic:
        cfg = {**DETERMINISTIC_TILES, **({"TMA": False, "UNIFORM_SW": False} if a8 else {}), **tiles}
        n_tiles = triton.cdiv(N, cfg["BLOCK_N"]) * groups
        k_blocks = triton.cdiv(K, BLOCK)
        split = 1
        while n_tiles * split * 2 <= 264 and k_blocks // (split * 2) >= 2:
            split *= 2
        return {"SPLIT_K": split, **cfg}
    if not a8 and ("BLOCK_M" in tiles or (M <= TOKENS_M_MAX and "BLOCK_T" not in tiles)):
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4, **tiles}
        rows = cfg["BLOCK_M"]
    else:
        # 64-row weight tiles unless a product has >= 512 of them (~4 waves of 132 SMs): then
        # 128, which halves how often the activations are read; with fewer tiles the larger ones
        # leave SMs idle
        bt = max(16, min(triton.next_power_of_2(M), 64))
        if a8 and M > 32 and N * groups <= 1024:
            # W8A8, narrow outputs: twice the token tiles, more programs for a product of few
            # output tiles
            bt = 32
        # 128-row weight tiles from 512 output tiles, W8A8 from 256, where the larger tile pays for
        # it already (benchmarks/research/fp8_gemm_bench.py)
        bn = 128 if triton.cdiv(M, bt) * triton.cdiv(N, 64) * groups >= (256 if a8 else 512) else 64
        # W8A8 above one token tile: the weight tiles by TMA, faster there and no faster at 1 or 16
        # rows (benchmarks/research/fp8_gemm_bench.py variants a8_kernel+TMA=1 and a8+TMA=1)
        tma = a8 and M > TOKENS_M_MAX
        cfg = {"BLOCK_T": bt, "BLOCK_N": bn, "num_warps": 4, "num_stages": 3, **({"TMA": True} if tma else {}),
               **tiles}
        rows = cfg["BLOCK_T"]
    n_tiles = triton.cdiv(M, rows) * triton.cdiv(N, cfg["BLOCK_N"]) * groups
    k_blocks = triton.cdiv(K, BLOCK)
    split = 1
    # spread K over programs until ~2 waves of 132 SMs: wq_a (N 1024) has 16 output tiles of 64
    # rows at up to 64 tokens
    while n_tiles * split * 2 <= 264 and k_blocks // (split * 2) >= 2:
        split *= 2
    # W8A8 of one token tile: programs of at most 8 K blocks, past the two waves: their latency,
    # not the wave count, bounds these programs (benchmarks/research/fp8_gemm_bench.py, a8+split=x2).
    while a8 and M <= TOKENS_M_MAX and k_blocks > 8 * split:
        split *= 2
    return {"SPLIT_K": split, **cfg}


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K,
                     stride_xm, stride_xg, stride_w, stride_s, stride_ym, stride_yg, stride_part,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    pid = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // n_tiles, pid % n_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = g * N + offs_n  # weight rows of this group
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(K, BLOCK_K)
    for i in range(0, tl.cdiv(k_blocks - split, SPLIT_K)):
        kb = split + i * SPLIT_K
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * stride_xg + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        s = _scale_values(s_ptr, rows, kb, stride_s, mask_n)
        part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        acc += part * s[None, :]
    tile = offs_m[:, None] * stride_ym + g * stride_yg + offs_n[None, :]
    _store_tile(acc, y_ptr, part_ptr, cnt_ptr + pid * tl.num_programs(1) + g, tile,
                mask_m[:, None] & mask_n[None, :], split, stride_part, SPLIT_K)


@triton.jit
def _store_tile(acc, y_ptr, part_ptr, cnt_ptr, tile, mask, split, stride_part, SPLIT_K: tl.constexpr):
    """Stores an output tile (offsets `tile` into y [M, G, N]): directly, or with split K as this
    split's fp32 partial (partials [SPLIT_K, M, G, N]), the last split to count its arrival at
    `cnt_ptr` summing all partials in split order and storing the tile. The first barrier orders
    every thread's stores before the counter's release; the acquire orders the last program's
    loads after it."""
    if SPLIT_K == 1:
        tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * stride_part + tile, acc, mask=mask, cache_modifier=".cg")
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for j in range(SPLIT_K):
                total += tl.load(part_ptr + j * stride_part + tile, mask=mask, other=0.0, cache_modifier=".cg")
            # every program of the tile has counted: the counter goes back to zero for the next product
            tl.store(cnt_ptr, 0)
            tl.store(y_ptr + tile, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_values(s_ptr, rows, kb, stride_s, mask_n):
    """fp32 scales [BN] of the rows' 128×128 blocks at K block kb, from fp32 or from UE8M0 bytes
    (the shared expert's, as `PackedExperts` stores them): 2^(byte - 127) built from its bits,
    exact (byte 0, 2^-127, reads as 0: a subnormal scale no checkpoint uses). Converted here, a
    product of the shared expert needs no torch launches on its scales first."""
    if s_ptr.dtype.element_ty == tl.uint8:
        b = tl.load(s_ptr + (rows // 128) * stride_s + kb, mask=mask_n, other=0)
        s = (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.load(s_ptr + (rows // 128) * stride_s + kb, mask=mask_n, other=0.0)
    return s


@triton.jit
def _scale_bytes(s_ptr, rows, kb, stride_s, mask_n):
    """UE8M0 bytes [BN] of the rows' 128×128 scale blocks at K block kb: read as they are, or from
    float scales, which are powers of two, as the float's biased exponent."""
    if s_ptr.dtype.element_ty == tl.uint8:
        b = tl.load(s_ptr + (rows // 128) * stride_s + kb, mask=mask_n, other=127)
    else:
        s = tl.load(s_ptr + (rows // 128) * stride_s + kb, mask=mask_n, other=1.0)
        b = ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
    return b


@triton.jit
def _weight_tile(M, N, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's output tile in the weights-as-M kernels: (program, group, K split, weight row
    offsets within the group [BLOCK_N], token offsets [BLOCK_T], weight rows, their masks)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    offs_n, offs_t, rows, mask_n, mask_t = _tile_offsets(pid, g, M, N, BLOCK_N, BLOCK_T)
    return pid, g, tl.program_id(2), offs_n, offs_t, rows, mask_n, mask_t


@triton.jit
def _tile_offsets(pid, g, M, N, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Output tile `pid` of group g: (weight row offsets within the group [BLOCK_N], token offsets
    [BLOCK_T], weight rows, their masks)."""
    t_tiles = tl.cdiv(M, BLOCK_T)
    pid_n, pid_t = pid // t_tiles, pid % t_tiles  # a weight tile's token tiles run side by side: one DRAM read
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    return offs_n, offs_t, g * N + offs_n, offs_n < N, offs_t < M


@triton.jit
def _fp8_swap_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K,
                     stride_xm, stride_xg, stride_w, stride_s, stride_ym, stride_yg, stride_part,
                     BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """yᵀ tile [BLOCK_N, BLOCK_T] = W[rows] · xᵀ: the weight tile is the MMA's register operand,
    dequantised in registers with its block scale folded in, so the products chain in one
    accumulator (no per-step scale pass)."""
    wait(PDL)
    pid, g, split, offs_n, offs_t, rows, mask_n, mask_t = _weight_tile(M, N, BLOCK_N, BLOCK_T)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_blocks = tl.cdiv(K, BLOCK_K)
    s = _scale_bytes(s_ptr, rows, split, stride_s, mask_n)
    for i in range(0, tl.cdiv(k_blocks - split, SPLIT_K)):
        kb = split + i * SPLIT_K
        s_next = _scale_bytes(s_ptr, rows, tl.minimum(kb + SPLIT_K, k_blocks - 1), stride_s, mask_n)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * stride_w + offs_k[None, :]
        x_ptrs = x_ptr + offs_t[:, None] * stride_xm + g * stride_xg + offs_k[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=mask_t[:, None], other=0.0)
        else:
            mask_k = offs_k < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(fp8_to_bf16(w, s, ASM), tl.trans(x.to(tl.bfloat16)), acc)
        s = s_next
    tile = offs_t[None, :] * stride_ym + g * stride_yg + offs_n[:, None]  # yᵀ's tile
    _store_tile(acc, y_ptr, part_ptr, cnt_ptr + pid * tl.num_programs(1) + g, tile,
                mask_n[:, None] & mask_t[None, :], split, stride_part, SPLIT_K)


@triton.jit
def _fp8_a8_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K,
                   stride_xm, stride_xg, stride_xsm, stride_xsg, stride_w, stride_s, stride_ym, stride_yg,
                   stride_part, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, QUANT_X: tl.constexpr, TMA: tl.constexpr = False,
                   UNIFORM_SW: tl.constexpr = False, PDL: tl.constexpr = False):
    """W8A8: yᵀ tile [BLOCK_N, BLOCK_T] = W[rows] · xᵀ on the FP8 tensor cores (e4m3 × e4m3, fp32
    out), each 128-wide K step's product scaled by its weight block's scale times each token's
    scale and added to the accumulator (DeepGEMM's promotion). `UNIFORM_SW`: BLOCK_N divides 128
    and N, so the tile's rows lie in one 128-row scale block and the promotion multiplies by a
    factor per token, one FFMA an element (the outer product of row and token scales cost an FMUL
    more). No dequantisation, so it is faster than the W8A16 kernels at decode batch sizes
    (docs/results.md, decode step). `QUANT_X`: x is bf16 and each K step's tile is quantised here
    (`act_quant.quantize_blocks`; BLOCK_K is the activations' 128-wide scale block). `TMA`:
    w_ptr is a tensor descriptor of the weight and its tiles come by the bulk copy engine."""
    wait(PDL)
    a8_tile(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_xg, stride_xsm,
            stride_xsg, stride_w, stride_s, stride_ym, stride_yg, stride_part, tl.program_id(0), tl.program_id(1),
            tl.program_id(2), tl.num_programs(1), BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K, QUANT_X, TMA, UNIFORM_SW)


@triton.jit
def a8_tile(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_xg, stride_xsm,
            stride_xsg, stride_w, stride_s, stride_ym, stride_yg, stride_part, pid, g, split, groups,
            BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
            QUANT_X: tl.constexpr, TMA: tl.constexpr, UNIFORM_SW: tl.constexpr):
    """`_fp8_a8_kernel`'s work for output tile `pid` of group g (of `groups`), K split `split`: the
    kernel's, or a work item of a persistent kernel that walks the tiles itself."""
    offs_n, offs_t, rows, mask_n, mask_t = _tile_offsets(pid, g, M, N, BLOCK_N, BLOCK_T)
    row0 = g * N + (pid // tl.cdiv(M, BLOCK_T)) * BLOCK_N  # the tile's first weight row
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for kb in range(split, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if TMA:  # w_ptr: the [G·N, K] weight's descriptor (rows past the group's end are masked at the store)
            w = w_ptr.load([row0, kb * BLOCK_K])
        else:
            w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + offs_t[:, None] * stride_xm + g * stride_xg + offs_k[None, :],
                    mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        if QUANT_X:
            x, sx = quantize_blocks(x.to(tl.float32))
        else:
            sx = tl.load(xs_ptr + offs_t * stride_xsm + g * stride_xsg + kb, mask=mask_t, other=0.0)
        if UNIFORM_SW:  # the tile's rows share one scale block: a factor per token
            scale = (sx * _scale_values(s_ptr, row0, kb, stride_s, True))[None, :]
        else:
            scale = _scale_values(s_ptr, rows, kb, stride_s, mask_n)[:, None] * sx[None, :]
        acc += tl.dot(w, tl.trans(x)) * scale
    tile = offs_t[None, :] * stride_ym + g * stride_yg + offs_n[:, None]  # yᵀ's tile
    _store_tile(acc, y_ptr, part_ptr, cnt_ptr + pid * groups + g, tile, mask_n[:, None] & mask_t[None, :], split,
                stride_part, SPLIT_K)

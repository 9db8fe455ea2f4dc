"""Dense products whose rows do not depend on the batch: y = x · wᵀ in one K order for every M.

cuBLAS picks its algorithm, tile and K split by the matrix shape, so the bits of one row of
`F.linear(x, w)` change with the number of rows M. Under `--deterministic` the model's dense
float products on a GPU (the LM head, the gate, the compressors' and the indexer's bf16 products,
`invariant.Linear`, `linear_fp32_out`) run this kernel instead. A row's bits depend only on its K
order, not on which tile or tile row it lands in, nor on the tile's shape (the MMA's sums per
output element do not depend on the element's place in the tile; benchmarks/research/
deterministic_kernels_probe.py --tiles compares tile shapes bit for bit). So the K order is fixed
by K alone: `RANGE_K`-wide ranges, each summed from zero in `BLOCK_K` steps, added in order. A
product of few output tiles (a decode step's gate or compressor) gives each range its own
program and sums the partials in a second launch (`_sum_ranges_kernel`); a larger one walks the
ranges in one program; both give the same bits. Slower than cuBLAS for prefill-size products;
the mode's cost is measured by benchmarks/research/deterministic_cost_bench.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import num_sms
from model.kernels.common.pdl import launch_options, wait

BLOCK_M = 64
BLOCK_K = 64
RANGE_K = 512  # K a range: a multiple of BLOCK_K
NUM_WARPS = 4
NUM_STAGES = 3
# weight rows a tile: 128 for wide products (the LM head), 32 below `WIDE_N` rows, so that a
# narrow product (the gate's 256 rows) still spreads over several programs at one token
WIDE_N = 4096


def config(N: int) -> dict:
    """The launch configuration of every product with N weight rows, whatever its M."""
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": 128 if N >= WIDE_N else 32, "BLOCK_K": BLOCK_K, "num_warps": NUM_WARPS,
            "num_stages": NUM_STAGES}


def ranges(K: int) -> int:
    """How many K ranges a product of inner dimension K sums (`RANGE_K` each, the last one short)."""
    return max(1, triton.cdiv(K, RANGE_K))


def splits(M: int, N: int, K: int, sms: int) -> bool:
    """Whether the ranges get programs of their own: where the output tiles alone would leave
    most of the GPU idle (the choice moves no bit)."""
    cfg = config(N)
    return ranges(K) > 1 and triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]) * 2 <= sms


# what `linear`'s `tiles` may override: the tile's shape and launch options, never the K order
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
           split: bool | None = None, tiles: dict | None = None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ → [..., N] in `out_dtype` (default x's), fp32 accumulation.
    Operands of one float dtype (bf16 on the GPU; fp32 is multiplied in full fp32, not TF32).
    `split`: the ranges over programs (default: `splits`); the same bits either way. `tiles`:
    `TILE_KEYS` in place of `config`'s (probes comparing tile shapes)."""
    if tiles and not set(tiles) <= set(TILE_KEYS):
        raise ValueError(f"fixed_matmul.linear's tiles may set {TILE_KEYS}, got {sorted(tiles)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"fixed_matmul.linear needs operands of one dtype, got {x.dtype} and {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fixed_matmul.linear: x has K = {x.shape[-1]}, weight [N, K] = {tuple(weight.shape)}")
    lead, K, N = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        cfg, R = {**config(N), **(tiles or {})}, ranges(K)
        split = splits(M, N, K, num_sms(x.device)) if split is None else split and R > 1
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]), R if split else 1)
        part = torch.empty(R, M, N, dtype=torch.float32, device=x.device) if split else out
        _matmul_kernel[grid](x2, weight, part, M, N, K, x2.stride(0), weight.stride(0), N if split else out.stride(0),
                             IEEE=x.dtype == torch.float32, RANGE_K=RANGE_K, SPLIT=split, **cfg,
                             **launch_options(x2))
        if split:
            block = 1024
            _sum_ranges_kernel[(triton.cdiv(M * N, block),)](part, out, M * N, R, BLOCK=block, num_warps=4,
                                                             **launch_options(part))
    return out.view(*lead, N)


@triton.jit
def _range_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, lo, K, stride_x, stride_w, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RANGE_K: tl.constexpr, IEEE: tl.constexpr):
    """x · wᵀ over K in [lo, lo + RANGE_K) ∩ [0, K), from zero in BLOCK_K steps: [BLOCK_M, BLOCK_N] fp32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(lo, tl.minimum(lo + RANGE_K, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   RANGE_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """Output tile (program 1: rows, program 0: weight rows; a weight tile's row tiles run side by
    side) of y = x · wᵀ: SPLIT, program 2's K range into its fp32 partial y[range]; else every range
    from K = 0 up, each from zero, added in order into one fp32 sum."""
    wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m, mask_n = offs_m < M, offs_n < N
    if SPLIT:
        r = tl.program_id(2)
        total = _range_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, r * RANGE_K, K, stride_x, stride_w,
                           BLOCK_M, BLOCK_N, BLOCK_K, RANGE_K, IEEE)
        y_ptr += r.to(tl.int64) * M * N
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for lo in range(0, K, RANGE_K):
            total += _range_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, lo, K, stride_x, stride_w,
                                BLOCK_M, BLOCK_N, BLOCK_K, RANGE_K, IEEE)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], total.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_ranges_kernel(part_ptr, y_ptr, size, R, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y = Σ_r part[r] over R K ranges [R, size] fp32, from zero in range order (the walked sum's
    order), in y's dtype."""
    wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(R):
        total += tl.load(part_ptr + r * size + offs, mask=mask, other=0.0)  # split only for small products
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)

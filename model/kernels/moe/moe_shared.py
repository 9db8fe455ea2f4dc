"""The shared expert as dense products outside the expert kernels: FP8 decode GEMMs on its own
weights up to `fp8_gemm.KERNEL_MAX_M` tokens, cuBLAS on its dequantised weights above.

Every token goes through the shared expert, so for T tokens it is one [T, D] × [D, 2I] product,
the clamped SwiGLU, and one [T, I] × [I, D] product: nothing about it is grouped. Run inside the
expert kernels (the fused decode path's virtual expert E), it is T/BT token tiles of 16 that each
stream and dequantise the whole expert again; from a few dozen tokens that costs more than its
own dense products, which read its weights once. Below `DENSE_MIN_TOKENS` it stays in the
kernels, where it saves three launches, unless it can run on a side stream beside them (as
`MoE.forward` runs it on a GPU): then it runs here at every size.

Semantics are `moe_grouped.reference`'s with the kernels' two roundings: x and h in bf16, fp32
products and sums; the output is fp32 [T, D], added to the routed sum before its one rounding
(`moe_grouped.plan_kernels`' `add`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import triton
import triton.language as tl

from model import low_precision
from model.kernels.common.fp4 import FP8_BLOCK
from model.kernels.common.pdl import launch_options, wait
from model.kernels.gemm import fp8_gemm
from model.kernels.gemm.fp32_out import linear_fp32_out

if TYPE_CHECKING:
    from model.kernels.moe.packed_experts import PackedExperts

# From this many tokens the fused and grouped decode paths run the shared expert here rather than
# in their kernels; given a side stream to run on, beside the routed kernels, it pays from one
# token (on the current stream it loses at small steps). docs/results.md, fused MoE.
DENSE_MIN_TOKENS = 32
DENSE_MIN_TOKENS_BESIDE = 1


def split_shared(x: torch.Tensor, shared: "PackedExperts | None", limit: float, dense: bool | None,
                 side: "torch.cuda.Stream | None" = None, deterministic: bool = False
                 ) -> tuple["PackedExperts | None", torch.Tensor | None, Callable[[], None]]:
    """(the shared expert for the expert kernels, the output they add, join) for x [T, D]: (shared,
    None) to run it in the kernels, (None, `shared_expert`'s fp32 [T, D]) to run it here. `dense`
    None: from `DENSE_MIN_TOKENS` tokens, `DENSE_MIN_TOKENS_BESIDE` given a `side` stream. With a
    `side` stream the dense products run there, beside whatever the caller launches next, and
    `join()` makes the current stream wait for them: call it before launching what reads the output.
    `deterministic`: `shared_expert`'s."""
    if not runs_dense(x, shared, dense, beside=side is not None):
        return shared, None, _no_join
    main = torch.cuda.current_stream(x.device) if side is not None else None
    if main is None or side == main:  # (a stream from torch's pool can be the current one)
        return None, shared_expert(x, shared, limit, deterministic), _no_join
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = shared_expert(x, shared, limit, deterministic)
    out.record_stream(main)  # its memory is reused only after the current stream's use of it
    return None, out, lambda: main.wait_stream(side)


def _no_join() -> None:
    pass


def runs_dense(x: torch.Tensor, shared: "PackedExperts | None", dense: bool | None, beside: bool = False) -> bool:
    """Whether x [T, D]'s shared expert runs here (`split_shared`'s decision; `beside`: on a side stream)."""
    if dense is None:
        dense = x.shape[0] >= (DENSE_MIN_TOKENS_BESIDE if beside else DENSE_MIN_TOKENS)
    return shared is not None and dense


def shared_expert(x: torch.Tensor, shared: "PackedExperts", limit: float, deterministic: bool = False
                  ) -> torch.Tensor:
    """x [T, D] → the shared expert's output [T, D] float32 (x and h rounded to bf16, as the kernels).
    `deterministic`: every product at one configuration for every T (`fp8_gemm.deterministic_product`,
    `linear_fp32_out`'s), so a token's output does not depend on the others."""
    xb = x.to(torch.bfloat16)
    if shared.fmt == "fp8" and (deterministic or x.shape[0] <= fp8_gemm.KERNEL_MAX_M):
        I, ib = shared.inter, -(-shared.inter // FP8_BLOCK)
        w13, s13 = shared.w13[0], shared.w13_scale[0]

        def product(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            # split-K counters: `arrivals` serves one product at a time, in stream order
            if deterministic:
                return fp8_gemm.deterministic_product(a[:, None], w, s, shared.arrivals, act_fp8=False,
                                                      out_dtype=torch.float32)[:, 0]
            return fp8_gemm.decode_product(a[:, None], w, s, shared.arrivals, out_dtype=torch.float32)[:, 0]

        if I % FP8_BLOCK == 0:  # w3's scale blocks follow w1's as its rows do: one product
            gate_up = product(xb, w13, s13)
        else:  # w1's last scale block row is partial: w3's rows start a block row of their own
            gate_up = torch.cat([product(xb, w13[:I], s13[:ib]), product(xb, w13[I:], s13[ib:])], dim=1)
        return product(swiglu_bf16(gate_up, limit), shared.w2[0], shared.w2_scale[0])
    w13, w2 = _bf16_weights(shared)
    return linear_fp32_out(swiglu_bf16(linear_fp32_out(xb, w13, deterministic), limit), w2, deterministic)


def _bf16_weights(shared: "PackedExperts") -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert → (w13 [2I, D], w2 [D, I]) bf16, exact (e4m3 times a power of two), in
    one pass per matrix."""
    if shared.fmt != "fp8":
        w1, w3, w2 = (w.to(torch.bfloat16) for w in shared.dequantize(0))
        return torch.cat([w1, w3]), w2
    I, ib = shared.inter, -(-shared.inter // FP8_BLOCK)

    def dq(w: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
        return fp8_gemm.dequantize(w, low_precision.ue8m0_byte_to_scale(scale_bytes), torch.bfloat16)

    w2 = dq(shared.w2[0], shared.w2_scale[0])
    if I % FP8_BLOCK == 0:  # w3's scale blocks follow w1's as its rows do: one pass, no concatenation
        return dq(shared.w13[0], shared.w13_scale[0]), w2
    w1, w3 = dq(shared.w13[0, :I], shared.w13_scale[0, :ib]), dq(shared.w13[0, I:], shared.w13_scale[0, ib:])
    return torch.cat([w1, w3]), w2


def swiglu_bf16(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [T, 2I] float32 (gate | up) → h = silu(min(gate, L)) · clamp(up, ±L) [T, I] bf16, one
    pass (torch's clamps, silu, product and cast would take five over the fp32 [T, 2I])."""
    T, two_i = gate_up.shape
    h = torch.empty(T, two_i // 2, dtype=torch.bfloat16, device=gate_up.device)
    if T:
        bi = min(1024, triton.next_power_of_2(two_i // 2))
        _swiglu_kernel[(T, triton.cdiv(two_i // 2, bi))](gate_up, gate_up.stride(0), h, two_i // 2, float(limit),
                                                         CLAMP=limit > 0, BI=bi, num_warps=4,
                                                         **launch_options(gate_up))
    return h


@triton.jit
def _swiglu_kernel(gu_ptr, stride_gu, h_ptr, I, limit, CLAMP: tl.constexpr, BI: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = offs < I
    gate = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
    up = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(h_ptr + t * I + offs, (gate * tl.sigmoid(gate) * up).to(tl.bfloat16), mask=mask)

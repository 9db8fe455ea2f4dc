"""The combine of the unfused MoE paths: out[t] = Σ_s y[t, s] (+ add[t]), fp32 sums, one rounding.

The grouped and prefill paths' down kernel writes each (token, slot) output already weighted,
in the activations' dtype; this sums the slots and, on the prefill path, adds the shared expert's
fp32 output, rounding once as `moe_grouped.combine` (the reference) does. One pass over the slot
outputs where torch's sum, cast, upcast, add and cast take five (an 8K-token V4-Flash prefill
reads 400 MB of slot outputs per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.common.pdl import launch_options, wait


def reference(y: torch.Tensor, add: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    out = y.sum(1, dtype=torch.float32)
    return (out if add is None else out + add.float()).to(dtype)


def sum_slots(y: torch.Tensor, add: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [T, S, D] → [T, D] in `dtype` (default y.dtype); add [T, D] (fp32) joins the sum."""
    T, S, D = y.shape
    if add is not None and tuple(add.shape) != (T, D):
        raise ValueError(f"sum_slots: add has shape {tuple(add.shape)}, expected {(T, D)}")
    y = y.contiguous()
    out = torch.empty(T, D, dtype=dtype or y.dtype, device=y.device)
    if T:
        add_arg = add.contiguous() if add is not None else out
        bd = min(1024, triton.next_power_of_2(D))
        _sum_slots_kernel[(T, triton.cdiv(D, bd))](y, add_arg, out, D, S=S, BD=bd, HAS_ADD=add is not None,
                                                   num_warps=4, **launch_options(y))
    return out


@triton.jit
def _sum_slots_kernel(y_ptr, add_ptr, out_ptr, D, S: tl.constexpr, BD: tl.constexpr, HAS_ADD: tl.constexpr,
                      PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = offs < D
    acc = tl.zeros((BD,), tl.float32)
    for s in tl.static_range(S):  # slot order, as the reference sums
        acc += tl.load(y_ptr + (t * S + s) * D + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

"""Triton kernels of DeepSeek-V4, each beside the pure-torch reference it must match.

Every op is one module here exposing `op(..., impl)`: impl "torch" is the reference (plain torch,
any device; it defines the semantics) and impl "triton" the kernel (CUDA tensors on a GPU; on
the CPU it runs only under `TRITON_INTERPRET=1`, which the CPU test suite sets so that kernel
logic is tested without a GPU). Parity is tested on random data at small shapes in
`tests/model/test_kernels_*.py` (interpreter, CI) and at real shapes in `tests/gpu/` (GPU).

Kernels never synchronise with the host and keep their launch grids a function of tensor
shapes only, so a decode step built from them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

IMPLS = ("torch", "triton")


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"kernel impl must be one of {IMPLS}, got {impl!r}")
    return impl


def arrival_counter(device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed arrival counter of a one-launch kernel whose last program to arrive finishes the
    work (the mHC entry, `router.gate_route`). That program sets it back to zero, so a buffer is
    filled once; calls on one counter must run in stream order."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (launch heuristics); 4 for the CPU interpreter."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def set_impl(model, impl: str) -> None:
    """Point every module of `model` that dispatches to kernels (has an `impl`) at `impl`."""
    check_impl(impl)
    for module in model.modules():
        if hasattr(module, "impl"):
            module.impl = impl


def set_deterministic(model, deterministic: bool) -> None:
    """Point every module of `model` that dispatches to kernels by batch size (has a
    `deterministic` attribute) at one launch configuration for every batch (`deterministic`) or at
    the fastest for each (the default). Under it a row's logits are the same bits whatever else
    shares its step, whatever the step's size or chunking (docs/gpu.md, "--deterministic"). Set it
    after `quantize_model` and `Attention.fuse_products`, which make new modules; the torch
    reference path is batch-invariant either way."""
    for module in model.modules():
        if hasattr(module, "deterministic"):
            module.deterministic = bool(deterministic)

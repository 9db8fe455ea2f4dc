"""Programmatic dependent launch (PDL): a decode step's kernels launched while their predecessor drains.

On Hopper and later a kernel launched with `launch_pdl` may start before the previous kernel in
its stream has finished: the hardware schedules its programs as the predecessor's last programs
exit, instead of after the predecessor's completion and memory flush. The kernel's first
statement (`wait`) then blocks until that predecessor has completed and its writes are visible,
so nothing the kernel reads or writes is touched earlier: a wait-only use, with no early trigger
(`gdc_launch_dependents`). An early trigger would let waiting programs take SM slots that a
multi-wave predecessor's last wave still needs, which is slower (benchmarks/research/pdl_probe.py).

Waiting transitively orders everything: a kernel waits for its predecessor, which waited for its
own, so a kernel never sees less than stream order gives. Kernels of other libraries (cuBLAS,
torch) neither trigger nor wait; a PDL kernel after one of them starts as it drains, as after any
other. Captured in a CUDA graph, the launch attribute becomes a programmatic edge.

Every kernel of the decode step takes `PDL: tl.constexpr = False` and calls `wait(PDL)` first;
its launch site adds `**launch_options(t)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def launch_options(t: torch.Tensor) -> dict:
    """Launch options for a kernel on `t`'s device: `PDL` and `launch_pdl` on a CUDA device of
    compute capability 9.0 or later, nothing elsewhere (the CPU interpreter, older GPUs)."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Blocks until the stream's previous kernel has completed and flushed its writes (a kernel's
    first statement; a no-op when the kernel was not launched with `launch_pdl`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()

"""Copying many spans between device buffers in one kernel launch.

A hand-off is a handful of coalesced spans (one per pool when pages are contiguous on both
sides) or, when streaming a layer at a time, hundreds of small ones (one per page and layer).
The copy engine moves a few large spans at full link speed, but each `copy_` costs a launch and
an engine setup (~5-10 µs, serialised on one stream), which dominates many small spans. So:

* `impl="torch"`: one `copy_` per span (the copy engine; the reference);
* `impl="triton"`: every span cut into chunks of at most `chunk_bytes`, the chunk table (source,
  destination, length) sent to the device in one small copy, and one kernel moving them all, each
  program one chunk with 16-byte loads and stores. Destinations may be peer memory mapped into
  this device's context (CUDA IPC): the SMs' stores then go over NVLink;
* `impl="auto"`: the kernel for many small spans, the copy engine otherwise (on 2×H200 the
  kernel's SM stores moved a V4-Flash hand-off of 7 spans, 47-520 MB, at ~38% of the bandwidth of
  one big copy through the copy engine: large spans stay on the engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from .regions import Span

CHUNK_BYTES = 128 << 10
BLOCK = 1024  # words per loop step of a program
KERNEL_MIN_SPANS = 16  # `auto` takes the kernel from this many spans ...
KERNEL_MAX_MEAN_BYTES = 1 << 20  # ... when they average less than this


def copy_spans(local: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor],
               spans: Sequence[tuple[str, Span]], impl: str = "auto", chunk_bytes: int = CHUNK_BYTES) -> None:
    """remote[kind][dst:dst+n] <- local[kind][src:src+n] for each (kind, span), on the current
    stream. local / remote: flat uint8 tensors on one CUDA device (remote may be peer-mapped)."""
    if not spans:
        return
    if impl == "auto":
        many_small = (len(spans) >= KERNEL_MIN_SPANS
                      and sum(s.nbytes for _, s in spans) / len(spans) < KERNEL_MAX_MEAN_BYTES)
        impl = "triton" if many_small else "torch"
    if impl == "torch":
        for kind, s in spans:
            remote[kind][s.dst_offset:s.dst_offset + s.nbytes].copy_(
                local[kind][s.src_offset:s.src_offset + s.nbytes], non_blocking=True)
        return
    rows, align = [], 16
    for kind, s in spans:
        src, dst = local[kind].data_ptr() + s.src_offset, remote[kind].data_ptr() + s.dst_offset
        for off in range(0, s.nbytes, chunk_bytes):
            n = min(chunk_bytes, s.nbytes - off)
            rows.append((src + off, dst + off, n))
            while align > 1 and ((src + off) % align or (dst + off) % align or n % align):
                align //= 2
    word = {16: torch.int64, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[align]
    base = next(iter(local.values()))
    base = base[: base.numel() // word.itemsize * word.itemsize].view(word)
    # addresses as word offsets from one real tensor argument: the compiler then knows their
    # alignment and emits 16-byte loads and stores (an integer cast to a pointer hides it)
    b, w = base.data_ptr(), word.itemsize
    table = torch.tensor([((src - b) // w, (dst - b) // w, n // w) for src, dst, n in rows],
                         dtype=torch.int64).to(base.device, non_blocking=True)
    _copy_kernel[(len(rows),)](base, table, ALIGN_WORDS=max(1, align // w), BLOCK=BLOCK, num_warps=8)


@triton.jit
def _copy_kernel(base_ptr, table_ptr, ALIGN_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    src = tl.multiple_of(tl.load(table_ptr + 3 * row), ALIGN_WORDS)
    dst = tl.multiple_of(tl.load(table_ptr + 3 * row + 1), ALIGN_WORDS)
    n = tl.load(table_ptr + 3 * row + 2)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        idx = start + offs
        mask = idx < n
        v = tl.load(base_ptr + src + idx, mask=mask)
        tl.store(base_ptr + dst + idx, v, mask=mask)

"""Copying many spans between device buffers in one kernel launch.

A hand-off is a handful of coalesced spans (one per pool when pages are contiguous on both
sides) or, when streaming a layer at a time, hundreds of small ones (one per page and layer).
The copy engine moves a few large spans at full link speed, but each `copy_` costs a launch and
an engine setup (serialised on one stream), which dominates many small spans. So:

* `impl="torch"`: one `copy_` per span (the copy engine; the reference);
* `impl="triton"`: every span cut into chunks of at most `chunk_bytes`, the chunk table (source,
  destination, length) sent to the device in one small copy, and one kernel moving them all, each
  program one chunk with 16-byte loads and stores. Destinations may be peer memory mapped into
  this device's context (CUDA IPC): the SMs' stores then go over NVLink;
* `impl="memcpy"`: the copy engine too, one `cudaMemcpyAsync` per span called directly (ctypes,
  the runtime torch loaded): what `copy_` ends in, at a fraction of its host cost;
* `impl="auto"`: the kernel for many small spans, the copy engine otherwise (memcpy where the
  runtime was found, else torch): the SMs' stores reach well under the copy engine's bandwidth on
  large spans, so those stay on the engine (docs/results.md, KV hand-off).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .regions import Span, SpanBatch, as_batch

CHUNK_BYTES = 128 << 10
BLOCK = 1024  # words per loop step of a program
KERNEL_MIN_SPANS = 16  # `auto` takes the kernel from this many spans ...
KERNEL_MAX_MEAN_BYTES = 1 << 20  # ... when they average less than this
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def copy_spans(local: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor],
               spans: SpanBatch | Sequence[tuple[str, Span]], impl: str = "auto",
               chunk_bytes: int = CHUNK_BYTES, engine: str = "memcpy") -> str:
    """remote[kind][dst:dst+n] <- local[kind][src:src+n] for each span, on the current stream.
    local / remote: flat uint8 tensors on one CUDA device (remote may be peer-mapped).
    engine: what "auto" uses for a few large spans, "memcpy" (where available) or "torch".
    Returns the implementation that ran ("memcpy", "torch", "triton"; "" for no spans)."""
    batch = as_batch(spans)
    if not batch.count:
        return ""
    if impl == "auto":
        many_small = (batch.count >= KERNEL_MIN_SPANS
                      and batch.nbytes / batch.count < KERNEL_MAX_MEAN_BYTES)
        cuda = next(iter(local.values())).is_cuda
        direct = engine == "memcpy" and cuda and memcpy_available()
        impl = "triton" if many_small else "memcpy" if direct else "torch"
    if impl == "memcpy":
        _copy_memcpy(local, remote, batch)
    elif impl == "torch":
        src = [local[k] for k in batch.kinds]
        dst = [remote[k] for k in batch.kinds]
        for k, s, d, n in batch.rows.tolist():
            dst[k][d:d + n].copy_(src[k][s:s + n], non_blocking=True)
    else:
        _copy_triton(local, remote, batch, chunk_bytes)
    return impl


def _copy_memcpy(local, remote, batch: SpanBatch) -> None:
    """One cudaMemcpyAsync per span straight from the cached pool addresses: the same call torch's
    copy_ ends in, without building two tensor views and a TensorIterator per span (which makes
    torch's host time per span several times this call's)."""
    memcpy = _memcpy_async()
    stream = torch.cuda.current_stream().cuda_stream
    src = [local[k].data_ptr() for k in batch.kinds]
    dst = [remote[k].data_ptr() for k in batch.kinds]
    for k, s, d, n in batch.rows.tolist():
        err = memcpy(dst[k] + d, src[k] + s, n, _DEVICE_TO_DEVICE, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err}")


def memcpy_available() -> bool:
    return _memcpy_async() is not None


@functools.cache
def _memcpy_async():
    """cudaMemcpyAsync of the CUDA runtime torch loaded (found in this process's mappings; the
    one of torch's CUDA major version if several are loaded), or None (no CUDA runtime loaded,
    or linked statically): then copies go through torch."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        major = f"libcudart.so.{(torch.version.cuda or '').split('.')[0]}"
        for path in sorted(paths, key=lambda p: major not in p):
            fn = ctypes.CDLL(path).cudaMemcpyAsync
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p]
            return fn
    except (OSError, AttributeError):
        pass
    return None


def _copy_triton(local, remote, batch: SpanBatch, chunk_bytes: int) -> None:
    # rows of (source address, destination address, length), every span cut into chunks
    spans, kinds = batch.rows, batch.kinds
    src = spans[:, 1] + np.array([local[k].data_ptr() for k in kinds], dtype=np.int64)[spans[:, 0]]
    dst = spans[:, 2] + np.array([remote[k].data_ptr() for k in kinds], dtype=np.int64)[spans[:, 0]]
    pieces = -(-spans[:, 3] // chunk_bytes)                   # chunks per span
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)     # first chunk index of its span
    off = (np.arange(int(pieces.sum())) - first) * chunk_bytes
    n = np.repeat(spans[:, 3], pieces)
    rows = np.stack([np.repeat(src, pieces) + off, np.repeat(dst, pieces) + off,
                     np.minimum(chunk_bytes, n - off)], axis=1)
    align = 16
    while align > 1 and (rows % align).any():
        align //= 2
    word = {16: torch.int64, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[align]
    base = next(iter(local.values()))
    base = base[: base.numel() // word.itemsize * word.itemsize].view(word)
    # addresses as word offsets from one real tensor argument: the compiler then knows their
    # alignment and emits 16-byte loads and stores (an integer cast to a pointer hides it)
    w = word.itemsize
    rows[:, :2] -= base.data_ptr()
    table = torch.from_numpy(rows // w).to(base.device, non_blocking=True)
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

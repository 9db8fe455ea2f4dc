"""The two ceilings every GPU benchmark reports against, measured in the same run (METHOD: never
trust datasheets): device-to-device copy bandwidth (bytes read + written per second) and the
dense bf16 matmul rate (8192³ on random data). Both through torch, timed with CUDA events."""

from __future__ import annotations

import time

import torch


def bench(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median seconds of `fn()` timed with CUDA events (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def host_ms(fn, reps: int = 20) -> float:
    """Median host wall milliseconds of `fn()`, the GPU (if any) idle before each call."""
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls of `fn()` (run first outside the capture, on a
    side stream as capture wants, to compile and allocate)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def bench_graph(fn, calls: int = 10, reps: int = 10) -> float:
    """Median seconds per call of `fn()` replayed from a CUDA graph of `calls` back-to-back calls:
    GPU time without the host's launch overhead (how decode steps run, and what a kernel costs)."""
    return bench(capture(fn, calls).replay, warmup=2, reps=reps) / calls


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes per second of a large D2D copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), reps=10)
    del src, dst
    return 2 * nbytes / t


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n³ matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: a @ b, reps=10)
    return 2 * n ** 3 / t


def ceilings() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count, "copy_bytes_per_s": copy_bandwidth(),
            "bf16_flops": matmul_rate()}

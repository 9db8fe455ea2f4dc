"""kvtransfer over CUDA memory (VRAM) with real NIXL/UCX: GPU0 -> GPU1 when there are two GPUs,
else GPU0 -> GPU0 between two processes. Checks bit-exactness and that checksums computed on
the GPU equal those of the same bytes on the CPU."""

import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
for _p in (str(_ROOT), str(_ROOT / "tests" / "kvtransfer")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_pair():
    pytest.importorskip("nixl")
    from kvt_harness import Worker, connect, start

    dst = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    a, b = start(Worker("gpu-prefill", device="cuda:0", seed=1, progress_thread=True),
                 Worker("gpu-decode", device=dst, seed=2, progress_thread=True))
    connect(a, b)
    yield a, b
    a.close()
    b.close()


def _events(w, *want, timeout=30.0):
    evs = w.call("events", list(want), timeout, timeout=timeout + 10)
    got = {e[:3] for e in evs}
    assert all(x in got for x in want), evs
    return evs


def test_cuda_pages_bit_exact_and_checksums_match_cpu(gpu_pair):
    from kvtransfer import FaultPlan

    a, b = gpu_pair
    explicit = {"swa": [0, 1], "c4": [9, 3, 4, 5, 20, 21], "c128": [7, 8, 9, 10],
                "state_c4": [30]}
    src = a.call("prepare", "g1", explicit=explicit)
    want = {k: a.call("digest", k, ids) for k, ids in src.items()}
    for kind, ids in src.items():
        on_gpu, on_cpu = a.call("checksums", kind, ids)
        assert on_gpu == on_cpu, kind
    target = b.call("reserve", "g1", {k: len(v) for k, v in src.items()}, 30.0)
    a.call("send", target, "g1")
    a.call("finish", target, b"gpu")
    _events(b, ("receiver", "g1", "ready"))
    assert b.call("claim", "g1") == want
    _events(a, ("sender", "g1", "acked"))

    # a byte flipped on the GPU after the write is caught by the GPU checksum
    b.call("rebuild", None, FaultPlan(corrupt_after_write=True))
    try:
        a.call("prepare", "g2", counts={"c4": 3})
        target = b.call("reserve", "g2", {"c4": 3}, 30.0)
        a.call("send", target, "g2")
        a.call("finish", target, b"")
        evs = _events(b, ("receiver", "g2", "corrupt"))
        assert "ready" not in [e[2] for e in evs]
        b.call("release", "g2")
        _events(a, ("sender", "g2", "rejected"))
    finally:
        b.call("rebuild", None, None)
    for w in (a, b):
        st = w.call("settle", 10.0)
        assert st["free"] == st["total"]


@pytest.mark.parametrize("page_bytes", [4096, 1168, 23360, 784896, 1026])
def test_fused_checksum_matches_torch_and_cpu(page_bytes):
    from kvtransfer.checksum import checksum_torch, page_checksum

    g = torch.Generator().manual_seed(page_bytes)
    cpu = torch.randint(0, 256, (24, page_bytes), dtype=torch.uint8, generator=g)
    gpu = cpu.cuda()
    for ids in ([3], list(range(5, 21)), [17, 2, 9, 9, 0, 23]):
        want = int(checksum_torch(cpu, ids))
        assert page_checksum(gpu, ids) == want                 # fused kernel where it applies
        assert int(checksum_torch(gpu, ids)) == want           # torch ops on the GPU
    ids = [4, 11, 7]
    base = page_checksum(gpu, ids)
    for page in ids:
        for byte in (0, 3, page_bytes // 2, 4 * 4096 - 1, 4 * 4096, page_bytes - 1):
            if byte >= page_bytes:
                continue
            bad = gpu.clone()
            bad[page, byte] ^= 0x10
            assert page_checksum(bad, ids) != base, (page, byte)

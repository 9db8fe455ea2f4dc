"""kvtransfer over CUDA memory (VRAM) between two processes: GPU0 -> GPU1 when there are two
GPUs, else GPU0 -> GPU0. Both workers are on one host, so writes take the CUDA IPC path (peer
copies; notifications over NIXL); one test turns it off to cover UCX. Checks bit-exactness, that
checksums computed on the GPU equal those of the same bytes on the CPU, that corrupt and
truncated writes are caught on either path, and that a restarted peer is mapped afresh."""

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
    assert a.call("transport", "gpu-decode") == "cuda_ipc", a.call("paths")
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
    paths = a.call("paths")
    assert paths["writes"]["cuda_ipc"] >= 1 and paths["writes"]["ucx"] == 0, paths
    assert paths["ipc"]["maps"] == 1 and paths["ipc"]["map_failures"] == 0, paths
    print("mapping:", paths["ipc"]["modes"])

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


def _settle(*workers):
    for w in workers:
        st = w.call("settle", 10.0)
        assert st["free"] == st["total"], (w.name, st)


def test_ipc_streamed_layers_bit_exact_and_truncation_caught(gpu_pair):
    from kvtransfer import FaultPlan, layer_byte_range

    from kvt_harness import KINDS, LAYER_MAP

    a, b = gpu_pair
    before = a.call("paths")["writes"]["cuda_ipc"]
    src = a.call("prepare", "s1", explicit={"c4": [2, 3, 4, 11], "swa": [5]})
    want = {k: a.call("digest", k, ids) for k, ids in src.items()}
    target = b.call("reserve", "s1", {k: len(v) for k, v in src.items()}, 30.0)
    sends = 0
    for kind in src:                             # stream every page layer by layer
        n = len(dict(LAYER_MAP)[kind])
        for layer in range(n):
            a.call("send", target, "s1", layer_byte_range(KINDS[kind], n, layer), [kind])
            sends += 1
    a.call("finish", target, b"streamed")
    _events(b, ("receiver", "s1", "ready"))
    assert b.call("claim", "s1") == want
    _events(a, ("sender", "s1", "acked"))
    assert a.call("paths")["writes"]["cuda_ipc"] == before + sends

    a.call("rebuild", FaultPlan(truncate_write=0.5), None)
    try:
        a.call("prepare", "s2", counts={"c4": 4, "c128": 2})
        target = b.call("reserve", "s2", {"c4": 4, "c128": 2}, 30.0)
        a.call("send", target, "s2")
        a.call("finish", target, b"")
        evs = _events(b, ("receiver", "s2", "corrupt"))
        assert "ready" not in [e[2] for e in evs if e[1] == "s2"]
        b.call("release", "s2")
        _events(a, ("sender", "s2", "rejected"))
    finally:
        a.call("rebuild", None, None)
    _settle(a, b)


def test_ipc_peer_restart_forces_remap(gpu_pair):
    from kvt_harness import Worker, WorkerError, connect, start

    a, _ = gpu_pair
    dst = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    (r1,) = start(Worker("gpu-decode-r", device=dst, seed=5, progress_thread=True))
    r2 = None
    try:
        connect(a, r1)
        base = a.call("paths")
        src = a.call("prepare", "p1", counts={"c4": 3})
        t1 = r1.call("reserve", "p1", {"c4": 3}, 30.0)
        a.call("send", t1, "p1")
        a.call("finish", t1, b"")
        _events(r1, ("receiver", "p1", "ready"))
        _events(a, ("sender", "p1", "acked"))
        mapped = a.call("paths")
        assert mapped["ipc"]["maps"] == base["ipc"]["maps"] + 1, mapped
        assert mapped["live_imports"] > base["live_imports"], mapped
        old_target = r1.call("reserve", "p2", {"c4": 2}, 30.0)
        r1.close()                                   # restarts under the same name
        (r2,) = start(Worker("gpu-decode-r", device=dst, seed=6, progress_thread=True))
        src = a.call("prepare", "p2", counts={"c4": 2})
        want = a.call("digest", "c4", src["c4"])
        new_target = r2.call("reserve", "p2", {"c4": 2}, 30.0)
        with pytest.raises(WorkerError) as e:        # only the old incarnation is known
            a.call("send", new_target, "p2")
        assert e.value.kind == "StaleTarget"
        connect(a, r2)                               # new handshake: old mapping dropped
        dropped = a.call("paths")
        assert dropped["ipc"]["unmaps"] == mapped["ipc"]["unmaps"] + 1, dropped
        assert dropped["live_imports"] == base["live_imports"], dropped
        with pytest.raises(WorkerError) as e:
            a.call("send", old_target, "p2")
        assert e.value.kind == "StaleTarget"
        a.call("send", new_target, "p2")
        a.call("finish", new_target, b"h")
        _events(r2, ("receiver", "p2", "ready"))
        assert r2.call("claim", "p2") == {"c4": want}
        _events(a, ("sender", "p2", "acked"))
        remapped = a.call("paths")
        assert remapped["ipc"]["maps"] == mapped["ipc"]["maps"] + 1, remapped
        assert remapped["writes"]["cuda_ipc"] == mapped["writes"]["cuda_ipc"] + 1, remapped
        assert remapped["live_imports"] == mapped["live_imports"], remapped
        _settle(a, r2)
    finally:
        for w in (r1, r2):
            if w is not None:
                w.close()


def test_ucx_path_when_ipc_is_off(gpu_pair):
    from kvtransfer import FaultPlan

    from kvt_harness import Worker, connect, start

    _, b = gpu_pair
    (u,) = start(Worker("gpu-prefill-ucx", device="cuda:0", seed=7, progress_thread=True,
                        cuda_ipc=False))
    try:
        connect(u, b)
        assert u.call("transport", "gpu-decode") == "ucx"
        src = u.call("prepare", "u1", explicit={"c4": [1, 2, 3, 9], "c128": [0]})
        want = {k: u.call("digest", k, ids) for k, ids in src.items()}
        target = b.call("reserve", "u1", {k: len(v) for k, v in src.items()}, 30.0)
        u.call("send", target, "u1")
        u.call("finish", target, b"ucx")
        _events(b, ("receiver", "u1", "ready"))
        assert b.call("claim", "u1") == want
        _events(u, ("sender", "u1", "acked"))
        paths = u.call("paths")
        assert paths["writes"] == {"cuda_ipc": 0, "ucx": 1} and paths["ipc"] == {}, paths

        b.call("rebuild", None, FaultPlan(corrupt_after_write=True))
        try:
            u.call("prepare", "u2", counts={"c4": 2})
            target = b.call("reserve", "u2", {"c4": 2}, 30.0)
            u.call("send", target, "u2")
            u.call("finish", target, b"")
            _events(b, ("receiver", "u2", "corrupt"))
            b.call("release", "u2")
            _events(u, ("sender", "u2", "rejected"))
        finally:
            b.call("rebuild", None, None)
        _settle(u, b)
    finally:
        u.close()

"""Data-path selection without a GPU: the CUDA IPC module's CPU-testable parts (host id, handle
decoding refuses foreign pickles, span copies), UCX for CPU pools, and the epoch guard on writes
that were queued behind an event while the peer restarted."""

import base64
import pickle
import time

import pytest
import torch

from kvtransfer import Agent, Sender, TransferError
from kvtransfer.cuda_ipc import decode_handle, host_id
from kvtransfer.span_copy import copy_spans
from kvtransfer.regions import Span, coalesce
from kvt_harness import PageAllocator, make_layout

LAYOUT = make_layout(num_pages=8)


def _pools(seed):
    g = torch.Generator().manual_seed(seed)
    return {p.kind: torch.randint(0, 256, (p.num_pages, p.page_bytes), dtype=torch.uint8,
                                  generator=g) for p in LAYOUT.pools}


def test_host_id_is_hostname_and_boot_id():
    h = host_id()
    assert h == "" or ("/" in h and len(h.rsplit("/", 1)[1]) >= 32)
    assert host_id() == h


def test_decode_handle_accepts_only_cuda_tensor_handles():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    t = torch.zeros(4, 8, dtype=torch.uint8)
    args = (torch.Tensor, t.size(), t.stride(), 0, torch.storage.TypedStorage, torch.uint8, 0,
            b"h" * 64, 32, 0, False, b"/torch_1_2", 3, b"e" * 64, True)
    blob = base64.b64encode(pickle.dumps((rebuild_cuda_tensor, args), protocol=4)).decode()
    fn, got = decode_handle(blob)
    assert fn is rebuild_cuda_tensor and got == args

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    for obj in ((rebuild_cuda_tensor, (Evil(),)), (print, args), (rebuild_cuda_tensor, "x")):
        bad = base64.b64encode(pickle.dumps(obj, protocol=4)).decode()
        with pytest.raises((pickle.UnpicklingError, ValueError)):
            decode_handle(bad)


@pytest.mark.parametrize("impl", ["torch", "triton", "auto"])
@pytest.mark.parametrize("byte_range,runs", [(None, 2), ((100, 50), 4), ((101, 37), 4)])
def test_copy_spans_moves_exactly_the_coalesced_runs(byte_range, runs, impl):
    # the kernel runs on the GPU when there is one, else in Triton's interpreter on CPU tensors
    device = "cuda" if impl != "torch" and torch.cuda.is_available() else "cpu"
    src = {k: t.view(-1).to(device) for k, t in _pools(1).items()}
    dst = {k: t.clone().view(-1).to(device) for k, t in _pools(2).items()}
    before = {k: t.clone() for k, t in dst.items()}
    pb = LAYOUT.pool("c4").page_bytes
    lo, n = byte_range or (0, pb)
    src_ids, dst_ids = [5, 6, 7, 0], [1, 2, 3, 6]
    spans = [("c4", s) for s in coalesce(src_ids, dst_ids, pb, byte_range)]
    assert len(spans) == runs
    copy_spans(src, dst, spans, impl=impl, chunk_bytes=1000)  # chunks split the runs too
    page = lambda d, i: d["c4"].view(-1, pb)[i]     # noqa: E731
    for s_id, d_id in zip(src_ids, dst_ids):
        assert torch.equal(page(dst, d_id)[lo:lo + n], page(src, s_id)[lo:lo + n])
        assert torch.equal(page(dst, d_id)[:lo], page(before, d_id)[:lo])
        assert torch.equal(page(dst, d_id)[lo + n:], page(before, d_id)[lo + n:])
    untouched = [i for i in range(8) if i not in dst_ids]
    assert torch.equal(dst["c4"].view(-1, pb)[untouched], before["c4"].view(-1, pb)[untouched])
    assert all(torch.equal(dst[k], before[k]) for k in dst if k != "c4")


class _Event:
    """Stands in for a CUDA event: Sender only calls query()."""

    def __init__(self):
        self.fired = False

    def query(self):
        return self.fired


def test_cpu_pools_use_ucx_and_a_queued_write_never_reaches_a_restarted_peer():
    a = Agent("qa", _pools(1), progress_thread=False)
    b1 = Agent("qb", _pools(2), progress_thread=False, cuda_ipc=False)
    b2 = None
    try:
        import json
        md = json.loads(a.metadata())
        assert md["ipc"] == {} and md["host"] == host_id()
        sender = Sender(a, LAYOUT, post_margin_s=0.02)
        sender.handshake("qb", b1.metadata(), LAYOUT)
        b1.add_peer("qa", a.metadata())
        assert a.transport("qb") == "ucx" and a.ipc_stats() == {}
        alloc = PageAllocator(LAYOUT)
        from kvtransfer import Receiver
        target = Receiver(b1, alloc, LAYOUT).reserve("q1", {"c4": 2}, 5.0)
        ev = _Event()
        sender.send(target, {"c4": [0, 1]}, ready=ev)
        assert sender.in_flight("q1") == 1 and a.writes_by_path["ucx"] == 0
        b2 = Agent("qb", _pools(3), progress_thread=False)           # the peer restarted
        sender.handshake("qb", b2.metadata(), LAYOUT)
        with pytest.raises(TransferError):                            # agent-level guard
            a.write("qb", [("c4", Span(0, 0, 16))], epoch=b1.epoch)
        before = b2.pools["c4"].clone()
        ev.fired = True
        deadline, events = time.time() + 3, []
        while not events and time.time() < deadline:
            events = sender.poll()
        assert [(e.request_id, e.reason) for e in events] == [("q1", "peer_restarted")]
        assert a.writes_by_path == {"cuda_ipc": 0, "ucx": 0}
        assert torch.equal(b2.pools["c4"], before)
    finally:
        for ag in (a, b1, b2):
            if ag is not None:
                ag.close()


def test_auto_copy_takes_the_kernel_only_for_many_small_spans(monkeypatch):
    from kvtransfer import span_copy

    taken = []
    monkeypatch.setattr(span_copy, "_copy_kernel", _Recorder(taken, span_copy._copy_kernel))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = {"c4": torch.arange(64 * 1024, dtype=torch.int32, device=dev).view(torch.uint8)}
    dst = {"c4": torch.zeros_like(src["c4"])}
    few = [("c4", Span(0, 0, 128 * 1024))]
    many = [("c4", Span(i * 4096, i * 4096, 4096)) for i in range(span_copy.KERNEL_MIN_SPANS)]
    span_copy.copy_spans(src, dst, few, impl="auto")
    assert taken == [] and torch.equal(dst["c4"][:128 * 1024], src["c4"][:128 * 1024])
    dst["c4"].zero_()
    span_copy.copy_spans(src, dst, many, impl="auto")
    assert len(taken) == 1 and torch.equal(dst["c4"][:4096 * len(many)], src["c4"][:4096 * len(many)])


class _Recorder:
    """Wraps the Triton kernel: records launches, then runs it."""

    def __init__(self, log, kernel):
        self.log, self.kernel = log, kernel

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]

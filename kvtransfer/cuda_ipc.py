"""Same-host data path: CUDA IPC peer copies instead of a UCX rendezvous.

When both workers' pools are CUDA tensors on one host, the writing agent maps the peer's pool
buffers into its own process once per peer incarnation (epoch) and moves the coalesced spans of
a write on a dedicated stream of its own device (`span_copy`: the copy engine for a few large
spans, one kernel whose SMs store into the peer's memory for many small ones); the handle of a
write is a CUDA event recorded after the copies, and the write is DONE when the event has fired
(every byte is in the peer's memory). Peers mapped in their own GPU's context always take the
copy engine. Notifications, checksums, leases and
epochs stay on NIXL exactly as for UCX writes; only the bytes take this path.

- Export: metadata() carries, per CUDA pool, base64(pickle(torch's reduce_tensor(pool))), which
  holds the cudaIpcMemHandle of the pool's allocation, and a host id (hostname + boot id).
- Import: only peers with the same host id, VRAM pools and handles for every pool are mapped, on
  their first write (a worker that loads a peer only to acknowledge it never maps it). The
  handle is opened in this process's own device context (CUDA maps a peer device's memory there
  and enables peer access), so the copy is a plain same-device memcpy to a peer address; if that
  fails, in the context of the peer's GPU when it is visible here (found by UUID), else the peer
  is written through UCX. Each mapping is probed by reading one byte back before use.
- Unpickling peer metadata accepts only the few torch globals an IPC handle consists of.
- A peer's mapping is dropped (after the copy stream drained) when the peer is removed or
  re-added with another epoch: a restarted peer is mapped afresh, never written through the old
  incarnation's mapping.
"""

from __future__ import annotations

import base64
import inspect
import io
import logging
import pickle
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .regions import Span, SpanBatch
from .span_copy import copy_spans, memcpy_available

log = logging.getLogger(__name__)

_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "uint8"),
    ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a CUDA IPC handle")
        return super().find_class(module, name)


def host_id() -> str:
    """hostname/boot id; '' when the boot id cannot be read (then nothing counts as same-host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}" if boot else ""


def device_uuid(device: torch.device) -> str:
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:   # older torch, or no driver
        return ""


def export_pools(pools: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """kind -> base64 pickle of reduce_tensor(pool), for every non-empty CUDA pool.

    The pools' device is synchronised first, so importers need not wait on torch's IPC event
    (open_handle() skips it, as torch itself does when it runs out of IPC events)."""
    from torch.multiprocessing.reductions import reduce_tensor

    for dev in {t.device for t in pools.values() if t.is_cuda}:
        torch.cuda.synchronize(dev)
    return {k: base64.b64encode(pickle.dumps(reduce_tensor(t), protocol=4)).decode()
            for k, t in pools.items() if t.is_cuda and t.numel()}


def decode_handle(blob: str) -> tuple:
    """(rebuild_fn, args) of an exported pool; refuses anything but a CUDA tensor handle."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    obj = _HandleUnpickler(io.BytesIO(base64.b64decode(blob))).load()
    if not (isinstance(obj, tuple) and len(obj) == 2 and obj[0] is rebuild_cuda_tensor
            and isinstance(obj[1], tuple)):
        raise ValueError("not a CUDA tensor IPC handle")
    return obj


def open_handle(blob: str, device_index: int) -> torch.Tensor:
    """Map an exported pool into the context of local device `device_index`; flat uint8 view."""
    fn, args = decode_handle(blob)
    args, names = list(args), list(inspect.signature(fn).parameters)
    args[names.index("storage_device")] = device_index
    args[names.index("event_sync_required")] = False     # the exporter synchronised
    with torch.cuda.device(device_index):
        t = fn(*args)
    if t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError("exported pool is not a contiguous uint8 tensor")
    return t.view(-1)


def live_imports() -> int:
    """Imported (peer) CUDA storages still alive in this process (torch's IPC cache)."""
    from torch.multiprocessing.reductions import shared_cache

    return sum(1 for k, ref in list(shared_cache.items())
               if isinstance(k, tuple) and not ref.expired())


@dataclass
class PeerMapping:
    """One peer incarnation's pools mapped here. mode: 'local' (opened in this process's device
    context) or 'peer' (in the context of the peer's GPU, visible here)."""

    name: str
    epoch: str
    mode: str
    device_index: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    engine: str = "torch"      # large spans: "memcpy" (direct cudaMemcpyAsync, probed) or torch


class CudaIpcPath:
    """The IPC data path of one Agent whose pools live on CUDA device `device`."""

    def __init__(self, device: torch.device, pools: Mapping[str, torch.Tensor], timing: bool = False):
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.host = host_id()
        self.uuid = device_uuid(self.device)
        self.local = {k: t.view(-1) for k, t in pools.items()}
        self.stream = torch.cuda.Stream(device=self.device)
        self._maps: dict[str, PeerMapping] = {}
        self._failed: dict[str, str] = {}          # peer name -> epoch whose mapping failed
        self._export: dict[str, str] | None = None
        self.stats = {"maps": 0, "unmaps": 0, "map_failures": 0, "writes": 0}
        # timing: each write also records a start event; the GPU seconds of the copies are then
        # added up in `gpu_seconds()` (benchmarks; events with timing cost a little)
        self.timing = timing
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._gpu_s = 0.0

    def export(self) -> dict[str, str]:
        if self._export is None:      # once: every reduce_tensor call takes a ref-counter slot
            self._export = export_pools({k: t for k, t in self.local.items()})
        return self._export

    def eligible(self, peer) -> bool:
        kinds = {k for k, _ in peer.ipc}
        return (peer.mem_type == "VRAM" and bool(self.host) and peer.host == self.host
                and all(k in kinds for k, (_, n, _) in peer.pools if n))

    def mapping(self, peer) -> PeerMapping | None:
        """The mapping of this peer incarnation (made on first use), or None: write via UCX."""
        m = self._maps.get(peer.name)
        if m is not None:
            if m.epoch == peer.epoch:
                return m
            self.drop(peer.name)          # never write through an old incarnation's mapping
        if self._failed.get(peer.name) == peer.epoch or not self.eligible(peer):
            return None
        errors = []
        for mode, index in self._candidates(peer):
            try:
                m = self._map(peer, mode, index)
            except Exception as e:        # torch/CUDA raise RuntimeError; bad blobs others
                errors.append(f"{mode} (cuda:{index}): {e}")
                continue
            self._maps[peer.name] = m
            self.stats["maps"] += 1
            return m
        self._failed[peer.name] = peer.epoch
        self.stats["map_failures"] += 1
        log.warning("CUDA IPC mapping of %s#%s failed, writing through UCX: %s", peer.name,
                    peer.epoch, "; ".join(errors))
        return None

    def _candidates(self, peer) -> list[tuple[str, int]]:
        out = [("local", self.device.index)]
        if peer.uuid and peer.uuid != self.uuid:
            for i in range(torch.cuda.device_count()):
                if i != self.device.index and device_uuid(torch.device("cuda", i)) == peer.uuid:
                    out.append(("peer", i))
        return out

    def _map(self, peer, mode: str, index: int) -> PeerMapping:
        m = PeerMapping(peer.name, peer.epoch, mode, index)
        for kind, blob in peer.ipc:
            t = open_handle(blob, index)
            _, nbytes, _ = peer.pool(kind)
            if t.numel() != nbytes:
                raise ValueError(f"pool {kind!r}: handle maps {t.numel()} B, metadata says "
                                 f"{nbytes} B")
            m.tensors[kind] = t
        probe = torch.empty(len(m.tensors), dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(self.stream):          # read one byte of each: no peer data moves
            for i, t in enumerate(m.tensors.values()):
                probe[i:i + 1].copy_(t[:1], non_blocking=True)
        self.stream.synchronize()
        if mode == "local" and memcpy_available() and m.tensors:
            m.engine = "memcpy" if self._memcpy_reads_back(m, probe[:1]) else "torch"
        return m

    def _memcpy_reads_back(self, m: PeerMapping, want: torch.Tensor) -> bool:
        """Whether a direct cudaMemcpyAsync reads the peer's first byte as torch did: the runtime
        found in the process is usable with torch's streams and this mapping."""
        kind, t = next(iter(m.tensors.items()))
        got = torch.empty(1, dtype=torch.uint8, device=self.device)
        try:
            with torch.cuda.stream(self.stream):
                # from the peer's byte into `got`: a read, nothing lands in the peer's pool
                copy_spans({kind: t}, {kind: got}, [(kind, Span(0, 0, 1))], impl="memcpy")
            self.stream.synchronize()
            ok = bool(torch.equal(got, want))
        except Exception as e:       # a CUDA runtime that does not fit torch's
            log.warning("direct cudaMemcpyAsync unusable, copying through torch: %s", e)
            return False
        if not ok:
            log.warning("direct cudaMemcpyAsync read back a different byte; copying through torch")
        return ok

    def write(self, m: PeerMapping, spans: SpanBatch) -> torch.cuda.Event:
        """Copy the spans (ranges already checked) after the current stream's work; the returned
        event fires once every byte is in the peer's memory. No host synchronisation: the copy
        stream waits for the current stream on the device."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start = None
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            impl = copy_spans(self.local, m.tensors, spans,
                              impl="auto" if m.mode == "local" else "torch", engine=m.engine)
            ev = torch.cuda.Event(enable_timing=self.timing)
            ev.record(stream)
        if start is not None:
            self._timed.append((start, ev))
        self.stats["writes"] += 1
        self.stats[f"copies_{impl}"] = self.stats.get(f"copies_{impl}", 0) + 1
        return ev

    def gpu_seconds(self) -> float:
        """GPU time of the timed writes so far (from the first copy's start to the last's end
        of each write); waits for writes still in flight."""
        for start, end in self._timed:
            end.synchronize()
            self._gpu_s += start.elapsed_time(end) / 1e3
        self._timed.clear()
        return self._gpu_s

    def drop(self, name: str) -> None:
        """Forget a peer's mapping (after copies into it finished); closes the CUDA mapping once
        nothing else in this process references it."""
        self._failed.pop(name, None)
        m = self._maps.pop(name, None)
        if m is not None:
            self.stream.synchronize()
            m.tensors.clear()
            self.stats["unmaps"] += 1

    def peer_mode(self, name: str) -> str | None:
        m = self._maps.get(name)
        return m.mode if m is not None else None

    def close(self) -> None:
        for name in list(self._maps):
            self.drop(name)

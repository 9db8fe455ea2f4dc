"""A thin wrapper over one NIXL agent (UCX backend) owning a worker's KV pool buffers.

- Each pool tensor (uint8 [num_pages, page_bytes], CPU or CUDA) is registered once at start;
  the memory type (DRAM or VRAM) follows the tensors' device.
- The agent's NIXL name is "<name>#<epoch>" with a fresh random epoch per process start, so a
  restarted worker is a different NIXL agent: nothing addressed to its previous incarnation can
  land in its new registrations, and notifications say which incarnation sent them.
- metadata() is the handshake blob another worker passes to add_peer(): name, epoch, the NIXL
  agent metadata (connection info and remote keys) and the base address of every pool.
- Notifications are demultiplexed by the protocol's one-byte tag, so a Sender and a Receiver can
  share one agent and each take only their own messages.
- Same-host CUDA pools: writes go through CUDA IPC peer copies (cuda_ipc.py) instead of UCX;
  the metadata then also carries the host id and the pools' IPC handles. UCX stays the path for
  other hosts, CPU memory, agents built with cuda_ipc=False, and peers whose mapping failed.
  Which path a write took is invisible to callers: state()/release() take either handle.

Not thread-safe (NIXL is created without thread sync): drive it from one event-loop thread.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .cuda_ipc import CudaIpcPath, host_id
from .regions import Span, SpanBatch
from .transport import RemotePeer, TransferError, check_pools, incarnation, memory_of, resolve_write

log = logging.getLogger(__name__)


_FEW_SPANS = 32   # up to this many spans, descriptors are built in Python


class Agent:
    """One NIXL agent with the worker's pools registered.

    name:  the worker's stable name (no '#'); pools: kind -> uint8 tensor [num_pages, page_bytes],
    all on one device. num_threads: UCX worker threads (0 = NIXL default).
    progress_thread: NIXL's background progress thread. It moves transfers along between
        poll() calls but keeps ~half a core busy; without it, UCX progresses only inside
        state()/recv() (Sender/Receiver poll()), and then BOTH sides must poll regularly: a
        host-memory WRITE stalls while the receiving process does not progress.
    cuda_ipc: with CUDA pools, offer this agent's pools to same-host peers through CUDA IPC
        handles and write to such peers by peer copies; False: every byte goes through UCX.
    time_ipc_writes: record the GPU time of CUDA IPC writes (`ipc_stats()["gpu_write_s"]`).
    """

    def __init__(self, name: str, pools: Mapping[str, torch.Tensor], *, num_threads: int = 0,
                 progress_thread: bool = True, cuda_ipc: bool = True, time_ipc_writes: bool = False):
        from nixl._api import nixl_agent, nixl_agent_config   # optional dependency

        device = check_pools(pools)
        self.name = name
        self.epoch, self.nixl_name = incarnation(name)
        self.pools: dict[str, torch.Tensor] = dict(pools)
        self._bases = {k: t.data_ptr() for k, t in self.pools.items()}   # registered once
        self.mem_type, self.device_id = memory_of(device)
        self._device = device
        self._nixl = nixl_agent(self.nixl_name,
                                nixl_agent_config(enable_prog_thread=progress_thread,
                                                  backends=["UCX"], num_threads=num_threads))
        self._regs = [self._nixl.register_memory(t) for t in self.pools.values() if t.numel()]
        self._ipc = (CudaIpcPath(device, self.pools, timing=time_ipc_writes)
                     if cuda_ipc and device.type == "cuda" and self.pools else None)
        self.host = self._ipc.host if self._ipc is not None else host_id()
        self.writes_by_path = {"cuda_ipc": 0, "ucx": 0}
        self._peers: dict[str, RemotePeer] = {}
        self._inbox: dict[bytes, list[tuple[str, bytes]]] = defaultdict(list)
        self._closed = False

    # --- handshake

    def metadata(self) -> bytes:
        """Blob for peers' add_peer(): identity, NIXL metadata, pool base addresses, host id and
        (CUDA pools, IPC on) the pools' CUDA IPC handles."""
        ipc = self._ipc
        return json.dumps({
            "name": self.name,
            "epoch": self.epoch,
            "mem": self.mem_type,
            "pools": {k: [t.data_ptr(), t.numel(), self.device_id] for k, t in self.pools.items()},
            "md": base64.b64encode(self._nixl.get_agent_metadata()).decode(),
            "host": self.host,
            "ipc": ipc.export() if ipc is not None else {},
            "uuid": ipc.uuid if ipc is not None else "",
        }, separators=(",", ":")).encode()

    def add_peer(self, name: str, metadata: bytes) -> RemotePeer:
        """Load a peer's metadata. Same epoch again: no-op. New epoch: the old incarnation is
        dropped first, its CUDA IPC mapping too (a restarted peer is a new peer). IPC handles
        are only decoded and mapped on the first write to the peer."""
        d = json.loads(metadata)
        if d["name"] != name:
            raise ValueError(f"metadata is for agent {d['name']!r}, not {name!r}")
        old = self._peers.get(name)
        if old is not None:
            if old.epoch == d["epoch"]:
                return old
            self.remove_peer(name)
        loaded = self._nixl.add_remote_agent(base64.b64decode(d["md"]))
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != f"{name}#{d['epoch']}":
            raise ValueError(f"NIXL metadata names {loaded!r}, expected {name}#{d['epoch']}")
        peer = RemotePeer(name, d["epoch"], loaded, d["mem"],
                          tuple((k, (int(a), int(n), int(dev)))
                                for k, (a, n, dev) in sorted(d["pools"].items())),
                          str(d.get("host", "")), tuple(sorted(d.get("ipc", {}).items())),
                          str(d.get("uuid", "")))
        self._peers[name] = peer
        return peer

    def remove_peer(self, name: str) -> None:
        if self._ipc is not None:
            self._ipc.drop(name)       # waits for copies into it, then unmaps
        peer = self._peers.pop(name, None)
        if peer is not None:
            try:
                self._nixl.remove_remote_agent(peer.nixl_name)
            except Exception:   # already disconnected: nothing left to invalidate
                log.debug("remove_remote_agent(%s) failed", peer.nixl_name, exc_info=True)

    def peer(self, name: str) -> RemotePeer | None:
        return self._peers.get(name)

    def transport(self, peer_name: str) -> str:
        """"cuda_ipc" or "ucx": the path writes to this peer take (maps the peer if due, so a
        caller may use it to set up the mapping ahead of the first write)."""
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KeyError(f"unknown peer {peer_name!r}")
        ok = self._ipc is not None and self._ipc.mapping(peer) is not None
        return "cuda_ipc" if ok else "ucx"

    def ipc_stats(self) -> dict:
        """Counters of the CUDA IPC path (maps, unmaps, map_failures, writes, gpu_write_s: GPU
        seconds of timed writes) and the mode of each mapped peer; empty when the path is off."""
        if self._ipc is None:
            return {}
        return dict(self._ipc.stats, gpu_write_s=self._ipc.gpu_seconds(),
                    modes={n: self._ipc.peer_mode(n) for n in self._peers if self._ipc.peer_mode(n)})

    # --- writes

    def write(self, peer_name: str, spans: SpanBatch | Sequence[tuple[str, Span]],
              epoch: str | None = None, sync_stream: bool = False):
        """Write spans (a SpanBatch, or (kind, Span) pairs) into peer `peer_name`'s pools: one
        NIXL WRITE, or for a same-host CUDA peer peer copies on this agent's copy stream (after
        the work already on the current stream).

        epoch: if given, the peer incarnation the caller means; another one is refused.
        sync_stream: the data was produced on the current stream: UCX (which reads CUDA memory
            behind torch's back) waits for it on the host first; the CUDA IPC copies are ordered
            after it on the device anyway, with no host wait.
        Returns an opaque handle for state()/release(); None when there are no spans.
        Raises KeyError for an unknown peer or kind, ValueError for out-of-range spans,
        TransferError when the transfer is refused or cannot be posted.
        """
        target = resolve_write(self._peers, peer_name, spans, epoch)
        if target is None:
            return None
        peer, batch = target
        local, remote = self._descriptors(peer, batch)    # checks every span's range
        mapping = self._ipc.mapping(peer) if self._ipc is not None else None
        if mapping is not None:
            try:
                handle = self._ipc.write(mapping, batch)
            except Exception as e:      # a CUDA error: the context is likely unusable anyway
                raise TransferError(f"CUDA IPC copy to {peer.nixl_name} failed: {e}") from e
            self.writes_by_path["cuda_ipc"] += 1
            return handle
        if sync_stream and self.mem_type == "VRAM":
            torch.cuda.current_stream(self._device).synchronize()
        try:
            handle = self._nixl.initialize_xfer(
                "WRITE", self._nixl.get_xfer_descs(local, self.mem_type),
                self._nixl.get_xfer_descs(remote, peer.mem_type), peer.nixl_name)
            status = self._nixl.transfer(handle)
        except Exception as e:   # nixl raises its own binding exceptions
            raise TransferError(f"WRITE to {peer.nixl_name} refused: {e}") from e
        if status == "ERR":
            self.release(handle)
            raise TransferError(f"WRITE to {peer.nixl_name} failed on post")
        self.writes_by_path["ucx"] += 1
        return handle

    def _descriptors(self, peer: RemotePeer, batch: SpanBatch) -> tuple[np.ndarray, np.ndarray]:
        """NIXL descriptors (address, length, device) of both sides, uint64 [count, 3]; raises
        ValueError if a span lies outside its pool on either side. A few spans (a whole-page
        hand-off) in plain Python: a dozen numpy calls would cost more than the work itself."""
        regions, kinds = peer.regions, batch.kinds
        lo = [(self._bases[k], self.pools[k].numel()) for k in kinds]
        rem = [regions[k] for k in kinds]
        if batch.count <= _FEW_SPANS:
            local, remote = [], []
            for k, s, d, n in batch.rows.tolist():
                if s < 0 or d < 0 or n < 0 or s + n > lo[k][1] or d + n > rem[k][1]:
                    raise ValueError(f"span ({s}, {d}, {n}) outside pool {kinds[k]!r} (local "
                                     f"{lo[k][1]} B, remote {rem[k][1]} B)")
                local.append((lo[k][0] + s, n, self.device_id))
                remote.append((rem[k][0] + d, n, rem[k][2]))
            return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)
        rows, k = batch.rows, batch.rows[:, 0]
        lo_a, re_a = np.array(lo, dtype=np.int64)[k], np.array(rem, dtype=np.int64)[k]
        if (rows[:, 1:].min() < 0 or (rows[:, 1] + rows[:, 3] > lo_a[:, 1]).any()
                or (rows[:, 2] + rows[:, 3] > re_a[:, 1]).any()):
            raise ValueError(f"a span lies outside its pool (kinds {kinds})")
        local = np.empty((batch.count, 3), dtype=np.uint64)
        remote = np.empty((batch.count, 3), dtype=np.uint64)
        local[:, 0] = rows[:, 1] + lo_a[:, 0]
        remote[:, 0] = rows[:, 2] + re_a[:, 0]
        local[:, 1] = remote[:, 1] = rows[:, 3]
        local[:, 2] = self.device_id
        remote[:, 2] = re_a[:, 2]
        return local, remote

    def state(self, handle) -> str:
        """"DONE" (data landed at the peer), "PROC" or "ERR"."""
        try:
            if isinstance(handle, torch.cuda.Event):      # a CUDA IPC write
                return "DONE" if handle.query() else "PROC"
            return self._nixl.check_xfer_state(handle)
        except Exception:
            log.debug("check_xfer_state failed", exc_info=True)
            return "ERR"

    def release(self, handle) -> None:
        if isinstance(handle, torch.cuda.Event):
            return
        try:
            handle.release()
        except Exception:   # in-flight transfer that NIXL could not cancel: it keeps it
            log.warning("could not release transfer handle %r", handle, exc_info=True)

    # --- notifications

    def notify(self, nixl_name: str, data: bytes) -> bool:
        """Send a notification to a loaded peer (by NIXL name); False if unknown or failing."""
        known = any(p.nixl_name == nixl_name for p in self._peers.values())
        if not known:
            return False
        try:
            self._nixl.send_notif(nixl_name, data)
            return True
        except Exception:
            log.debug("send_notif to %s failed", nixl_name, exc_info=True)
            return False

    def recv(self, tag: bytes) -> list[tuple[str, bytes]]:
        """Notifications whose first byte is `tag`, as (sender NIXL name, message), oldest first."""
        for src, msgs in self._nixl.get_new_notifs().items():
            src = src.decode() if isinstance(src, bytes) else src
            for m in msgs:
                self._inbox[bytes(m[:1])].append((src, bytes(m)))
        out = self._inbox.pop(tag, [])
        return out

    def close(self) -> None:
        """Forget peers and deregister the pools. The agent is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            self.remove_peer(name)
        if self._ipc is not None:
            self._ipc.close()
        for reg in self._regs:
            try:
                self._nixl.deregister_memory(reg)
            except Exception:
                log.debug("deregister_memory failed", exc_info=True)
        self._regs = []

"""An agent whose peers live in the same process: writes copy bytes between pool tensors.

It implements the interface of `agent.Agent` (`transport.TransferAgent`), so Sender and Receiver
run over it unchanged: tests of the protocol and of the workers' transfer logic need neither NIXL
nor a second process. What it keeps of NIXL's behaviour, because the protocol depends on it:

- identity: "<name>#<epoch>" NIXL names with a fresh epoch per agent, metadata blobs loaded with
  add_peer() (same epoch: no-op; new epoch: the old incarnation is dropped), writes refused for an
  incarnation other than the one meant;
- writes are posted, then land while the writer polls: a write's first `land_after_polls` state()
  queries answer "PROC", the next copies the bytes and answers "DONE". A write whose peer is gone
  by then (closed, killed, or removed by this agent) answers "ERR" and copies nothing;
- notifications are delivered to the peer's inbox at once and demultiplexed by the protocol's
  one-byte tag; an agent hears from senders it has not loaded, but only notifies loaded peers.

Peers find each other through an `AgentDirectory` passed in explicitly (one per simulated
cluster): agents register under their NIXL name and leave it on close() or `kill()`.

    d = AgentDirectory()
    a, b = LocalAgent("pa", pools_a, d), LocalAgent("pb", pools_b, d)
    a.add_peer("pb", b.metadata()); b.add_peer("pa", a.metadata())

Not thread-safe, like the NIXL agent: drive every agent of a directory from one thread.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .regions import Span, SpanBatch
from .transport import RemotePeer, TransferError, check_pools, incarnation, memory_of, resolve_write

PATH = "local"


class AgentDirectory:
    """The in-process agents that can reach one another, by NIXL name."""

    def __init__(self) -> None:
        self._agents: dict[str, LocalAgent] = {}

    def register(self, agent: LocalAgent) -> None:
        if agent.nixl_name in self._agents:
            raise ValueError(f"agent {agent.nixl_name!r} is already registered")
        self._agents[agent.nixl_name] = agent

    def unregister(self, nixl_name: str) -> None:
        self._agents.pop(nixl_name, None)

    def get(self, nixl_name: str) -> LocalAgent | None:
        return self._agents.get(nixl_name)

    def kill(self, nixl_name: str) -> None:
        """The agent's process died: it leaves the directory at once, without cleanup. Writes to
        it fail (refused on post, "ERR" in flight), notifications to it are undeliverable, and it
        itself posts, sends and receives nothing more."""
        agent = self._agents.pop(nixl_name, None)
        if agent is not None:
            agent._dead = True

    def __contains__(self, nixl_name: str) -> bool:
        return nixl_name in self._agents


@dataclass
class _Write:
    peer: RemotePeer
    batch: SpanBatch
    polls_left: int
    state: str = "PROC"        # PROC | DONE | ERR
    released: bool = False


class LocalAgent:
    """An in-process agent with the worker's pools (kind -> uint8 [num_pages, page_bytes], all on
    one device). land_after_polls: state() queries of a write answered "PROC" before it lands."""

    def __init__(self, name: str, pools: Mapping[str, torch.Tensor], directory: AgentDirectory, *,
                 land_after_polls: int = 1):
        device = check_pools(pools)
        self.name = name
        self.epoch, self.nixl_name = incarnation(name)
        self.pools: dict[str, torch.Tensor] = dict(pools)
        self._flat = {k: t.view(-1) for k, t in self.pools.items()}
        self.mem_type, self.device_id = memory_of(device)
        self._device = device
        self.land_after_polls = land_after_polls
        self.writes_by_path = {PATH: 0}
        self._directory = directory
        self._peers: dict[str, RemotePeer] = {}
        self._inbox: dict[bytes, list[tuple[str, bytes]]] = defaultdict(list)
        self._closed = self._dead = False
        directory.register(self)

    # --- handshake

    def metadata(self) -> bytes:
        return json.dumps({
            "name": self.name,
            "epoch": self.epoch,
            "transport": PATH,
            "mem": self.mem_type,
            "pools": {k: [t.data_ptr(), t.numel(), self.device_id] for k, t in self.pools.items()},
        }, separators=(",", ":")).encode()

    def add_peer(self, name: str, metadata: bytes) -> RemotePeer:
        """Load a peer's metadata (its agent need not be alive: writes to a gone one fail).
        Same epoch again: no-op; new epoch: the old incarnation is dropped first."""
        d = json.loads(metadata)
        if d.get("transport") != PATH:
            raise ValueError(f"metadata of {d.get('name')!r} is not an in-process agent's")
        if d["name"] != name:
            raise ValueError(f"metadata is for agent {d['name']!r}, not {name!r}")
        old = self._peers.get(name)
        if old is not None:
            if old.epoch == d["epoch"]:
                return old
            self.remove_peer(name)
        peer = RemotePeer(name, d["epoch"], f"{name}#{d['epoch']}", d["mem"],
                          tuple((k, (int(a), int(n), int(dev)))
                                for k, (a, n, dev) in sorted(d["pools"].items())))
        self._peers[name] = peer
        return peer

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    def peer(self, name: str) -> RemotePeer | None:
        return self._peers.get(name)

    def transport(self, peer_name: str) -> str:
        if peer_name not in self._peers:
            raise KeyError(f"unknown peer {peer_name!r}")
        return PATH

    # --- writes

    def write(self, peer_name: str, spans: SpanBatch | Sequence[tuple[str, Span]],
              epoch: str | None = None, sync_stream: bool = False) -> _Write | None:
        """Post a write of spans into peer `peer_name`'s pools; it lands when state() says so.
        sync_stream is accepted for the interface: copies run on the current stream, after the
        work that produced the data."""
        target = resolve_write(self._peers, peer_name, spans, epoch)
        if target is None:
            return None
        peer, batch = target
        self._check_ranges(peer, batch)
        if self._closed or self._dead:
            raise TransferError(f"agent {self.nixl_name} is closed")
        if peer.nixl_name not in self._directory:
            raise TransferError(f"WRITE to {peer.nixl_name} refused: the peer is gone")
        self.writes_by_path[PATH] += 1
        return _Write(peer, batch, self.land_after_polls)

    def _check_ranges(self, peer: RemotePeer, batch: SpanBatch) -> None:
        """KeyError for a kind either side lacks, ValueError for a span outside its pool."""
        local = np.array([self._flat[k].numel() for k in batch.kinds], dtype=np.int64)
        remote = np.array([peer.regions[k][1] for k in batch.kinds], dtype=np.int64)
        rows, k = batch.rows, batch.rows[:, 0]
        if (rows[:, 1:].min() < 0 or (rows[:, 1] + rows[:, 3] > local[k]).any()
                or (rows[:, 2] + rows[:, 3] > remote[k]).any()):
            raise ValueError(f"a span lies outside its pool (kinds {batch.kinds})")

    def state(self, handle: _Write) -> str:
        if handle.state != "PROC" or handle.released:
            return handle.state
        target = self._directory.get(handle.peer.nixl_name)
        if (self._closed or self._dead or target is None
                or self._peers.get(handle.peer.name) is not handle.peer):
            handle.state = "ERR"       # the peer (or this agent) went away with the write in flight
            return handle.state
        if handle.polls_left > 0:
            handle.polls_left -= 1
            return "PROC"
        src = [self._flat[k] for k in handle.batch.kinds]
        dst = [target._flat[k] for k in handle.batch.kinds]
        for k, s, d, n in handle.batch.rows.tolist():
            dst[k][d:d + n].copy_(src[k][s:s + n])
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        handle.state = "DONE"
        return handle.state

    def release(self, handle: _Write) -> None:
        """Forget the write; one still in flight never lands."""
        handle.released = True

    # --- notifications

    def notify(self, nixl_name: str, data: bytes) -> bool:
        if self._closed or self._dead:
            return False
        if not any(p.nixl_name == nixl_name for p in self._peers.values()):
            return False
        target = self._directory.get(nixl_name)
        if target is None:
            return False
        target._inbox[bytes(data[:1])].append((self.nixl_name, bytes(data)))
        return True

    def recv(self, tag: bytes) -> list[tuple[str, bytes]]:
        if self._dead:
            return []
        return self._inbox.pop(tag, [])

    def close(self) -> None:
        """Forget peers and leave the directory. The agent is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        self._directory.unregister(self.nixl_name)

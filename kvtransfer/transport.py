"""The agent interface the protocol (Sender, Receiver, fault Notifier) drives, and that both agents
implement: `agent.Agent` (NIXL: UCX or CUDA IPC between processes and hosts) and
`local_agent.LocalAgent` (pools of one process, copied in that process).

An agent owns a worker's pool buffers and knows its peers by their metadata blob:

    metadata() ──out of band──▶ peer.add_peer(name, blob) → RemotePeer
    write(peer, spans) → handle;  state(handle): "PROC" → "DONE" | "ERR";  release(handle)
    notify(peer NIXL name, message);  recv(tag) → [(sender NIXL name, message)]

Identity: `name` is the worker's stable name, `epoch` a fresh random id per incarnation, and
`nixl_name` = "<name>#<epoch>" the address peers write and notify to; a restarted worker is a new
incarnation, so nothing addressed to its previous one reaches it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from .regions import Span, SpanBatch, as_batch


class TransferError(RuntimeError):
    """The transfer was refused or could not be posted (NIXL, or an in-process peer gone)."""


@dataclass(frozen=True)
class RemotePeer:
    """A peer loaded from its metadata blob. pools: kind -> (base address, nbytes, device id);
    host: its host id; ipc: kind -> exported CUDA IPC handle (empty unless it offers them);
    uuid: its GPU's UUID."""

    name: str
    epoch: str
    nixl_name: str
    mem_type: str
    pools: tuple[tuple[str, tuple[int, int, int]], ...]
    host: str = ""
    ipc: tuple[tuple[str, str], ...] = ()
    uuid: str = ""

    def pool(self, kind: str) -> tuple[int, int, int]:
        region = self.regions.get(kind)
        if region is None:
            raise KeyError(f"peer {self.name!r} has no pool {kind!r}")
        return region

    @cached_property
    def regions(self) -> dict[str, tuple[int, int, int]]:
        """kind -> (base address, nbytes, device id), looked up on every write. Cached on this
        incarnation's object: a restarted peer is a new RemotePeer, so nothing derived from an
        old registration is ever reused for it."""
        return dict(self.pools)


def metadata_epoch(metadata: bytes) -> str:
    """The incarnation (epoch) an agent's metadata blob describes."""
    return str(json.loads(metadata)["epoch"])


def split_nixl_name(nixl_name: str) -> tuple[str, str]:
    """'<name>#<epoch>' -> (name, epoch)."""
    name, _, epoch = nixl_name.rpartition("#")
    return name, epoch


class TransferAgent(Protocol):
    name: str
    epoch: str
    nixl_name: str
    pools: dict[str, torch.Tensor]          # kind -> uint8 [num_pages, page_bytes]
    writes_by_path: dict[str, int]          # data path -> writes posted on it

    def metadata(self) -> bytes:
        """Handshake blob for peers' add_peer() (JSON with at least "name" and "epoch")."""
        ...

    def add_peer(self, name: str, metadata: bytes) -> RemotePeer:
        """Load a peer; the same epoch again is a no-op, a new epoch replaces the old one."""
        ...

    def remove_peer(self, name: str) -> None: ...

    def peer(self, name: str) -> RemotePeer | None: ...

    def transport(self, peer_name: str) -> str:
        """The data path writes to this peer take (KeyError for an unknown peer)."""
        ...

    def write(self, peer_name: str, spans: SpanBatch | Sequence[tuple[str, Span]],
              epoch: str | None = None, sync_stream: bool = False) -> Any:
        """Post a write of `spans` from this agent's pools into the peer's; a handle for
        state()/release(), None when there are no spans. Raises KeyError (unknown peer or kind),
        ValueError (a span outside its pool), TransferError (refused, e.g. `epoch` is not the
        loaded incarnation's, or the peer cannot be reached)."""
        ...

    def state(self, handle: Any) -> str:
        """"DONE" (the bytes landed at the peer), "PROC" or "ERR"."""
        ...

    def release(self, handle: Any) -> None: ...

    def notify(self, nixl_name: str, data: bytes) -> bool:
        """Send a notification to a loaded peer; False if unknown or undeliverable."""
        ...

    def recv(self, tag: bytes) -> list[tuple[str, bytes]]:
        """Notifications whose first byte is `tag`, as (sender NIXL name, message), oldest first."""
        ...

    def close(self) -> None: ...


def check_pools(pools: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device of `pools` (CPU when empty); raises ValueError unless every pool is a
    contiguous uint8 [pages, bytes] tensor on that device."""
    devices = {t.device for t in pools.values()}
    if len(devices) > 1:
        raise ValueError(f"all pools must live on one device, got {devices}")
    for kind, t in pools.items():
        if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"pool {kind!r} must be a contiguous uint8 [pages, bytes] tensor")
    return next(iter(devices)) if devices else torch.device("cpu")


def incarnation(name: str) -> tuple[str, str]:
    """A fresh (epoch, NIXL name "<name>#<epoch>") for an agent named `name` (non-empty, no '#')."""
    if not name or "#" in name:
        raise ValueError(f"agent name must be non-empty without '#': {name!r}")
    epoch = secrets.token_hex(8)
    return epoch, f"{name}#{epoch}"


def memory_of(device: torch.device) -> tuple[str, int]:
    """(NIXL memory type, device id) of pools on `device`."""
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def resolve_write(peers: Mapping[str, RemotePeer], peer_name: str, spans: SpanBatch | Sequence[tuple[str, Span]],
                  epoch: str | None) -> tuple[RemotePeer, SpanBatch] | None:
    """The loaded peer and the span batch of `write(peer_name, spans, epoch)`; None when there are
    no spans. Raises KeyError for an unknown peer, TransferError when `epoch` names another
    incarnation than the one loaded."""
    batch = as_batch(spans)
    if not batch.count:
        return None
    peer = peers.get(peer_name)
    if peer is None:
        raise KeyError(f"unknown peer {peer_name!r}")
    if epoch is not None and epoch != peer.epoch:
        raise TransferError(f"{peer_name!r} is now epoch {peer.epoch}, not {epoch}")
    return peer, batch

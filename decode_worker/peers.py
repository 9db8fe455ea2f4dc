"""The other processes as a decode worker sees them: the NIXL peers it loaded; workers by registry
load and by actor name (a worker's id, its agent's name and its actor's name are one string;
`get_actor` is Ray's, or `InProcess.get_actor` for workers of one process); whether a sender it
waits on is gone; which routers' leases lapsed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container
from typing import Any

import ray

from decode_worker.router_leases import RouterLeases
from kvtransfer.transport import TransferAgent, metadata_epoch, split_nixl_name
from worker_runtime.registry import Registry
from worker_runtime.wire import WorkerInfo

log = logging.getLogger(__name__)


class StalePeer(RuntimeError):
    """Metadata of an incarnation of a peer that a later one already replaced here."""


class KnownPeers:
    """The peers whose NIXL metadata this worker loaded (so that its acks reach them), by agent
    name: each incarnation (epoch) loaded once. A restarted peer is a new peer: its new epoch
    replaces the old one, and the old one is never loaded again, whoever still names it (a
    router whose registry view predates the restart)."""

    def __init__(self, agent: TransferAgent):
        self.agent = agent
        self.epochs: dict[str, str] = {}  # agent name → epoch loaded
        self.retired: set[tuple[str, str]] = set()  # (agent name, epoch) replaced since

    def load(self, name: str, epoch: str, metadata: bytes) -> str:
        """Load (once) the peer incarnation `name`/`epoch` → its NIXL name. Raises StalePeer for
        a retired incarnation, ValueError for metadata that is not that incarnation's."""
        if (name, epoch) in self.retired:
            raise StalePeer(f"{name} restarted since epoch {epoch}")
        old = self.epochs.get(name)
        if old != epoch:
            if metadata_epoch(metadata) != epoch:
                raise ValueError(f"metadata of {name} is of epoch {metadata_epoch(metadata)}, not {epoch}")
            self.agent.add_peer(name, metadata)
            if old is not None:
                self.retired.add((name, old))
            self.epochs[name] = epoch
        return self.agent.peer(name).nixl_name

    async def load_prefill(self, prefill, info: WorkerInfo | None) -> tuple[str, str] | None:
        """Load the metadata of the prefill worker `prefill` (an actor) → (its NIXL name, its
        epoch), or None if it cannot be reached or is stale: the caller prefills locally. The
        metadata is its registry entry `info`, which the router hands with the request; a caller
        without one (tests, tools) has the worker asked."""
        try:
            name, epoch, metadata = ((info.agent, info.epoch, info.metadata) if info is not None
                                     else await prefill.peer_info.remote())
            return self.load(name, epoch, metadata), epoch
        except Exception as e:
            log.warning("prefill worker unreachable or stale, prefilling locally: %s", e)
            return None


async def migration_targets(registry: Registry, self_id: str, to: str | None,
                            get_actor: Callable[[str], Any]) -> list[tuple[str, object]]:
    """(worker id, actor) of the decode workers to migrate to: `to`, or every other one not
    draining, least loaded first. Workers gone since their last heartbeat are left out."""
    if to is None:
        workers = await asyncio.to_thread(registry.workers, "decode")
        workers = [w for w in workers if w.worker_id != self_id and not w.load.draining]
        names = [w.worker_id for w in sorted(workers, key=lambda w: (w.load.running + w.load.waiting,
                                                                       -w.load.free_pages))]
    else:
        names = [to]
    out = []
    for name in names:
        try:
            out.append((name, get_actor(name)))
        except ValueError:
            continue
    return out


async def sender_gone(nixl_name: str, get_actor: Callable[[str], Any]) -> bool:
    """Whether the sender incarnation `nixl_name` is gone for good: its actor is dead or serves
    under another epoch now. An unreachable one (a partition) is not: it may still write."""
    name, epoch = split_nixl_name(nixl_name)
    try:
        actor = await asyncio.to_thread(get_actor, name)
        return (await asyncio.wait_for(actor.peer_info.remote(), 5.0))[1] != epoch
    except (ValueError, ray.exceptions.RayActorError):
        return True
    except Exception:
        return False


class SenderCheck:
    """Pages a receiver holds for a sender's Fenced are freed early once that sender (that
    incarnation) is gone: asks about the senders named, at most one round a second."""

    def __init__(self, get_actor: Callable[[str], Any]):
        self._get_actor = get_actor
        self._round: asyncio.Future | None = None

    def check(self, senders: set[str], gone: Callable[[str], None]) -> None:
        """Start a round over `senders` unless one runs; `gone(nixl_name)` for each found gone."""
        if senders and (self._round is None or self._round.done()):
            self._round = asyncio.ensure_future(self._ask(senders, gone))

    async def _ask(self, senders: set[str], gone: Callable[[str], None]) -> None:
        for nixl_name in senders:
            if await sender_gone(nixl_name, self._get_actor):
                gone(nixl_name)
        await asyncio.sleep(1.0)


async def watch_routers(registry: Registry, leases: RouterLeases, live: Container[str], grace_s: float,
                        abandon: Callable[[str], None]) -> None:
    """Runs until cancelled: `abandon(request_id)` each request whose router's registry lease
    lapsed (router_leases.py); `live` says which requests are still here."""
    while True:
        await asyncio.sleep(min(1.0, grace_s / 2))
        leases.retain(live)
        routers = leases.routers()
        if not routers:
            continue
        try:
            alive = await asyncio.to_thread(registry.routers_alive, routers)
        except Exception as e:  # Redis down: decide nothing until it answers again
            log.warning("router lease check failed: %s", e)
            continue
        for rid in leases.abandoned(alive, time.time()):
            log.warning("router of %s is gone (lease lapsed): aborting it", rid)
            abandon(rid)

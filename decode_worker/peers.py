"""The other workers as a decode worker finds them: by registry load, and by Ray actor name (a
worker's id, its agent's name and its actor's name are one string)."""

from __future__ import annotations

import asyncio

import ray

from kvtransfer.agent import split_nixl_name
from worker_runtime.registry import Registry


async def migration_targets(registry: Registry, self_id: str, to: str | None) -> list[tuple[str, object]]:
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
            out.append((name, ray.get_actor(name)))
        except ValueError:
            continue
    return out


async def sender_gone(nixl_name: str) -> bool:
    """Whether the sender incarnation `nixl_name` is gone for good: its actor is dead or serves
    under another epoch now. An unreachable one (a partition) is not: it may still write."""
    name, epoch = split_nixl_name(nixl_name)
    try:
        actor = await asyncio.to_thread(ray.get_actor, name)
        return (await asyncio.wait_for(actor.peer_info.remote(), 5.0))[1] != epoch
    except (ValueError, ray.exceptions.RayActorError):
        return True
    except Exception:
        return False

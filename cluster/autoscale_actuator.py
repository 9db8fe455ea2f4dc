"""Actuators: make the prefill and decode pools the size the autoscaling policy asks for.

`RayActuator` runs in the process that owns the pools (the one holding the `LocalCluster`):

    every interval: loads from the registry → desired sizes (cluster/autoscaler.py) → reconcile
      too few   start workers: `LocalCluster.add_worker` in a thread (on Kubernetes the new actor
                waits for the KubeRay autoscaler to bring up a pod that advertises its resource)
      too many  pick the least-loaded ready workers, `drain()` them — routers stop choosing them,
                running decodes migrate live to the other decode workers (or, with `migrate` off,
                finish in place), a prefill worker keeps its KV pages until the decode side
                acknowledged them — and only then `LocalCluster.remove_worker` (stop + kill); on
                Kubernetes the pod, now idle, is removed by the KubeRay autoscaler
    members: starting → ready → draining → removed; a ready worker missing from the registry for
    `lost_after_s` died: it is forgotten (and replaced if the policy still wants it).

A drain has no deadline by default: scale-down never cuts a request short. Desired sizes come
from a callable, so the same actuator serves two modes:

    `Autoscaler(config, ...).step`   the v4serve policy decides (queue depth, page pressure)
    `follow_ray_resources`           one worker per `prefill` / `decode` resource unit in the Ray
                                     cluster: pods are scaled by something else (KEDA); with
                                     `scale_down=False` pods leaving are drained by their preStop
                                     hook (`drain-node` below), never by the actuator

`python -m cluster.autoscale_actuator drain-node [--role R] [--timeout S]` drains every v4serve
worker actor on the Ray node it runs on (decode workers migrate their running requests away) and
returns when they are idle: the preStop hook of a worker pod, so Kubernetes scale-down (KEDA, node
drains, rolling updates) loses no work either.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import ray

from cluster.autoscaler import POOLS
from worker_runtime.registry import Registry
from worker_runtime.wire import WorkerLoad

log = logging.getLogger(__name__)

Desired = Callable[[list[WorkerLoad], float], dict[str, int]]


@dataclass(frozen=True)
class ActuatorOptions:
    interval_s: float = 5.0  # observe → decide → reconcile period
    settle_s: float = 2.0  # a draining worker must be idle this long (> heartbeat + router refresh)
    drain_timeout_s: float | None = None  # None: wait for the work to finish, however long
    lost_after_s: float = 10.0  # a ready worker absent from the registry this long is dead
    scale_down: bool = True  # False when pods leave on their own and drain in their preStop hook
    migrate: bool = True  # a draining decode worker moves its running requests away instead of finishing them


@dataclass
class Member:
    worker_id: str
    role: str
    state: str  # "starting" | "ready" | "draining"
    since: float
    last_seen: float = 0.0
    cancelled: bool = False  # starting, but no longer wanted: drained as soon as it is up


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # "desired" | "add" | "ready" | "add_failed" | "drain" | "drained" | "removed" | "lost"
    role: str
    worker_id: str = ""
    detail: dict = field(default_factory=dict)


def follow_ray_resources(_loads: list[WorkerLoad], _now: float) -> dict[str, int]:
    """One worker per `prefill` / `decode` resource unit the Ray cluster advertises."""
    resources = ray.cluster_resources()
    return {role: int(resources.get(role, 0)) for role in POOLS}


class RayActuator:
    def __init__(self, cluster, registry: Registry, desired: Desired, options: ActuatorOptions = ActuatorOptions(),
                 clock: Callable[[], float] = time.monotonic):
        self.cluster, self.registry, self.desired, self.options, self.clock = cluster, registry, desired, options, clock
        now = clock()
        self.members: dict[str, Member] = {}
        for role in POOLS:
            for i in range(getattr(cluster.options, role)):
                self.members[f"{role}-{i}"] = Member(f"{role}-{i}", role, "ready", now, now)
        self.events: collections.deque[Event] = collections.deque(maxlen=10_000)  # recent, for logs and tests
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._placeholders = 0
        # our own threads: starting an actor blocks for as long as its pod takes to come up, and
        # must not starve the router's registry reads on the default executor
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="v4serve-autoscaler")

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> "RayActuator":
        self._loop_task = asyncio.create_task(self._run())
        return self

    async def stop(self, wait_drains: bool = True) -> None:
        """Stop deciding; by default let drains under way finish (their workers are then removed).
        Workers still starting are not waited for: they are the cluster's to stop."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if wait_drains:
            await asyncio.gather(*(t for t in self._tasks if t.get_name() == "drain"), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        self._pool.shutdown(wait=False)

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # registry down, Ray hiccup: keep the pools as they are, retry
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.options.interval_s)

    # --- one round ------------------------------------------------------------------------
    async def tick(self) -> dict[str, int]:
        workers = await self._in_thread(self.registry.workers)
        now = self.clock()
        loads = [w.load for w in workers]
        seen = {w.worker_id for w in workers}
        for m in list(self.members.values()):
            if m.worker_id in seen:
                m.last_seen = now
            elif m.state == "ready" and now - max(m.last_seen, m.since) > self.options.lost_after_s:
                del self.members[m.worker_id]  # dead (or its node is gone): replaced if still wanted
                self._event("lost", m.role, m.worker_id)
                self._spawn(self._in_thread_coro(self.cluster.remove_worker, m.worker_id), "remove")
        desired = self.desired(loads, now)
        counts = self.counts()
        if any(desired[r] != counts[r] for r in POOLS):
            self._event("desired", "", detail={"desired": desired, "active": counts})
        by_id = {l.worker_id: l for l in loads}
        for role in POOLS:
            self._reconcile(role, desired[role], by_id)
        return desired

    def counts(self) -> dict[str, int]:
        """Workers per pool that count as capacity: starting or ready (not draining, not cancelled)."""
        return {r: len(self._active(r)) for r in POOLS}

    def _active(self, role: str) -> list[Member]:
        return [m for m in self.members.values() if m.role == role and m.state != "draining" and not m.cancelled]

    def _reconcile(self, role: str, want: int, loads: dict[str, WorkerLoad]) -> None:
        active = self._active(role)
        if want > len(active):
            for m in [m for m in self.members.values() if m.role == role and m.cancelled][:want - len(active)]:
                m.cancelled = False  # still starting: wanted again
            active = self._active(role)
        if want > len(active):
            for _ in range(want - len(active)):
                self._placeholders += 1
                m = Member(f"{role}-starting-{self._placeholders}", role, "starting", self.clock())
                self.members[m.worker_id] = m
                self._spawn(self._add(m), "add")
        elif want < len(active) and self.options.scale_down:
            starting = [m for m in active if m.state == "starting"]
            for m in starting[:len(active) - want]:  # not up yet: those go first, once they are
                m.cancelled = True
            excess = len(self._active(role)) - want
            ready = [m for m in self._active(role) if m.state == "ready"]
            ready.sort(key=lambda m: (_busy(loads.get(m.worker_id)), -_index(m.worker_id)))
            for m in ready[:max(0, excess)]:
                m.state = "draining"
                self._spawn(self._drain(m), "drain")

    async def _add(self, placeholder: Member) -> None:
        role = placeholder.role
        self._event("add", role)
        try:
            worker_id = await self._in_thread(self.cluster.add_worker, role)
        except Exception as e:
            log.warning("starting a %s worker failed: %s", role, e)
            self._event("add_failed", role, detail={"error": str(e)})
            return
        finally:
            self.members.pop(placeholder.worker_id, None)
        now = self.clock()
        m = self.members[worker_id] = Member(worker_id, role, "ready", now, now)
        self._event("ready", role, worker_id)
        if placeholder.cancelled:
            m.state = "draining"
            await self._drain(m)

    async def _drain(self, m: Member) -> None:
        self._event("drain", m.role, m.worker_id)
        try:
            actor = ray.get_actor(m.worker_id)
            options = {"settle_s": self.options.settle_s, "timeout_s": self.options.drain_timeout_s}
            if m.role == "decode":
                options["migrate"] = self.options.migrate
            while True:
                result = await actor.drain.remote(**options)
                if result["idle"]:
                    break
                log.warning("%s still busy after %ss of draining; waiting on", m.worker_id,
                            self.options.drain_timeout_s)
            self._event("drained", m.role, m.worker_id, result)
        except (ValueError, ray.exceptions.RayActorError) as e:  # died while draining: nothing left
            log.warning("%s gone while draining: %s", m.worker_id, e)
        await self._in_thread(self.cluster.remove_worker, m.worker_id)
        self.members.pop(m.worker_id, None)
        self._event("removed", m.role, m.worker_id)

    def _in_thread(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _in_thread_coro(self, fn, *args):
        return await self._in_thread(fn, *args)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _event(self, kind: str, role: str, worker_id: str = "", detail: dict | None = None) -> None:
        self.events.append(Event(self.clock(), kind, role, worker_id, detail or {}))
        log.info("autoscaler %s %s %s %s", kind, role, worker_id, detail or "")


def _busy(load: WorkerLoad | None) -> tuple:
    if load is None:
        return (0, 0)
    return (load.running + load.waiting, load.queued_prefill_tokens)


def _index(worker_id: str) -> int:
    try:
        return int(worker_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


# --- preStop: drain the workers of this node --------------------------------------------------
def node_workers(node_id: str, roles: tuple[str, ...] = POOLS, timeout_s: float = 60.0) -> list:
    """Handles of the live v4serve worker actors (named `<role>-<n>`, any namespace) on Ray node
    `node_id`. Each actor is asked where it runs (`__ray_call__`, which every actor has): that
    needs neither Ray's private tables nor the dashboard the state API (ray.util.state) talks to."""
    handles = []
    for named in ray.util.list_named_actors(all_namespaces=True):
        if named["name"].split("-", 1)[0] not in roles:
            continue
        try:
            handles.append(ray.get_actor(named["name"], namespace=named["namespace"]))
        except ValueError:  # gone meanwhile
            continue
    refs = [h.__ray_call__.remote(_node_of) for h in handles]
    out = []
    for handle, ref in zip(handles, refs):
        try:
            if ray.get(ref, timeout=timeout_s) == node_id:
                out.append(handle)
        except ray.exceptions.RayActorError:  # died meanwhile: nothing to drain
            continue
        except ray.exceptions.GetTimeoutError:
            log.warning("worker %s did not say where it runs within %ss; not draining it", handle, timeout_s)
    return out


def _node_of(_actor) -> str:
    return ray.get_runtime_context().get_node_id()


def drain_node(node_id: str, roles: tuple[str, ...] = POOLS, settle_s: float = 2.0,
               timeout_s: float | None = None, migrate: bool = True) -> list[dict]:
    """Drain every v4serve worker on the node (decode workers migrate their running requests to
    decode workers elsewhere); returns their drain results once all are idle."""
    return ray.get([h.drain.remote(settle_s=settle_s, timeout_s=timeout_s,
                                   **({"migrate": migrate} if role == "decode" else {}))
                    for role in roles for h in node_workers(node_id, (role,))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.autoscale_actuator")
    sub = parser.add_subparsers(dest="command", required=True)
    dn = sub.add_parser("drain-node", help="drain the v4serve workers on this Ray node (a pod's preStop hook)")
    dn.add_argument("--address", default="auto", help="Ray address (default: the node this runs on)")
    dn.add_argument("--role", action="append", choices=POOLS, help="only this role (repeatable)")
    dn.add_argument("--settle", type=float, default=2.0)
    dn.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    args = parser.parse_args(argv)
    ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    results = drain_node(ray.get_runtime_context().get_node_id(), tuple(args.role or POOLS), args.settle, args.timeout)
    print(json.dumps(results))
    return 0 if all(r["idle"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

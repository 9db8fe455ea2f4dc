"""The shell every worker actor holds: what a prefill and a decode worker do alike around their
engine and transfers.

    WorkerShell(worker_id, role, options, pools, load, ep, local)
        agent, layout, registry   the KV agent over the pools (NIXL; in-process with `local`), the
                                  layout it publishes, the registry
        get_actor(name)           another worker's handle (Ray's; `local`'s for workers of one process)
        join(seat, model)         an expert-parallel rank joins its group (ep_group.py) before serving
        observe(stats, ...)       the worker's engine metrics (worker_runtime/engine_metrics.py)
        serve(*loops)             start the worker's loops, its registry heartbeat, its metrics
                                  endpoint and stats line (once)
        info() / peer_info()      what the registry publishes / what a peer loads to reach this worker
        drain(busy, ...)          publish `draining`, then wait until `busy()` stayed false for settle_s
        leave_group(reason, ..)   the group broke: stop heart-beating and leave the registry
        stop()                    cancel the loops, leave the registry

The actor keeps what is its own (engine, transfers, requests, its loop) and holds a shell as
`self.shell`. The Ray methods the shell answers alone (SHELL_METHODS) the actor class gets from
`@serves_shell`, each forwarding to the shell: Ray finds actor methods on the class, so they must
be real methods there. The shell never calls back into the actor except through the `load` and
`busy` functions it is handed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable

import ray

from kvtransfer.agent import Agent
from model.kv_pool import KVPools
from worker_runtime.engine_metrics import EngineStats, Sources, WorkerMetrics
from worker_runtime.ep_group import ExpertParallelGroup, Seat, join, listen
from worker_runtime.heartbeat import heartbeat_loop
from worker_runtime.in_process import InProcess
from worker_runtime.kv_link import layout_of, pool_buffers
from worker_runtime.options import ExpertParallelOptions, WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)

DEREGISTER_WAIT_S = 5.0  # leaving the registry never holds a failing worker up longer


class WorkerShell:
    def __init__(self, worker_id: str, role: str, options: WorkerOptions, pools: KVPools,
                 load: Callable[[], WorkerLoad], ep: ExpertParallelOptions, local: InProcess | None = None):
        self.worker_id, self.role, self.options, self.ep = worker_id, role, options, ep
        self._load = load
        self.get_actor = ray.get_actor if local is None else local.get_actor
        if local is not None:
            self.agent = local.agent(worker_id, pool_buffers(pools))
        else:  # NIXL's progress thread spins a core; on CPU pools the worker loop's polling drives transfers
            self.agent = Agent(worker_id, pool_buffers(pools), progress_thread=pools.buffers["swa"].is_cuda)
        self.layout = layout_of(pools)
        self.pools, self.local = pools, local is not None
        self.metrics: WorkerMetrics | None = None
        self.registry = Registry(options.registry_url, options.cluster)
        self.draining = False
        self.group: ExpertParallelGroup | None = None  # set once this worker joined an expert-parallel group
        self._store = None  # rank 0: the group's rendezvous store
        self._tasks: list[asyncio.Task] = []
        self._heartbeat: asyncio.Task | None = None

    # --- starting -------------------------------------------------------------------------
    def ep_listen(self) -> tuple[str, int]:
        """Rank 0 of an expert-parallel group: host its rendezvous store; → (host, port) for the Seats."""
        self._store, host = listen(self.ep)
        return host, self._store.port

    async def join(self, seat: Seat | None, model) -> bool:
        """With a `seat`, join that expert-parallel group (every rank of it must be starting: this
        waits for them, at most the group's timeout); → whether it joined now."""
        if seat is None or self.group is not None:
            return False
        self.group = await asyncio.to_thread(join, seat, self.ep, self.options.device, model, self._store)
        return True

    def observe(self, stats: EngineStats, transfers: Callable[[], dict] = dict,
                counts: Callable[[], dict] = dict) -> None:
        """Export the engine's `stats`, this worker's load and KV use, and its transfer and
        migration counters; served from `serve` on."""
        def kv_usage() -> dict[str, float]:
            free = self.pools.num_free()
            return {k: 1 - free[k] / spec.num_pages for k, spec in self.pools.specs.items() if spec.num_pages}
        self.metrics = WorkerMetrics(self.worker_id, self.role, self.options.metrics, stats,
                                     Sources(self._load, kv_usage, transfers, counts))

    def serve(self, *loops: Callable[[], Awaitable[None]]) -> dict:
        """Run `loops`, the registry heartbeat and the stats line as tasks, and the metrics
        endpoint (a second call starts nothing); → what the launcher logs (its metrics URL)."""
        if not self._tasks:
            self._heartbeat = asyncio.create_task(heartbeat_loop(self.registry, self.info, self.options.heartbeat_s))
            self._tasks = [asyncio.create_task(loop()) for loop in loops] + [self._heartbeat]
            if self.metrics is not None and self.options.logs.stats_interval_s > 0:
                self._tasks.append(asyncio.create_task(self.metrics.log_stats(self.options.logs.stats_interval_s)))
        url = None
        if self.metrics is not None:
            url = self.metrics.serve("127.0.0.1" if self.local else ray.util.get_node_ip_address())
        return {"worker_id": self.worker_id, "agent": self.agent.name, "epoch": self.agent.epoch, "metrics": url}

    async def ep_wake(self, meeting: int) -> None:
        """A peer of the group got work while it idled: meet now (`ExpertParallelGroup.woken`)."""
        if self.group is not None:  # else still joining: its first meeting comes at once anyway
            self.group.woken(meeting)

    def ep_status(self) -> dict | None:
        """This rank's expert-parallel group state and the experts it holds (None: not in a group)."""
        return None if self.group is None else self.group.status()

    # --- what others see ------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        load = dataclasses.replace(self._load(), draining=self.draining)
        return WorkerInfo(self.worker_id, self.role, self.worker_id, self.agent.name, self.agent.epoch,
                          self.layout.to_bytes().decode(), self.agent.metadata(), load)

    def peer_info(self) -> tuple[str, str, bytes]:
        """(agent name, epoch, metadata): what a peer loads to exchange transfers with this worker
        (`decode_worker/peers.py` asks it whether a sender is still the incarnation it was)."""
        return self.agent.name, self.agent.epoch, self.agent.metadata()

    # --- leaving --------------------------------------------------------------------------
    async def drain(self, busy: Callable[[], Awaitable[bool]], settle_s: float, timeout_s: float | None,
                    poll_s: float = 0.05) -> bool:
        """Turn `draining` (published at once, so routers skip this worker from their next refresh
        on), then → True once `busy()` has been false for `settle_s` on end, False if `timeout_s`
        passes first (the worker stays draining; nothing is cut short)."""
        self.draining = True
        try:
            await asyncio.to_thread(self.registry.heartbeat, self.info())
        except Exception as e:  # Redis down: the next regular heartbeat publishes it
            log.warning("publishing drain of %s failed: %s", self.worker_id, e)
        loop = asyncio.get_running_loop()
        start, quiet = loop.time(), None
        while True:
            is_busy = await busy()
            now = loop.time()
            quiet = None if is_busy else (now if quiet is None else quiet)
            if quiet is not None and now - quiet >= settle_s:
                return True
            if timeout_s is not None and now - start >= timeout_s:
                return False
            await asyncio.sleep(poll_s)

    async def leave_group(self, reason: str, then: str) -> None:
        """The expert-parallel group broke: log it, stop heart-beating and leave the registry, so
        routers stop choosing this worker. `then`: what the worker does next (for the log)."""
        log.error("expert-parallel group of %s (rank %d of %d) failed: %s; leaving the registry, %s",
                  self.worker_id, self.group.seat.rank, self.group.seat.world, reason, then)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.registry.deregister, self.worker_id), DEREGISTER_WAIT_S)
        except Exception as e:  # Redis down: the key expires by itself
            log.warning("deregistering %s failed: %s", self.worker_id, e)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)  # waits for the server's loop to notice
        await asyncio.to_thread(self.registry.deregister, self.worker_id)


# what Ray calls on a worker that its shell answers alone (the launcher, the group's peers, the
# decode workers' `sender_gone`)
SHELL_METHODS = ("ep_listen", "ep_wake", "ep_status", "peer_info", "stop")


def serves_shell(cls: type) -> type:
    """Class decorator of a worker actor holding `self.shell`: adds SHELL_METHODS to the class."""
    for name in SHELL_METHODS:
        setattr(cls, name, _forward(name))
    cls.__repr__ = _worker_id  # Ray prefixes the lines an actor logs with its repr: `(decode-0 pid=...)`
    return cls


def _worker_id(self) -> str:
    return self.worker_id


def _forward(name: str):
    """A method calling `WorkerShell.<name>` of `self.shell` (a coroutine where the shell's is
    one, so that it runs on the actor's event loop alike)."""
    target = getattr(WorkerShell, name)
    if inspect.iscoroutinefunction(target):
        @functools.wraps(target)
        async def method(self, *args, **kwargs):
            return await getattr(self.shell, name)(*args, **kwargs)
    else:
        @functools.wraps(target)
        def method(self, *args, **kwargs):
            return getattr(self.shell, name)(*args, **kwargs)
    return method

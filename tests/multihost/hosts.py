"""Hosts on one machine: N network namespaces on a bridge, each with its own address, loopback
and processes, and the faults a real network of machines has (a host crashing, a link going
down, two hosts partitioned from each other).

    namespace <run>-br: bridge br0, ports p0 .. pN-1
    namespace <run>-h<i>: eth0 = 10.213.0.(i+1)/24 (veth to p<i>), lo; nothing else

No host has a route anywhere else, so traffic stays among these addresses. The namespaces share
the machine's memory and IPC: a transport that looks for peers on "the same host" (UCX's shared
memory, CUDA IPC) would still find them, so processes that must talk over the network are told
so (`UCX_ENV`).

Lifetime: names carry the owning process id and a run number (`v4m-<pid>-<n>-...`), so runs
never collide. `Hosts.up()` first sweeps the namespaces of runs whose owner is gone (a test
killed with SIGKILL), and starts a reaper process that removes this run's namespaces, and kills
every process in them, as soon as the owner dies or `limit_s` passes: whatever happens to the
test, nothing outlives it for long. `down()` does the same at once.

    python -m tests.multihost.hosts --sweep      # remove every leftover run's namespaces now

Needs root and iproute2; `unavailable()` says why not otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

PREFIX = "v4m"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(br|h\d+)$")
# UCX only over TCP on the host's own interface: no shared memory, no loopback between "hosts"
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
_RUNS = itertools.count()  # run numbers of this process (a counter, not state: names only)


def _ip(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """None if namespaces, veth pairs and a bridge can be made here, else why not."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    try:
        with tempfile.TemporaryDirectory() as tmp, Hosts(1, limit_s=60, log_dir=Path(tmp)) as hosts:
            hosts.run(0, ["true"])
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"cannot build network namespaces here: {e}"
    return None


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def pids_in(ns: str) -> list[int]:
    """Every process whose network namespace is `ns`."""
    try:
        target = os.stat(f"/run/netns/{ns}").st_ino
    except FileNotFoundError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                found.append(int(entry))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


def kill_all(ns: str) -> list[int]:
    """SIGKILL every process in namespace `ns` (a host losing power); → their pids."""
    me = os.getpid()
    pids = [p for p in pids_in(ns) if p != me]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def remove_run(run: str) -> None:
    """Kill the processes of run `run`'s namespaces and delete them (the veths go with them)."""
    mine = [ns for ns in namespaces() if ns.startswith(run + "-")]
    for ns in mine:
        kill_all(ns)
    for ns in mine:
        _ip("netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Remove the namespaces of runs whose owning process is gone; → the runs removed."""
    runs = set()
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and not _alive(int(m.group(1))):
            runs.add(f"{PREFIX}-{m.group(1)}-{m.group(2)}")
    for run in sorted(runs):
        remove_run(run)
    return sorted(runs)


@dataclass(frozen=True)
class Host:
    index: int
    ns: str
    ip: str


class Hosts:
    """`n` hosts on a bridge. Use as a context manager, or `up()` / `down()`."""

    def __init__(self, n: int, subnet: str = "10.213.0", limit_s: float = 1800.0, log_dir: Path | None = None):
        if not 1 <= n <= 200:
            raise ValueError(f"1..200 hosts, got {n}")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be a private 10.a.b prefix, got {subnet!r}")
        self.run_id = f"{PREFIX}-{os.getpid()}-{next(_RUNS)}"
        self.subnet, self.limit_s = subnet, limit_s
        self.hosts = tuple(Host(i, f"{self.run_id}-h{i}", f"{subnet}.{i + 1}") for i in range(n))
        self.bridge = f"{self.run_id}-br"
        self.log_dir = log_dir or Path("/tmp") / self.run_id
        self._procs: list[subprocess.Popen] = []
        self._reaper: subprocess.Popen | None = None

    @classmethod
    def attach(cls, run_id: str, n: int, subnet: str, log_dir: Path) -> Hosts:
        """The hosts of run `run_id`, built by another process (which owns and removes them)."""
        self = cls.__new__(cls)
        self.run_id, self.subnet, self.limit_s, self.log_dir = run_id, subnet, 0.0, log_dir
        self.hosts = tuple(Host(i, f"{run_id}-h{i}", f"{subnet}.{i + 1}") for i in range(n))
        self.bridge = f"{run_id}-br"
        self._procs, self._reaper = [], None
        return self

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    # --- lifecycle ------------------------------------------------------------------------
    def up(self) -> Hosts:
        sweep()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # the reaper first: from here on, a dying owner leaves nothing behind
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "tests.multihost.hosts", "--reap", self.run_id, "--owner", str(os.getpid()),
             "--limit", str(self.limit_s)], cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.ns)
                _ip("link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name", f"p{h.index}",
                    "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", f"p{h.index}", "master", "br0")
                _ip("-n", self.bridge, "link", "set", f"p{h.index}", "up")
                _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
                _ip("-n", h.ns, "link", "set", "eth0", "up")
                _ip("-n", h.ns, "link", "set", "lo", "up")
        except Exception:
            self.down()
            raise
        return self

    def down(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process started here (all at once), give them `grace_s` together, then
        kill whatever is left in the namespaces and delete them."""
        for proc in self._procs:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        remove_run(self.run_id)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None

    # --- processes ------------------------------------------------------------------------
    def argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i].ns, *argv]

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None, log: str | None = None,
              **kw) -> subprocess.Popen:
        """Start `argv` on host `i` in a session of its own (so it and its children stop as a
        group); output to `log_dir/<log>` when named."""
        out = (self.log_dir / log).open("ab") if log else subprocess.DEVNULL
        proc = subprocess.Popen(self.argv(i, argv), env=env, stdout=kw.pop("stdout", out),
                                stderr=kw.pop("stderr", subprocess.STDOUT), start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(self.argv(i, argv), check=False, capture_output=True, text=True, timeout=timeout,
                             env=env)
        if check and out.returncode:
            raise RuntimeError(f"on host {i}: {' '.join(argv)} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        return out

    def crash(self, i: int) -> list[int]:
        """Host `i` loses power: every process in it is SIGKILLed at once; → their pids."""
        return kill_all(self.hosts[i].ns)

    # --- network faults -------------------------------------------------------------------
    def link(self, i: int, up: bool) -> None:
        """Host `i`'s only link down (cut off from every other host) or up again."""
        _ip("-n", self.hosts[i].ns, "link", "set", "eth0", "up" if up else "down")

    def partition(self, a: int, b: int) -> None:
        """Hosts `a` and `b` stop reaching each other, silently (packets vanish, no error), while
        both still reach everyone else: each addresses the other's frames to a MAC nobody has."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.hosts[x].ns, "neigh", "replace", self.hosts[y].ip, "lladdr", "02:00:00:00:de:ad",
                "nud", "permanent", "dev", "eth0")

    def heal(self, a: int, b: int) -> None:
        """Undo `partition(a, b)`: the hosts learn each other's address again (ARP)."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.hosts[x].ns, "neigh", "del", self.hosts[y].ip, "dev", "eth0", check=False)

    def counters(self, i: int) -> dict[str, int]:
        """Bytes and packets host `i`'s eth0 sent and received."""
        base = "/sys/class/net/eth0/statistics/"
        out = self.run(i, ["cat", *(base + k for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"))]).stdout
        return dict(zip(("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"), map(int, out.split())))


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group of `proc` (its session: it and its children)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _reap(run: str, owner: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while _alive(owner) and time.monotonic() < deadline:
        time.sleep(1.0)
    remove_run(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.multihost.hosts")
    parser.add_argument("--sweep", action="store_true", help="remove leftover runs' namespaces")
    parser.add_argument("--reap", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--owner", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, default=1800.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reap:
        _reap(args.reap, args.owner, args.limit)
    elif args.sweep:
        print("\n".join(sweep()) or "nothing left over")
    return 0


if __name__ == "__main__":
    sys.exit(main())

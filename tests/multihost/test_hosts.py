"""The hosts harness itself (no Ray): hosts reach each other and nothing else, the faults do what
they say, and nothing outlives a run, even one killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.hosts import Hosts, namespaces, sweep

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
SERVE = ("import socket\ns = socket.create_server(('{ip}', 9000))\nwhile True:\n"
         "    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n")
CONNECT = "import socket; print(socket.create_connection(('{ip}', 9000), timeout=1.5).recv(2).decode())"


def reaches(hosts: Hosts, src: int, dst: int) -> bool:
    out = hosts.run(src, [sys.executable, "-c", CONNECT.format(ip=hosts[dst].ip)], check=False, timeout=20)
    return out.stdout.strip() == "hi"


def test_faults_cut_exactly_what_they_name():
    with Hosts(3, subnet="10.217.0", limit_s=120) as hosts:
        hosts.popen(1, [sys.executable, "-c", SERVE.format(ip=hosts[1].ip)])
        hosts.popen(2, [sys.executable, "-c", SERVE.format(ip=hosts[2].ip)])
        deadline = time.monotonic() + 20
        while not (reaches(hosts, 0, 1) and reaches(hosts, 0, 2)):
            assert time.monotonic() < deadline, "the servers never answered"
        # no route out: the machine's own addresses and the world are unreachable
        out = hosts.run(0, [sys.executable, "-c", "import socket; socket.create_connection(('1.1.1.1', 53), 1)"],
                        check=False)
        assert "unreachable" in out.stderr.lower()
        hosts.partition(0, 1)  # 0 and 1 lose each other, nobody else
        assert not reaches(hosts, 0, 1) and reaches(hosts, 0, 2) and reaches(hosts, 2, 1)
        hosts.heal(0, 1)
        assert reaches(hosts, 0, 1)
        hosts.link(2, False)  # host 2 loses everyone
        assert not reaches(hosts, 0, 2) and not reaches(hosts, 1, 2) and reaches(hosts, 0, 1)
        hosts.link(2, True)
        assert reaches(hosts, 0, 2)
        sent = hosts.counters(1)["tx_bytes"]
        assert reaches(hosts, 0, 1) and hosts.counters(1)["tx_bytes"] > sent
        killed = hosts.crash(1)  # every process of host 1, and only those
        assert killed and not reaches(hosts, 0, 1) and reaches(hosts, 0, 2)
    assert not [ns for ns in namespaces() if ns.startswith(hosts.run_id)]


def test_a_killed_owner_leaves_nothing_behind(tmp_path):
    """SIGKILL the process owning the hosts (a test killed mid-run): its reaper removes them, and
    their processes, within seconds; `sweep()` is the backstop for a reaper killed too."""
    script = ("import sys, time\nfrom tests.multihost.hosts import Hosts\n"
              "h = Hosts(2, subnet='10.218.0', limit_s=600).up()\n"
              "h.popen(1, [sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print(h.run_id, flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    run_id = owner.stdout.readline().strip()
    assert run_id and [ns for ns in namespaces() if ns.startswith(run_id)]
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while [ns for ns in namespaces() if ns.startswith(run_id)]:
        assert time.monotonic() < deadline, f"{run_id} still there 30 s after its owner died"
        time.sleep(0.5)
    assert not [run for run in sweep() if run == run_id]  # nothing left for the sweep either

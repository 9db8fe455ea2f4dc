"""`v4serve up` (or `v4serve router`) on one of the hosts, joined to the Ray cluster and registry
of `RayHosts` (RAY_ADDRESS, REDIS_URL), its router listening on that host's address."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.multihost.hosts import Hosts
from tests.multihost.ray_hosts import RayHosts

ROOT = Path(__file__).resolve().parents[2]
HTTP_PORT, GRPC_PORT = 8000, 50051


class UpOnHost:
    """`v4serve COMMAND --model MODEL ARGS...` on host `host` (COMMAND `up`, or `router` to serve
    the pools an `up` elsewhere owns); blocks until its ready line."""

    def __init__(self, hosts: Hosts, ray_hosts: RayHosts, host: int, model_dir: Path, args: list[str],
                 timeout_s: float = 300.0, command: str = "up"):
        ip = hosts[host].ip
        self.http, self.grpc = f"http://{ip}:{HTTP_PORT}", f"{ip}:{GRPC_PORT}"
        self.log = hosts.log_dir / f"{command}-h{host}.log"
        env = ray_hosts.env(XDG_CACHE_HOME=str(hosts.log_dir / "cache"))
        self.proc = hosts.popen(
            host, [sys.executable, "-m", "cluster.cli", command, "--model", str(model_dir), "--host", ip,
                   "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT), *args],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.ready = ""
        seen = threading.Event()
        threading.Thread(target=self._drain, args=(seen,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not seen.wait(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"v4serve up exited with {self.proc.returncode} (see {self.log})")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"v4serve up was not ready after {timeout_s:.0f}s (see {self.log})")

    def _drain(self, seen: threading.Event) -> None:
        """Every line to the log (a full pipe would stall the server); notes the ready line."""
        with self.log.open("a") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                if not self.ready and line.startswith("v4serve") and " ready " in line:
                    self.ready = line.strip()
                    seen.set()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as an operator would; its exit status (killed after `timeout_s`: -9)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

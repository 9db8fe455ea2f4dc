"""A test's hands on one host: a process started inside a host's namespace (`Agent(hosts, i)`)
that serves requests from the test over its stdin/stdout, one JSON line each, concurrently.

The test process itself stays in the machine's own namespace, which has no route to the hosts;
this process reaches them as any process on host i would: HTTP and gRPC to a router, and Ray as
a driver joined to the cluster at RAY_ADDRESS (in the pools' Ray namespace), for what only Ray
can tell (where each worker runs, its page accounting) or do (migrate a worker's requests).

    agent = Agent(hosts, 0, env, cluster="default")
    agent.call("placement")                      # {"prefill-0": {"ip": ..., "pid": ...}, ...}
    future = agent.submit("generate", requests=[...])   # while something else happens
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import count
from pathlib import Path

from tests.multihost.hosts import Hosts

ROOT = Path(__file__).resolve().parents[2]


class Agent:
    def __init__(self, hosts: Hosts, host: int, env: dict[str, str], cluster: str = "default"):
        log = (hosts.log_dir / f"agent-h{host}.log").open("ab")
        self.proc = hosts.popen(host, [sys.executable, "-m", "tests.multihost.agent", cluster], env=env, cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        self._ids = count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def submit(self, op: str, **args) -> Future:
        fut: Future = Future()
        with self._lock:
            i = next(self._ids)
            self._pending[i] = fut
            self.proc.stdin.write(json.dumps({"id": i, "op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
        return fut

    def call(self, op: str, timeout: float = 300.0, **args):
        return self.submit(op, **args).result(timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            fut = self._pending.pop(msg["id"])
            if "error" in msg:
                fut.set_exception(RuntimeError(msg["error"]))
            else:
                fut.set_result(msg["result"])
        for fut in list(self._pending.values()):
            fut.set_exception(RuntimeError("the agent process exited"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# --- the process on the host -----------------------------------------------------------------
class _Ops:
    def __init__(self, cluster: str):
        self.cluster = cluster
        self._ray_lock = threading.Lock()

    def _ray(self):
        import ray

        from cluster.launcher import address_toward, ray_namespace

        with self._ray_lock:
            if not ray.is_initialized():
                ray.init(address=os.environ["RAY_ADDRESS"], namespace=ray_namespace(self.cluster),
                         log_to_driver=False, configure_logging=False,
                         _node_ip_address=address_toward(os.environ["RAY_ADDRESS"]))  # this host's node
        return ray

    def _workers(self) -> dict:
        ray = self._ray()
        from cluster.launcher import ray_namespace

        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == ray_namespace(self.cluster))
        out = {}
        for name in names:
            try:
                out[name] = ray.get_actor(name)
            except ValueError:  # gone meanwhile
                continue
        return out

    def placement(self) -> dict:
        """Worker id → the IP of the node its actor runs on, and its process id."""
        ray = self._ray()
        out = {}
        for name, actor in self._workers().items():
            try:
                ip, pid = ray.get(actor.__ray_call__.remote(
                    lambda _self: (__import__("ray").util.get_node_ip_address(), __import__("os").getpid())),
                    timeout=20)
            except Exception:  # noqa: BLE001, S112 - dead or unreachable: not placed anywhere now
                continue
            out[name] = {"ip": ip, "pid": pid}
        return out

    def accounting(self, drop_cache: bool = False) -> dict:
        ray = self._ray()
        out = {}
        for name, actor in self._workers().items():
            kw = {"drop_cache": True} if drop_cache and name.startswith("prefill") else {}
            try:
                out[name] = ray.get(actor.page_accounting.remote(**kw), timeout=20)
            except Exception:  # noqa: BLE001, S112 - dead or unreachable
                continue
        return out

    def wait_field(self, worker: str, field: str, at_least: int = 1, timeout_s: float = 60.0) -> bool:
        """Until `worker`'s page_accounting[field] is at least `at_least` (False: the time ran out)."""
        ray = self._ray()
        actor = ray.get_actor(worker)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ray.get(actor.page_accounting.remote(), timeout=20).get(field, 0) >= at_least:
                return True
            time.sleep(0.02)
        return False

    def migrate(self, worker: str, to: str) -> list:
        ray = self._ray()
        return ray.get(ray.get_actor(worker).migrate.remote(to=to), timeout=120)

    def generate(self, requests: list[dict], timeout_s: float = 300.0) -> list[list[int]]:
        """Each request {door: http|grpc, url, prompt, max_tokens, temperature, seed, stream}, all at
        once; → the tokens of each (or {"error": ...})."""
        with ThreadPoolExecutor(max(1, len(requests))) as pool:
            return list(pool.map(lambda r: _one(r, timeout_s), requests))

    def metrics(self, url: str) -> dict:
        import httpx

        out = {}
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def _one(r: dict, timeout_s: float):
    try:
        if r["door"] == "grpc":
            import grpc

            from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc

            with grpc.insecure_channel(r["url"]) as channel:
                req = pb.GenerateRequest(prompt_token_ids=r["prompt"], max_tokens=r["max_tokens"],
                                         temperature=r["temperature"], seed=r["seed"])
                return [t for m in pb_grpc.InferenceStub(channel).Generate(req, timeout=timeout_s) for t in m.token_ids]
        import httpx

        body = {"model": "v4serve", "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                "temperature": r["temperature"], "seed": r["seed"], "return_token_ids": True,
                "stream": r.get("stream", False)}
        with httpx.Client(timeout=timeout_s) as client:
            if not body["stream"]:
                resp = client.post(r["url"] + "/v1/completions", json=body)
                resp.raise_for_status()
                return resp.json()["choices"][0]["token_ids"]
            tokens = []
            with client.stream("POST", r["url"] + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return {"error": chunk["error"]}
                        tokens += [t for c in chunk["choices"] for t in c.get("token_ids") or []]
            return tokens
    except Exception as e:  # noqa: BLE001 - reported to the test, which decides
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    ops = _Ops(sys.argv[1] if len(sys.argv) > 1 else "default")
    lock = threading.Lock()

    def serve(msg: dict) -> None:
        try:
            reply = {"id": msg["id"], "result": getattr(ops, msg["op"])(**msg["args"])}
        except Exception as e:  # noqa: BLE001 - the test sees it as the call's exception
            reply = {"id": msg["id"], "error": f"{type(e).__name__}: {e}"}
        with lock:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    with ThreadPoolExecutor(16) as pool:
        for line in sys.stdin:
            pool.submit(serve, json.loads(line))


if __name__ == "__main__":
    main()

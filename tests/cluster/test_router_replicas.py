"""Router replicas: one process owns the pools (`v4serve up`, with its own Ray and Valkey), two
`v4serve router` processes join them through RAY_ADDRESS and REDIS_URL and serve — as the Helm
chart runs them. Through both routers at once requests give exactly the tokens of `v4serve
generate` (invariant 1); both see the same workers and build the same prefix index from the
registry; a router killed and started again serves again while the pools keep running (the
workers' epochs do not change); a second owner of the same pools is refused."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from cluster.autoscaler import AutoscalerConfig, signals
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from worker_runtime.registry import Registry
from worker_runtime.wire import WorkerLoad

pytestmark = pytest.mark.cluster  # starts Ray

openai = pytest.importorskip("openai")
pytest.importorskip("nixl")

COMMON = ["--http-port", "0", "--grpc-port", "0", "--max-model-len", "1024", "--remote-prefill-threshold", "64"]


class Served:
    """A `v4serve up` / `v4serve router` subprocess; the fields of its ready line."""

    def __init__(self, args: list[str], env: dict, timeout_s: float = 180):
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.args, self.timeout_s, self.fields, self.log = args, timeout_s, {}, []

    def ready(self) -> "Served":
        deadline = time.time() + self.timeout_s
        for line in self.proc.stdout:
            self.log.append(line)
            if " ready " in line:
                self.fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                # keep reading: the process logs on (workers' stats lines), and a full pipe would block it
                threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
                return self
            assert time.time() < deadline, f"{self.args[0]} did not become ready:\n{''.join(self.log[-20:])}"
        raise AssertionError(f"{self.args[0]} exited with {self.proc.wait()}:\n{''.join(self.log[-20:])}")

    @property
    def http(self) -> str:
        return self.fields["http"]

    def stop(self, sig=signal.SIGTERM) -> int:
        children = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"leftover processes: {[p.cmdline()[:3] for p in alive]}"
        return code


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # the routers authenticate to the owner's Ray with the token it keeps in ~/.ray (the chart
    # gives every pod the same token through RAY_AUTH_TOKEN instead)
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache")), "RAY_AUTH_MODE": "token"}


@pytest.fixture(scope="module")
def owner(tiny_official_ckpt, env):
    clean = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "REDIS_URL")}
    served = Served(["up", "--model", str(tiny_official_ckpt), "--prefill", "1", "--decode", "2", *COMMON],
                    clean).ready()
    yield served
    assert served.stop() == 0


def router_env(owner, env) -> dict:
    return {**env, "RAY_ADDRESS": owner.fields["ray"], "REDIS_URL": owner.fields["registry"]}


def start_router(ckpt, owner, env) -> Served:
    return Served(["router", "--model", str(ckpt), *COMMON], router_env(owner, env))


@pytest.fixture(scope="module")
def routers(tiny_official_ckpt, owner, env):
    started = [start_router(tiny_official_ckpt, owner, env) for _ in range(2)]  # start side by side
    served = [r.ready() for r in started]
    yield served
    for r in served:
        if r.proc.poll() is None:
            assert r.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_official_ckpt):
    import torch

    cfg, model = load_checkpoint(tiny_official_ckpt)

    def run(w) -> list[int]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            pools = KVPools(cfg, "fp32", max_tokens=len(w["prompt"]) + w["max_tokens"], max_seqs=1)
            return generate(model, pools, w["prompt"], w["max_tokens"],
                            SamplingParams(temperature=w["temperature"], seed=w["seed"]),
                            stop_ids=frozenset({cfg.eos_token_id})).token_ids
        finally:
            torch.set_num_threads(threads)
    return run


def workload(n: int, seed: int) -> list[dict]:
    """Prompts long enough for a prefill worker (>= 64 tokens) and for its prefix cache to keep
    pages (> 2 pages of 256 tokens), with short ones mixed in; greedy and seeded sampling."""
    rng = random.Random(seed)
    shared = [rng.randrange(32, 127) for _ in range(520)]
    out = []
    for i in range(n):
        body = [rng.randrange(32, 127) for _ in range(rng.randrange(3, 200))]
        prompt = (shared + body) if i % 2 == 0 else body
        out.append(dict(prompt=prompt, max_tokens=rng.randrange(2, 10), temperature=0.0 if i % 3 else 0.9,
                        seed=i, stream=i % 4 == 1))
    return out


async def complete(client, w) -> list[int]:
    common = dict(model="v4serve", prompt=w["prompt"], max_tokens=w["max_tokens"], temperature=w["temperature"],
                  seed=w["seed"], extra_body={"return_token_ids": True})
    if w["stream"]:
        chunks = await client.completions.create(stream=True, **common)
        return [t async for c in chunks for t in (c.choices[0].token_ids if c.choices else [])]
    return (await client.completions.create(**common)).choices[0].token_ids


def through(servers: list[Served], work: list[dict]) -> list[list[int]]:
    """Request i through server i mod len(servers), all at once."""
    async def run():
        clients = [openai.AsyncOpenAI(base_url=s.http + "/v1", api_key="unused", timeout=120, max_retries=0)
                   for s in servers]
        return await asyncio.gather(*(complete(clients[i % len(clients)], w) for i, w in enumerate(work)))
    return asyncio.run(run())


def scrape(server: Served) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.http + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def labelled(metrics: dict[str, float], name: str) -> dict[str, float]:
    """{label text: value} of one metric family."""
    return {m[len(name):]: v for m, v in metrics.items() if re.fullmatch(re.escape(name) + r"\{.*\}", m)}


def epochs(owner) -> dict[str, str]:
    return {w.worker_id: w.epoch for w in Registry(owner.fields["registry"]).workers()}


# --- tests ------------------------------------------------------------------------------------
def test_two_routers_serve_the_same_pools(owner, routers, reference):
    work = workload(16, seed=3)
    got = through(routers, work)
    for i, (w, tokens) in enumerate(zip(work, got)):
        assert tokens == reference(w), (i, "router", i % 2)

    registry = Registry(owner.fields["registry"])
    assert sorted(epochs(owner)) == ["decode-0", "decode-1", "prefill-0"]
    # the prefix index each router built from the KV-event stream, against the stream itself
    index = PrefixIndex(256)
    for event in registry.read_events()[1]:
        index.apply(event)
    expected_pages = {f'{{worker="{w}"}}': float(index.pages(w)) for w in index.workers()}
    assert expected_pages, "the long prompts left pages in the prefill worker's cache"
    deadline = time.time() + 15
    while True:
        views = [scrape(r) for r in routers]
        pages = [labelled(v, "v4serve_prefix_index_pages") for v in views]
        if all(p == expected_pages for p in pages) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert pages == [expected_pages, expected_pages]
    # both see the registry's workers, and export the same pool gauges
    for router, view in zip(routers, views):
        workers = labelled(view, "v4serve_worker_info")
        assert sorted(workers) == [f'{{pool="{w.split("-")[0]}",state="ready",worker="{w}"}}'
                                   for w in sorted(epochs(owner))], workers
        assert labelled(view, "v4serve_queued_prefill_tokens") == {'{pool="prefill"}': 0.0, '{pool="decode"}': 0.0}
        assert httpx.get(router.http + "/health", timeout=10).json() == {"ok": True, "prefill": 1, "decode": 2}
    # every request was counted by the router that served it
    served = [sum(v for k, v in labelled(view, "v4serve_requests_total").items() if "success" in k) for view in views]
    assert served == [len(work[0::2]), len(work[1::2])]


@pytest.mark.exhaustive  # ~15 s
def test_restarted_router_serves_without_restarting_the_pools(tiny_official_ckpt, owner, routers, env, reference):
    before = epochs(owner)
    routers[0].stop(signal.SIGKILL)  # a crash: nothing of the router is left to clean up
    work = workload(6, seed=4)
    assert through([routers[1]], work) == [reference(w) for w in work]  # the other replica serves on
    restarted = start_router(tiny_official_ckpt, owner, env).ready()
    routers[0] = restarted  # the fixture stops it
    work = workload(8, seed=5)
    assert through(routers, work) == [reference(w) for w in work]
    assert epochs(owner) == before  # the same worker processes: no pool was restarted
    assert owner.proc.poll() is None


def test_a_second_owner_of_the_pools_is_refused(tiny_official_ckpt, owner, env):
    before = epochs(owner)
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--model", str(tiny_official_ckpt), *COMMON],
                         env=router_env(owner, env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "another process already owns the pools of cluster 'default'" in out.stderr
    assert epochs(owner) == before


def test_router_without_ray_or_redis_is_refused(tiny_official_ckpt, env):
    clean = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "REDIS_URL")}
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "router", "--model", str(tiny_official_ckpt)],
                         env={**clean, "REDIS_URL": "redis://127.0.0.1:1"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "set RAY_ADDRESS" in out.stderr and "REDIS_URL" in out.stderr


# --- the pool gauges, from load reports -------------------------------------------------------
@pytest.mark.parametrize("loads, queued, pages", [
    ([], {"prefill": 0, "decode": 0}, {"decode": (0, 0)}),
    ([WorkerLoad("prefill-0", "prefill", queued_prefill_tokens=300),
      WorkerLoad("prefill-1", "prefill", queued_prefill_tokens=1200),
      WorkerLoad("decode-0", "decode", queued_prefill_tokens=40, free_pages=10, total_pages=100),
      WorkerLoad("decode-1", "decode", free_pages=200, total_pages=300)],
     {"prefill": 1500, "decode": 40}, {"decode": (190, 200)}),
    ([WorkerLoad("prefill-0", "prefill", queued_prefill_tokens=300),
      WorkerLoad("prefill-1", "prefill", queued_prefill_tokens=5000, draining=True),
      WorkerLoad("decode-0", "decode", free_pages=0, total_pages=64, draining=True),
      WorkerLoad("decode-1", "decode", free_pages=60, total_pages=64)],
     {"prefill": 300, "decode": 0}, {"decode": (4, 64)}),
], ids=["none", "sums", "draining left out"])
def test_pool_gauges(loads, queued, pages):
    """The scaling signals as cluster/autoscaler.py computes them: draining workers left out;
    pages in use over one worker's pages is the decode page-pressure demand in workers."""
    metrics = RouterMetrics()
    metrics.watch_pools(lambda: loads, lambda: {"prefill-0": 7})
    for pool, value in queued.items():
        assert metrics.sample("v4serve_queued_prefill_tokens", {"pool": pool}) == value
    for pool, (in_use, per_worker) in pages.items():
        assert metrics.sample("v4serve_kv_pages_in_use", {"pool": pool}) == in_use
        assert metrics.sample("v4serve_kv_pages_per_worker", {"pool": pool}) == per_worker
    # ...the very amounts the Ray policy scales on, so a KEDA scaler with the same targets agrees
    policy = AutoscalerConfig().decode
    live = [l for l in loads if not l.draining]
    for sig in signals("prefill", AutoscalerConfig().prefill, [l for l in live if l.role == "prefill"]):
        assert sig.amount == queued["prefill"]
    for sig in signals("decode", policy, [l for l in live if l.role == "decode"]):
        if sig.name == "pages_in_use":
            assert (sig.amount, sig.per_worker) == (pages["decode"][0], policy.page_target * pages["decode"][1])
    for load in loads:
        state = "draining" if load.draining else "ready"
        assert metrics.sample("v4serve_worker_info", {"worker": load.worker_id, "pool": load.role, "state": state}) == 1
    assert metrics.sample("v4serve_prefix_index_pages", {"worker": "prefill-0"}) == 7
    body, _ = metrics.render()
    assert body.count(b"v4serve_worker_info{") == len(loads)

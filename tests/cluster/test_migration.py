"""Live KV migration between decode workers, through the router's cluster backend.

Running requests are paused, their pages (SWA window, C4 / C4-indexer / C128 pages, compress-state
rings), generated tokens and sampling state ship over NIXL to another decode worker, which resumes
them; the router follows each request there. The client's stream has no gap and no repeated token:
every output equals `v4serve generate` for the request alone, text included. Used by `migrate`
(rebalancing) and `drain(migrate=True)` (scale-down)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from router.metrics import RouterMetrics
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def cluster(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=8, lease_s=5.0,
                            prefill_token_budget=256, heartbeat_s=0.3)
    c = LocalCluster(ClusterOptions(options, prefill=1, decode=2), Environment(None, None, Path("/tmp"))).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def oracle(tiny_official_ckpt):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    tok = load_tokenizer(tiny_official_ckpt, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)

    memo = {}

    def run(req):
        key = (req.prompt_ids, req.max_tokens, req.sampling)
        if key not in memo:
            pools = KVPools(cfg, "fp32", max_tokens=512, max_seqs=1)
            memo[key] = generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling).token_ids
        return memo[key]

    return run, tok


def requests(seed, n, prefix, max_tokens=(24, 40), copies=1):
    """`n` distinct requests (each `copies` times, under its own id: one reference serves them)."""
    rng = random.Random(seed)
    # prompts across the C128 boundary and past the sliding window (128), so every pool kind moves
    return [GenerateRequest(f"{prefix}{i}-{k}", prompt, max_tokens=tokens, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.9 * (i % 2), top_k=40 * (i % 3), seed=i))
            for i, prompt, tokens in ((i, tuple(rng.randrange(256) for _ in range(rng.randrange(20, 300))),
                                       rng.randrange(*max_tokens)) for i in range(n))
            for k in range(copies)]


async def collect(backend, req, started: asyncio.Event | None = None):
    tokens, text, usage = [], "", None
    async for chunk in backend.generate(req):
        assert chunk.error is None, chunk.error
        assert chunk.request_id == req.request_id
        tokens.extend(chunk.token_ids)
        text += chunk.text
        usage = chunk.usage or usage
        if started is not None and len(tokens) >= 4:
            started.set()
    return tokens, text, usage


def assert_idle(actors, prefill=False, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        accts = [ray.get(a.page_accounting.remote(drop_cache=True) if prefill else a.page_accounting.remote())
                 for a in actors]
        if all(a["free"] == a["idle"] for a in accts) or time.time() > deadline:
            break
        time.sleep(0.3)
    for a in accts:
        assert a["free"] == a["idle"], a
    return accts


def check(reqs, got, oracle):
    run, tok = oracle
    for req, (tokens, text, usage) in zip(reqs, got):
        ref = run(req)
        assert tokens == ref, req.request_id  # no gap, no repeat, no divergence
        assert text == tok.decode(ref), req.request_id
        assert usage.prompt_tokens == len(req.prompt_ids) and usage.completion_tokens == len(ref)


def test_migrate_running_requests_continue_identically(cluster, oracle):
    reqs = requests(1, 3, "mig", max_tokens=(60, 80), copies=2)
    d0, d1 = cluster.decode

    async def run():
        metrics = RouterMetrics()
        backend = ClusterBackend(Registry(cluster.registry_url), oracle[1], "tiny", 512,
                                 PlacementConfig(remote_prefill_threshold=64), metrics, refresh_s=0.1)
        await backend.start()
        await backend.wait_for_workers(prefill=1, decode=2)
        events = [asyncio.Event() for _ in reqs]
        tasks = [asyncio.ensure_future(collect(backend, r, e)) for r, e in zip(reqs, events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        moved = await d0.migrate.remote(to="decode-1")  # whatever runs on decode-0 now
        got = await asyncio.gather(*tasks)
        await backend.stop()
        return got, moved, metrics

    got, moved, metrics = asyncio.run(run())
    check(reqs, got, oracle)
    assert moved and all(m["moved"] for m in moved), moved
    assert metrics.sample("v4serve_retargeted_requests_total", {"path": "migrate"}) == len(moved)
    a0, a1 = assert_idle([d0, d1])
    assert a0["counts"]["migrations_out"] == len(moved) and a1["counts"]["migrations_in"] == len(moved)
    assert a0["sent"]["bytes"] > 0 and a1["transfers"]["failures"] == {}
    assert_idle(cluster.prefill, prefill=True)


def test_autoscaler_scale_down_migrates_running_requests(cluster, oracle):
    """The Ray actuator shrinks the decode pool under load: the drained worker's running requests
    move to the other one instead of being waited for, and then it is removed."""
    from cluster.autoscale_actuator import ActuatorOptions, RayActuator

    reqs = requests(2, 3, "scl", max_tokens=(60, 80), copies=2)

    async def run():
        registry = Registry(cluster.registry_url)
        backend = ClusterBackend(registry, oracle[1], "tiny", 512, PlacementConfig(remote_prefill_threshold=64),
                                 RouterMetrics(), refresh_s=0.1)
        await backend.start()
        await backend.wait_for_workers(prefill=1, decode=2)
        events = [asyncio.Event() for _ in reqs]
        tasks = [asyncio.ensure_future(collect(backend, r, e)) for r, e in zip(reqs, events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        actuator = RayActuator(cluster, registry, lambda loads, now: {"prefill": 1, "decode": 1},
                               ActuatorOptions(interval_s=0.2, settle_s=0.5)).start()
        got = await asyncio.gather(*tasks)
        deadline = time.monotonic() + 60
        while not any(e.kind == "removed" for e in actuator.events) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await actuator.stop()
        await backend.stop()
        return got, list(actuator.events)

    got, events = asyncio.run(run())
    check(reqs, got, oracle)
    drained = [e for e in events if e.kind == "drained"]
    assert len(drained) == 1 and drained[0].detail["idle"] and drained[0].detail["migrated"] > 0, events
    assert [e.worker_id for e in events if e.kind == "removed"] == [drained[0].worker_id]
    assert len(cluster.decode) == 1
    assert_idle(cluster.decode)


@pytest.mark.exhaustive  # ~30-36 s; the drain itself is in CI through the autoscaler's scale-down below
def test_v4serve_drain_cli_migrates_a_decode_worker(cluster, oracle):
    """`v4serve drain WORKER` against the running cluster (a separate process joining its Ray)."""
    added = cluster.add_worker("decode")  # the previous test left one decode worker
    survivor = next(a for a in cluster.decode if a._actor_id != ray.get_actor(added)._actor_id)
    victim = ray.get(survivor.start.remote())["worker_id"]
    # long enough to be running when the CLI process has joined Ray (seconds)
    reqs = requests(3, 2, "cli", max_tokens=(150, 160), copies=2)

    async def run():
        backend = ClusterBackend(Registry(cluster.registry_url), oracle[1], "tiny", 512,
                                 PlacementConfig(remote_prefill_threshold=64), RouterMetrics(), refresh_s=0.1)
        await backend.start()
        await backend.wait_for_workers(prefill=1, decode=2)
        events = [asyncio.Event() for _ in reqs]
        tasks = [asyncio.ensure_future(collect(backend, r, e)) for r, e in zip(reqs, events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        before = (await survivor.page_accounting.remote())["counts"].get("migrations_out", 0)
        env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cluster.cli", "drain", victim,
                                                       "--settle", "0.5"],
                                      capture_output=True, text=True, timeout=300, env=env)
        got = await asyncio.gather(*tasks)
        await backend.stop()
        return got, out, before

    got, out, before = asyncio.run(run())  # last in this module: the drained worker stays draining
    assert out.returncode == 0, out.stderr
    drained = json.loads(out.stdout.strip().splitlines()[-1])
    check(reqs, got, oracle)
    assert drained["worker_id"] == victim and drained["idle"] and drained["migrated"] > 0, drained
    accts = assert_idle(cluster.decode)
    moved = sum(a["counts"].get("migrations_out", 0) for a in accts if a["counts"].get("migrations_out"))
    assert ray.get(survivor.page_accounting.remote())["counts"]["migrations_out"] - before == drained["migrated"]
    assert moved >= drained["migrated"]
